"""Speculative decoding (issue 46): the verify rounds' tokens against plain decoding (greedy and seeded sampling) on several
meshes, through static_batch.generate, LLM's scheduler, generate's flag and bench.

Budget: the plain 1x1 runs give the reference tokens (greedy and seeded tokens are the
same on every mesh, test_engine_mesh); each mesh then builds one engine (1x1's is the
plain runs' own) and compiles one prefill and the verify programs its passes meet (one
per draft count of the ladder a pace reaches). An oracle
drafter (the plain run's tokens, with some drafts made wrong on purpose) makes every
acceptance length occur: all drafts kept, none, and the run cut in between; the ngram
drafter runs through generate's flag. The meshes are the issue's: 1x1, 2x1, 4x1 (five
layers over four stages), 1x2, 2x2 and 1x1x2.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
import scipy.stats
from reference import TINY, Oracle, measured_rule

from qwen3_spmd import LLM, SamplingParams
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig
from qwen3_spmd.pipeline.speculative.draft_model import DraftModel, pass_length
from qwen3_spmd.pipeline.speculative.policy import (
    PROBE_AFTER,
    Unmeasured,
    ladder,
)
from qwen3_spmd.pipeline.speculative.speculator import Speculator, make_speculator
from qwen3_spmd.pipeline.speculative.verify import VerifyShape
from qwen3_spmd.run.cli import main
from qwen3_spmd.sharding.mesh import make_mesh

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13], [3, 4, 3, 4, 3, 4, 3]]
N_NEW = 20
TOL = 1e-4  # log-probabilities: a pass over k + 1 positions sums attention in its own order
EOS = (301,)  # the tiny model's greedy runs produce it: two requests stop early


def test_rounds_decode_plain_where_the_measured_pass_does_not_pay(engines, plain):
    """The round rule in the executor's rounds: with passes measured as dear, every
    round decodes a plain chunk though the oracle drafts (fewer rounds than
    PROBE_AFTER); measured as cheap, rounds verify. The tokens are plain decoding's
    either way."""
    tokens, _ = plain["greedy"]
    engine = engines(1, 1, 1)
    runs = {tuple(p): t for p, t in zip(PROMPTS, tokens)}
    for seconds, passes in ((1e3, False), (1e-9, True)):
        spec = Speculator(engine, Oracle(runs, 4))
        spec.rule = measured_rule(1.0, dict.fromkeys([2, 3, 5], seconds))
        _gives_plain(engine, plain, "greedy", spec)
        assert (spec.metrics.drafts > 0) == passes
        assert spec.rule.rounds < PROBE_AFTER


# ---- verify rounds against plain decoding -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    cfg = Qwen3Config.from_hf(TINY)
    return cfg, HFCheckpoint(TINY, cfg)


SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9)
SEED = 3


@pytest.fixture(scope="module")
def plain(engines):
    """The plain runs' (tokens, finish reasons): greedy, and seeded sampling, on 1x1 (on
    the engine the 1x1 verify test then speculates on)."""
    engine = engines(1, 1, 1)
    runs = {}
    for name, sampling in (("greedy", Sampling()), ("sampled", SAMPLED)):
        out = static_batch.generate(
            engine, PROMPTS, N_NEW, sampling=sampling, seed=SEED, eos_ids=EOS, with_logits=False
        )
        runs[name] = (
            [c.token_ids for c in out.completions],
            [c.finish_reason for c in out.completions],
        )
    return runs


def _engine(tiny, S, C, X=1, **kwargs):
    cfg, source = tiny
    mesh = make_mesh(S, C, jax.devices()[: S * C * X], tensor=X)
    # 128 slots: more than ring.DECODE_BLOCK on one seq device, so attention reads the
    # cache's filled blocks (the path a long request takes); 64 a device on 1x2.
    return Engine(cfg, source, mesh, max_seq_len=128, **kwargs)


@pytest.fixture(scope="module")
def engines(tiny):
    """One engine per mesh, shared by its greedy and sampled runs (one prefill compile)."""
    made = {}

    def get(S, C, X):
        if (S, C, X) not in made:
            made[S, C, X] = _engine(tiny, S, C, X)
        return made[S, C, X]

    return get


def _gives_plain(engine, plain, how: str, speculator: Speculator) -> None:
    """PROMPTS through static_batch.generate on `engine` with `speculator`, greedy or
    seeded-sampled: the plain run's tokens and finish reasons."""
    tokens, finish = plain[how]
    sampling = SAMPLED if how == "sampled" else Sampling()
    out = static_batch.generate(
        engine,
        PROMPTS,
        N_NEW,
        sampling=sampling,
        seed=SEED,
        eos_ids=EOS,
        with_logits=False,
        speculator=speculator,
    )
    assert [c.token_ids for c in out.completions] == tokens
    assert [c.finish_reason for c in out.completions] == finish


@pytest.mark.parametrize(
    "S, C, X, k, how",
    [
        # (two stages alone: 2x2's groups over stages cover them, with seq beside)
        (1, 1, 1, 4, "greedy"),
        (4, 1, 1, 2, "greedy"),  # 5 layers over 4 stages: padded ones pass through
        (1, 2, 1, 3, "greedy"),
        (2, 2, 1, 4, "greedy"),  # a pass's K/V split over seq, its groups over stages
        (1, 1, 2, 3, "greedy"),
        # Sampled rows: the draws at each position are the plain run's (same keys). The
        # path that differs from greedy is the head's (the vocabulary gathered under
        # tensor); the stages' schedule is greedy's (and LLM's test samples on 1x1).
        (1, 1, 2, 3, "sampled"),
    ],
)
def test_verify_rounds_give_plain_tokens(engines, plain, S, C, X, k, how):
    tokens, finish = plain[how]
    assert finish.count("stop") == (2 if how == "greedy" else 0)  # an end inside a pass too
    engine = engines(S, C, X)
    runs = {tuple(p): t for p, t in zip(PROMPTS, tokens)}
    spec = Speculator(engine, Oracle(runs, k))
    _gives_plain(engine, plain, how, spec)
    m = spec.metrics
    # Every acceptance occurred: some drafts kept, some refused, so neither path is idle.
    assert 0 < m.accepted_tokens < m.draft_tokens
    # Fewer passes than tokens: the rounds did give several tokens each.
    assert m.drafts < sum(len(t) - 1 for t in tokens)


# The tiny model's greedy runs from these fall into loops (the first within a few
# tokens), so prompt lookup's drafts are kept often, and refused where a loop starts
# or ends; its sampled runs repeat themselves less.
LOOPING = [[33], [22], [126, 120, 8]]
LOOP_NEW = 40
LOOKUP = SpeculativeConfig(3, "ngram", 2, 1)


@pytest.fixture(scope="module")
def looping(engines):
    """The plain 1x1 tokens of LOOPING, greedy and seeded-sampled."""
    engine = engines(1, 1, 1)
    return {
        how: [
            c.token_ids
            for c in static_batch.generate(
                engine, LOOPING, LOOP_NEW, sampling=sampling, seed=SEED, with_logits=False
            ).completions
        ]
        for how, sampling in (("greedy", Sampling()), ("sampled", SAMPLED))
    }


@pytest.mark.parametrize(
    "S, C, X, how",
    [
        (1, 1, 1, "greedy"),
        # (two groups over two stages alone: 2x2's, with its K/V split over seq)
        (4, 1, 1, "greedy"),  # three groups over four stages: bubbles
        (2, 2, 1, "greedy"),  # each pass's K/V split over seq
        (1, 1, 2, "sampled"),  # the vocabulary split over tensor, rows drawn
        (1, 1, 2, "greedy"),  # the greedy choice over a split vocabulary (greedy_split)
    ],
)
def test_rounds_on_the_device_give_plain_tokens(engines, looping, monkeypatch, S, C, X, how):
    """ngram's rounds run as loops on the device (`pipeline.speculative.loop`: draft, verify,
    accept and carry back with no host between passes) and give plain decoding's
    tokens, with drafts kept and refused. The loop compiles ahead beside its pass
    (`Speculator.compile`, what serve runs in the background): the run compiles none."""
    engine = engines(S, C, X)
    rounds = []
    run_loop = Speculator._loop
    monkeypatch.setattr(
        Speculator, "_loop", lambda self, *a: rounds.append(a[-1].rounds) or run_loop(self, *a)
    )
    spec = Speculator(engine, LOOKUP)

    def loops() -> set[str]:
        return {name for name in engine.programs.compiled if name.startswith("spec_loop ")}

    B, groups = static_batch.batch_rows(engine, len(LOOPING))
    before = loops()
    T = 1 + LOOKUP.num_speculative_tokens
    shape = VerifyShape(B, T, how == "sampled", False)
    spec.compile(shape, B, B * engine.pages_per_row, groups, announce=False)  # a static pool
    ahead = loops()
    assert len(ahead - before) == 1  # one loop, its widths those of the ladder
    sampling = SAMPLED if how == "sampled" else Sampling()
    out = static_batch.generate(
        engine, LOOPING, LOOP_NEW, sampling=sampling, seed=SEED, with_logits=False, speculator=spec
    )
    assert [c.token_ids for c in out.completions] == looping[how]
    assert loops() == ahead
    m = spec.metrics
    assert rounds and max(rounds) > 1  # loops of several rounds ran
    assert 0 < m.accepted_tokens < m.draft_tokens


def test_no_drafts_while_more_rows_are_busy_than_disable_by_batch_size(engines):
    """vLLM's disable_by_batch_size 2: three requests decode plain chunks (no pass at
    all), two speculate; the tokens are plain decoding's either way."""
    engine = engines(1, 1, 1)
    plain = static_batch.generate(engine, PROMPTS, N_NEW, with_logits=False)  # no end id
    tokens = [c.token_ids for c in plain.completions]
    config = SpeculativeConfig(3, "ngram", 2, 1, disable_by_batch_size=2)
    for n in (3, 2):  # the last n: the last prompt repeats itself, so ngram drafts
        spec = Speculator(engine, config)
        out = static_batch.generate(engine, PROMPTS[-n:], N_NEW, with_logits=False, speculator=spec)
        assert [c.token_ids for c in out.completions] == tokens[-n:]
        m = spec.metrics
        assert (m.drafts > 0, out.layout["verify_ticks"] > 0) == (n <= 2,) * 2


def test_verify_passes_compile_ahead_as_a_server_does(engines, plain):
    """`Speculator.shapes` lists every verify pass a scheduler's rounds can meet (what
    serve compiles in the background): compiled ahead, a load of greedy and sampled
    requests over two rows with an oracle's drafts compiles no other verify program."""
    from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler

    engine = engines(1, 1, 1)
    (greedy, _), (sampled, _) = plain["greedy"], plain["sampled"]
    runs = {tuple(p): t for p, t in zip(PROMPTS, [greedy[0], sampled[1], greedy[2]])}
    spec = Speculator(engine, Oracle(runs, 2))
    sched = Scheduler(engine, max_batch=2, speculator=spec)

    def verify_programs() -> set[str]:
        return {name for name in engine.programs.compiled if name.startswith("verify ")}

    try:
        rows = sched.rules.decode_row_counts()
        shapes = spec.shapes(rows)
        assert len(set(shapes)) == len(rows) * len(ladder(2)) * 2 == 8  # rows 1 and 2
        sched.precompile(shapes, workers=1, announce=False)
        ahead = verify_programs()  # with those the module's other tests compiled
        cache = "x".join(map(str, engine.pool_shape(sched.pages)))
        assert {
            f"verify 1 {s.T} {'sampled' if s.sampled else 'greedy'} [{cache}; {s.rows}x{s.T}]"
            for s in shapes
        } <= ahead
        params = [Params(N_NEW, eos_ids=EOS, seed=SEED), Params(N_NEW, SAMPLED, seed=SEED)]
        handles = [sched.submit(p, params[i % 2], i) for i, p in enumerate(PROMPTS)]
        sched.run()
        assert [h.tokens for h in handles] == [greedy[0], sampled[1], greedy[2]]
        assert spec.metrics.accepted_tokens > 0
        assert verify_programs() == ahead
    finally:
        sched.close()


class Wrong(Oracle):
    """Drafts the oracle's tokens plus one: never kept."""

    def propose(self, context, k):
        return [t + 1 for t in super().propose(context, k)]


def test_a_drafter_that_is_always_wrong_is_paced_off(engines, plain):
    """Each miss makes the row wait longer before it drafts again, and rounds where no
    row drafts run as plain decode chunks: the tokens are plain decoding's, and the 20
    tokens a request makes cost a handful of passes, not one a token."""
    tokens, finish = plain["greedy"]
    engine = engines(1, 1, 1)
    runs = {tuple(p): t for p, t in zip(PROMPTS, tokens)}
    spec = Speculator(engine, Wrong(runs, 4))
    out = static_batch.generate(
        engine, PROMPTS, N_NEW, eos_ids=EOS, with_logits=False, speculator=spec
    )
    assert [c.token_ids for c in out.completions] == tokens
    assert [c.finish_reason for c in out.completions] == finish
    m = spec.metrics
    assert m.accepted_tokens == 0
    # Each row: a pass of 4 drafts, then probes of one after 2, 4, 8 tokens (and 16,
    # past the longest run).
    assert m.drafts <= 4 * len(PROMPTS) and m.draft_tokens <= m.drafts + 3 * len(PROMPTS)
    assert out.layout["verify_ticks"] > 0
    assert out.layout["decode_ticks"] > out.layout["verify_ticks"]  # plain chunks ran too


@dataclasses.dataclass(frozen=True)
class Likeliest:
    """Drafts the model's likeliest next token after each context of `table`."""

    table: dict  # context (a tuple of ids) -> the model's argmax after it
    num_speculative_tokens: int

    def propose(self, context, k):
        return [self.table[tuple(context)]][:k]


def test_sampled_speculation_draws_from_the_models_distribution(engines):
    """The issue's statistical check. Over many seeds, the joint distribution of a
    request's first three tokens, sampled with speculation (a pass of one draft after
    the first token, drafting the likeliest second token, so it is kept about as often
    as that token is drawn), against the model's own: temperature and top-k applied to
    its logits after each of the 1 + 3 + 9 contexts, multiplied out. A chi-square test
    over the 27 cells (those expecting fewer than 5 draws pooled). Keeping the draft
    unchecked fails it (the third token is then drawn after the draft, not after the
    second token). Seeded tokens equal to plain sampling's, per key, is the stronger
    claim (test_verify_rounds_give_plain_tokens); this one needs no plain run."""
    engine = engines(1, 1, 1)
    sampling, top = Sampling(temperature=1.5, top_k=3), 3
    prompt = tuple(PROMPTS[1])

    def filtered(context):  # {token: probability} as the model samples after `context`
        out = static_batch.generate(engine, [list(context)] * 3, 1)
        logits = out.first_logits[0].astype(np.float64) / sampling.temperature
        ids = np.argsort(logits)[::-1][:top]
        p = np.exp(logits[ids] - logits[ids].max())
        return dict(zip(ids.tolist(), p / p.sum()))

    joint, likeliest = {}, {}
    first = filtered(prompt)
    for t1, p1 in first.items():
        second = filtered(prompt + (t1,))
        likeliest[prompt + (t1,)] = max(second, key=second.get)
        for t2, p2 in second.items():
            for t3, p3 in filtered(prompt + (t1, t2)).items():
                joint[t1, t2, t3] = p1 * p2 * p3
    spec = Speculator(engine, Likeliest(likeliest, 2))
    spec.rule = Unmeasured()  # every request's pass runs
    seeds, rows = 200, 3
    drawn = dict.fromkeys(joint, 0)
    for seed in range(seeds):  # rows requests a call, each its own key
        out = static_batch.generate(
            engine,
            [list(prompt)] * rows,
            3,
            sampling=sampling,
            seed=seed,
            with_logits=False,
            speculator=spec,
        )
        for c in out.completions:
            drawn[tuple(c.token_ids)] += 1  # a token outside the top 3: KeyError
    m = spec.metrics
    assert m.drafts == seeds * rows  # one pass a request, its draft kept or not
    assert 0.3 < m.accepted_tokens / m.draft_tokens < 0.9
    n = seeds * rows
    cells = sorted(joint, key=joint.get)
    expected = np.array([joint[c] * n for c in cells])
    observed = np.array([drawn[c] for c in cells], np.float64)
    rare = np.cumsum(expected) < 5  # the rarest cells, pooled into one
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3


# ---- draft_model: a smaller Qwen3 drafts -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FirstLayers:
    """The tiny checkpoint's first cfg.L layers: a drafter that agrees with the model
    often, and not always, as a smaller model of the same family would."""

    full: HFCheckpoint
    cfg: Qwen3Config

    def read(self, path, dtype, layers=None, part=None):
        return self.full.read(path, dtype, layers, part)


@pytest.fixture(scope="module")
def drafters(tiny):
    """One draft model a mesh: the tiny model's first four layers."""
    cfg, source = tiny
    small = dataclasses.replace(cfg, num_hidden_layers=cfg.L - 1)
    made = {}

    def get(mesh):
        key = tuple(mesh.shape.values())
        if key not in made:
            made[key] = Engine(small, FirstLayers(source, small), mesh, max_seq_len=128)
        return made[key]

    return get


@pytest.mark.parametrize(
    "S, C, X, k, how",
    [  # k as the oracle's test on the mesh, so the model's verify programs are shared
        (1, 1, 1, 4, "greedy"),
        (1, 1, 1, 4, "sampled"),
        (2, 1, 1, 3, "greedy"),
        (4, 1, 1, 2, "greedy"),  # the drafter's four layers over four stages
        (1, 2, 1, 3, "greedy"),
        (2, 2, 1, 4, "greedy"),  # the drafter's K/V split over seq, its passes over stages
        (1, 1, 2, 3, "greedy"),
    ],
)
def test_a_draft_model_gives_plain_tokens(engines, drafters, plain, S, C, X, k, how):
    """A smaller model drafts on the model's mesh, its cache caught up on each row's
    tokens and rolled back past rejected drafts: the tokens are plain decoding's, and
    some drafts are kept and some are not."""
    engine, draft = engines(S, C, X), drafters(engines(S, C, X).mesh)
    config = {"method": "draft_model", "model": "first layers", "num_speculative_tokens": k}
    spec = make_speculator(engine, config, draft)
    if (S, C, X, how) == (1, 1, 1, "greedy"):  # compiled ahead as serve does: no other
        spec.drafter.compile(len(PROMPTS), len(PROMPTS), 1, sampled=False, announce=False)
        ahead = set(draft.programs.compiled)
    _gives_plain(engine, plain, how, spec)
    m = spec.metrics
    assert 0 < m.accepted_tokens < m.draft_tokens
    if (S, C, X, how) == (1, 1, 1, "greedy"):
        assert set(draft.programs.compiled) == ahead


class CountedPasses(DraftModel):
    """A draft model that notes each pass's length."""

    def __init__(self, engine, lengths):
        super().__init__(engine, lengths)
        self.ran = []

    def _pass(self, book, n, T, pieces, clock, allowed):
        self.ran.append(T)
        return super()._pass(book, n, T, pieces, clock, allowed)


def test_a_long_prompt_catches_the_drafter_up_in_full_long_passes(engines, drafters):
    """A 41-token context with a long pass of 32: the drafter catches up with one long
    pass and one of 16 (9 tokens), never a long pass mostly padding; the tokens are
    plain decoding's."""
    assert [pass_length(n) for n in (1, 3, 16, 17, 127, 128, 300)] == [1, 4, 16, 16, 16, 128, 128]
    engine = engines(1, 1, 1)
    prompts = [[(7 * i) % 250 + 3 for i in range(40)], *PROMPTS[1:]]
    want = static_batch.generate(engine, prompts, N_NEW, with_logits=False)
    draft = CountedPasses(drafters(engine.mesh), lengths=(1, 4, 16, 32))
    config = SpeculativeConfig(2, "draft_model", model="first layers")
    spec = Speculator(engine, config, draft)
    spec.rule = Unmeasured()  # every round drafts
    got = static_batch.generate(engine, prompts, N_NEW, with_logits=False, speculator=spec)
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]
    assert draft.ran[:2] == [32, 16] and draft.ran.count(32) == 1


def test_a_draft_model_draws_with_the_rows_keys(engines, plain):
    """A sampled row's drafts are the draft model's draws with the key the model draws
    with at that step (seed, request, step): a draft model that is the model itself
    proposes exactly the model's draws, so every draft is kept (its greedy choices
    would be kept only where the draw is the argmax)."""
    engine = engines(1, 1, 1)
    itself = {"method": "draft_model", "model": "itself", "num_speculative_tokens": 4}
    spec = make_speculator(engine, itself, engine)
    _gives_plain(engine, plain, "sampled", spec)
    m = spec.metrics
    assert 0 < m.accepted_tokens == m.draft_tokens


def test_a_draft_model_through_llm_and_its_refusals():
    """speculative_config's draft_model through LLM's door: the drafter's checkpoint
    opened as the model's is, on the model's mesh with its settings (its tokens are the
    test above's); a drafter with another vocabulary, or none at the path, is refused
    in one line."""
    settings = dict(mesh="1x1", max_seq_len=32, max_batch=2, enable_prefix_caching=False)
    config = {"method": "draft_model", "model": str(TINY), "num_speculative_tokens": 2}
    with LLM(str(TINY), speculative_config=config, **settings) as llm:
        spec = llm.scheduler.speculator
        draft = spec.drafter.engine
        assert spec.config == SpeculativeConfig(2, "draft_model", model=str(TINY))
        assert draft.mesh is llm.engine.mesh and draft.cfg == llm.engine.cfg
        assert (draft.max_seq_len, draft.dtype) == (llm.engine.max_seq_len, llm.engine.dtype)
    for model, words in ((TINY.parent / "wide", "vocabulary has 333 tokens"), ("/no/such", "")):
        with pytest.raises(RequestError) as e:
            LLM(str(TINY), speculative_config={**config, "model": str(model)}, **settings)
        message = str(e.value)
        assert "\n" not in message and f"model {model}" in message and words in message


# ---- the doors: LLM (the continuous-batching scheduler) and the command line -------------------


def test_llm_speculates_through_the_scheduler_with_plain_tokens(plain):
    """Three prompts over two rows: the third joins a running row set, so one verify
    pass holds rows at different steps, and a row ends beside one that goes on; the
    second samples (key (seed, prompt index, step), as static_batch.generate's) beside greedy
    rows."""
    (greedy, greedy_end), (sampled, sampled_end) = plain["greedy"], plain["sampled"]
    tokens = [greedy[0], sampled[1], greedy[2]]
    config = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    # the module engines' settings (max_seq_len 128, chunk 16), whose programs the
    # session's compile cache then gives back
    settings = dict(max_seq_len=128, max_batch=2, enable_prefix_caching=False)
    settings.update(dtype="float32")  # exact tokens are float32's claim, on a GPU too
    with LLM(str(TINY), mesh="1x1", speculative_config=config, **settings) as llm:
        assert llm.scheduler.speculator.config == SpeculativeConfig(2, "ngram", 2, 2)
        runs = {tuple(p): t for p, t in zip(PROMPTS, tokens)}
        llm.scheduler.speculator = Speculator(llm.engine, Oracle(runs, 2))
        stop = dict(max_tokens=N_NEW, stop_token_ids=list(EOS), ignore_eos=True, seed=SEED)
        hot = dict(temperature=SAMPLED.temperature, top_k=SAMPLED.top_k, top_p=SAMPLED.top_p)
        params = [SamplingParams(**stop), SamplingParams(**stop, **hot), SamplingParams(**stop)]
        outs = llm.generate(PROMPTS, params)
        m = llm.scheduler.speculator.metrics
        # Log-probabilities: a kept token's as the verify pass computed it, against the
        # plain decode chunk's (the same scheduler with its speculator set aside).
        ask = Params(N_NEW, eos_ids=EOS, logprobs=True)
        handle = llm.scheduler.submit(PROMPTS[0], ask)
        list(handle)
        speculating, llm.scheduler.speculator = llm.scheduler.speculator, None
        ref = llm.scheduler.submit(PROMPTS[0], ask)
        list(ref)
        llm.scheduler.speculator = speculating
    assert [o.token_ids for o in outs] == tokens
    assert [o.finish_reason for o in outs] == [greedy_end[0], sampled_end[1], greedy_end[2]]
    assert 0 < m.accepted_tokens < m.draft_tokens
    assert handle.tokens == ref.tokens == greedy[0]
    assert len(handle.logprobs) == len(ref.logprobs) == len(greedy[0])
    for got, want in zip(handle.logprobs, ref.logprobs):
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        np.testing.assert_allclose(
            [got.chosen, *(v for _, v in got.top)],
            [want.chosen, *(v for _, v in want.top)],
            atol=TOL,
        )


def test_llm_refuses_a_malformed_config_in_one_line():
    with pytest.raises(RequestError) as e:
        LLM(str(TINY), mesh="1x1", speculative_config={"method": "eagle"})
    assert str(e.value) == "speculative_config: method 'eagle' is not one of ngram, draft_model"


def test_the_flag_gives_serve_generate_and_llm_one_engine_setting():
    from qwen3_spmd.run import llm
    from qwen3_spmd.run.cli import build_parser
    from qwen3_spmd.run.engine_args import EngineArgs

    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    for command in ("serve", "generate"):
        args = EngineArgs.from_cli(
            build_parser().parse_args([command, "--speculative-config", text])
        )
        args.check()
        assert args.speculative_config == text, command
    mapping = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert llm.engine_args(speculative_config=mapping).speculative_config == mapping
    assert SpeculativeConfig.parse(text) == SpeculativeConfig.parse(mapping)


@pytest.mark.parametrize(
    "flag, words",
    [
        ("{bad", "--speculative-config: not JSON (Expecting property name"),
        ('{"num_speculative_tokens": 2, "k": 1}', "--speculative-config: unknown key 'k'"),
    ],
)
def test_generate_refuses_a_malformed_flag_in_one_line(capsys, flag, words):
    assert main(["generate", "--prompt-ids", "1,2", "--speculative-config", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err


def test_metrics_say_drafts_and_acceptances_with_vllm_names():
    from types import SimpleNamespace as NS

    from prometheus_client import generate_latest

    from qwen3_spmd.pipeline.speculative.speculator import SpecMetrics
    from qwen3_spmd.run.serve.metrics import Metrics

    def service(speculator):
        engine = NS(programs=NS(compiled=[]))
        scheduler = NS(
            engine=engine,
            speculator=speculator,
            running=0,
            waiting=0,
            rows_busy=0,
            B=2,
            compiles_left=0,
            clock=NS(compile_s=0.0),
            prefix=None,
            kv_usage=0.0,
            pages=1,
            kv_tokens=16,
            preemptions=0,
            replica_starts=[0],
        )
        return NS(scheduler=scheduler, settings=NS(model_name="m"))

    spec = NS(metrics=SpecMetrics(drafts=3, draft_tokens=9, accepted_tokens=5))
    text = generate_latest(Metrics(service(spec)).registry).decode()
    assert 'qwen3_spmd:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'qwen3_spmd:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'qwen3_spmd:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert spec.metrics.mean_acceptance_length == 1 + 5 / 3
    assert "spec_decode" not in generate_latest(Metrics(service(None)).registry).decode()


def test_generate_flag_speculates_and_reports_it(capsys, plain):
    tokens, _ = plain["greedy"]
    argv = ["generate", "--model", str(TINY), "--mesh", "1x1", "--max-new-tokens", str(N_NEW)]
    argv += ["--dtype", "float32"]  # a GPU's default is bfloat16
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    assert main([*argv, "--speculative-config", config, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The plain run stopped at 301; without that end id the run goes on the same way.
    got = [r["token_ids"] for r in out["requests"]]
    assert [g[: len(t)] for g, t in zip(got, tokens)] == tokens
    spec = out["speculative"]
    assert spec["num_speculative_tokens"] == 3 and spec["prompt_lookup_min"] == 1
    assert spec["num_draft_tokens"] > 0


def test_bench_scenario_bounds_the_mechanism_and_checks_the_tokens(capsys):
    """bench --scenario speculative (1x1, B=1, k=2): the oracle's every draft kept (3
    tokens a pass), the wrong drafter's none, the model drafting for itself every one,
    every run's tokens plain decoding's."""
    argv = ["bench", "--smoke", "--scenario", "speculative", "--batches", "1", "--json"]
    argv += ["--repeats", "1", "--warmup", "0"]  # what is checked is exactness, not time
    argv += ["--dtype", "float32"]  # a GPU's default is bfloat16
    assert main(argv) == 0
    (job,) = json.loads(capsys.readouterr().out)["meshes"][0]["speculative"]
    drafters = job["drafters"]
    itself = "draft model (itself) k=2"
    lookups = {"ngram k=2", "ngram k=2, device loops", "ngram k=2, host rounds"}
    assert set(drafters) == {"plain", "oracle k=2", "wrong k=2", itself} | lookups
    assert all(d["exact"] for d in drafters.values())
    assert {d["same_until"] for d in drafters.values()} == {job["steps"] + 1}  # every token
    assert drafters["oracle k=2"]["acceptance"] == 1.0
    assert drafters["oracle k=2"]["mean_acceptance_length"] == 3.0
    assert drafters["wrong k=2"]["acceptance"] == 0.0
    assert drafters[itself]["acceptance"] == 1.0
    assert drafters["plain"]["vs_plain"] == 1.0
