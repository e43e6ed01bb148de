"""The sharded engine on ('stage', 'seq') meshes of emulated CPU devices, against the
transformers fixtures and against its own 1x1 run.

Budget: every engine is built once per (model, mesh, M, G, poison) and every batch is
generated once (module-scoped caches); all prompts of a fixture go in one batch, and
each run makes N_NEW tokens so that every `seq` device receives decode slots.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest
from reference import FIXTURES

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.checkpoint.random_weights import RandomWeights
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.layers import DecoderLayer
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.scheduling.static_batch import Generation
from qwen3_spmd.ring import zigzag
from qwen3_spmd.ring.pages import as_rows
from qwen3_spmd.sharding.mesh import make_mesh

TOL = 1e-4
N_NEW = 12  # 11 decode steps: every seq device of C <= 8 gets at least one decode slot
GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9)
SEED = 3

# A config of our own for 8 stages (the fixtures have at most 5 layers): 9 layers,
# prime-ish sizes, grouped-query heads, head_dim independent of the width.
RAND9 = Qwen3Config(
    vocab_size=263,
    hidden_size=52,
    intermediate_size=97,
    num_hidden_layers=9,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=14,
    max_position_embeddings=256,
    rope_theta=10_000.0,
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """An engine: model, mesh S x C, microbatches M, groups G (None = S), poison."""

    model: str = "tiny"
    S: int = 1
    C: int = 1
    M: int = 1
    G: int | None = None
    poison: bool = False

    def __str__(self):
        extra = "".join(
            [
                f"-M{self.M}" if self.M > 1 else "",
                f"-G{self.G}" if self.G else "",
                "-poison" if self.poison else "",
            ]
        )
        return f"{self.model}-{self.S}x{self.C}{extra}"


@dataclasses.dataclass
class Run:
    setup: Setup
    engine: Engine
    prompts: list
    gen: Generation
    k: Any  # the returned cache's rows, numpy [L_pad, B, K, C * S_loc, H] (`ring.pages.as_rows`)
    v: Any
    slot_pos: np.ndarray  # [B, C * S_loc]
    pool: tuple  # the returned pool's k and v, jax arrays [L_pad, pages, K, C bs, H]

    @property
    def tokens(self):
        return [c.token_ids for c in self.gen.completions]


def _model(name):
    if name == "rand9":
        rng = np.random.default_rng(7)
        prompts = [rng.integers(0, RAND9.V, n).tolist() for n in (13, 5, 1, 29)]
        return RAND9, RandomWeights(RAND9, seed=1), prompts, None, 64
    folder = FIXTURES / name
    cfg = Qwen3Config.from_hf(folder)
    ref = np.load(folder / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(int(ref["num_prompts"]))]
    max_seq = {"tiny": 64, "yarn": 80}[name]
    return cfg, HFCheckpoint(folder, cfg), prompts, ref, max_seq


class Runs:
    def __init__(self):
        self.engines: dict[Setup, Engine] = {}
        self.runs: dict[tuple, Run] = {}
        self.models = {}

    def model(self, name):
        if name not in self.models:
            self.models[name] = _model(name)
        return self.models[name]

    def engine(self, setup: Setup) -> Engine:
        if setup not in self.engines:
            cfg, source, _, _, max_seq = self.model(setup.model)
            mesh = make_mesh(setup.S, setup.C, jax.devices()[: setup.S * setup.C])
            self.engines[setup] = Engine(
                cfg,
                source,
                mesh,
                max_seq_len=max_seq,
                microbatches=setup.M,
                groups=setup.G,
                chunk=4,
                poison=setup.poison,
            )
        return self.engines[setup]

    def run(
        self,
        setup: Setup,
        batch: tuple[int, ...] | None = None,
        sampling=GREEDY,
        n_new: int = N_NEW,
    ) -> Run:
        """Generates the fixture's prompts (or those with the indices in `batch`)."""
        key = (setup, batch, sampling, n_new)
        if key not in self.runs:
            eng = self.engine(setup)
            all_prompts = self.model(setup.model)[2]
            prompts = all_prompts if batch is None else [all_prompts[i] for i in batch]
            gen = static_batch.generate(eng, prompts, n_new, sampling=sampling, seed=SEED)
            k, v, slot_pos, table = gen.cache
            rows = [as_rows(np.asarray(a), np.asarray(table), eng.C) for a in (k, v)]
            self.runs[key] = Run(setup, eng, prompts, gen, *rows, np.asarray(slot_pos), (k, v))
        return self.runs[key]

    def ref(self, name):
        return self.model(name)[3]


@pytest.fixture(scope="module")
def runs():
    return Runs()


BASE = Setup()
MESHES = [
    Setup(S=1, C=2),
    Setup(S=1, C=4),
    Setup(S=1, C=8),
    Setup(S=2, C=2),
    Setup(S=2, C=4),
    Setup(S=4, C=2),
    Setup(S=3, C=1, G=2),
    # 3 stages with G = 2 < S groups; microbatches (5 prompts, M=2: the batch pads to 6 or 8),
    # groups G = 2S, poisoned bubbles
    Setup(S=2, C=1, M=2, G=4, poison=True),
    Setup(S=2, C=2, M=2, poison=True),
]
SEQ_MESHES = [s for s in [BASE, *MESHES] if s.C > 1]
ids = [str(s) for s in MESHES]


# ---- tokens and logits -------------------------------------------------------------------------


def test_1x1_matches_the_fixture(runs):
    ref = runs.ref("tiny")
    base = runs.run(BASE)
    for i, toks in enumerate(base.tokens):
        assert len(toks) == N_NEW
        assert toks[:8] == ref[f"greedy_tokens_{i}"].tolist(), i
    np.testing.assert_allclose(base.gen.first_logits[:8], ref["step_logits_0"], atol=TOL, rtol=0)


@pytest.mark.parametrize("setup", MESHES, ids=ids)
def test_mesh_matches_1x1_and_the_fixture(runs, setup):
    ref = runs.ref("tiny")
    base, run = runs.run(BASE), runs.run(setup)
    assert run.tokens == base.tokens
    for i, toks in enumerate(run.tokens):
        assert toks[:8] == ref[f"greedy_tokens_{i}"].tolist(), i
    assert run.gen.first_logits.shape == base.gen.first_logits.shape
    assert np.isfinite(run.gen.first_logits).all()
    np.testing.assert_allclose(run.gen.first_logits, base.gen.first_logits, atol=TOL, rtol=0)
    np.testing.assert_allclose(run.gen.first_logits[:8], ref["step_logits_0"], atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "setup", [BASE, Setup(S=2, C=2), Setup(S=2, C=1, M=2, G=4, poison=True)], ids=str
)
def test_decode_reading_filled_blocks_matches_one_pass(runs, setup, monkeypatch):
    """With decode attention blocks of 12 slots (the cache holds 64 per device on 1x1,
    32 with C = 2; neither a multiple of 12), each step reads only the blocks below its
    own slot, in a loop (one more `while` per layer of a stage): the same tokens as the
    one-pass read of the fixture runs, and logits within float rounding."""
    from qwen3_spmd.ring import decode as ring_decode

    base = runs.run(setup)  # traced with the default block, more slots than the cache
    monkeypatch.setattr(ring_decode, "DECODE_BLOCK", 12)
    cfg, source, prompts, _, max_seq = runs.model(setup.model)
    mesh = make_mesh(setup.S, setup.C, jax.devices()[: setup.S * setup.C])
    engine = Engine(
        cfg,
        source,
        mesh,
        max_seq_len=max_seq,
        microbatches=setup.M,
        groups=setup.G,
        chunk=4,
        poison=setup.poison,
    )
    gen = static_batch.generate(engine, prompts, N_NEW, sampling=GREEDY, seed=SEED)

    def loops(engine):
        return sum(
            c.as_text().count(" while(")
            for name, c in engine.programs.compiled.items()
            if name.startswith("decode")
        )

    assert loops(engine) >= loops(base.engine) + -(-cfg.L // setup.S)  # a stage's layers
    assert [c.token_ids for c in gen.completions] == base.tokens
    np.testing.assert_allclose(gen.first_logits, base.gen.first_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "setup,batch",
    [
        (BASE, 5),
        (Setup(S=2, C=2, M=2, poison=True), 6),
        (Setup(S=2, C=1, M=2, G=4, poison=True), 8),
        (Setup(S=4, C=2), 8),
        (Setup(S=3, C=1, G=2), 6),
        (Setup(S=1, C=8), 5),
    ],
    ids=lambda x: str(x),
)
def test_batch_padding(runs, setup, batch):
    run = runs.run(setup)
    layout = run.gen.layout
    assert layout["requests"] == 5 and layout["batch"] == batch
    assert layout["batch"] % setup.M == 0 and layout["batch"] % (setup.G or setup.S) == 0
    assert layout["groups"] == (setup.G or setup.S)
    assert layout["padded_prompt"] % (2 * setup.C) == 0
    assert layout["padded_prompt"] >= max(len(p) for p in run.prompts)
    assert run.k.shape[1] == batch and run.slot_pos.shape[0] == batch
    assert len(run.gen.completions) == 5


def test_batch_smaller_than_stages_with_a_prompt_shorter_than_2c(runs):
    """One 3-token prompt on 4 stages x 2 seq devices: fewer requests than stages (so
    fewer decode groups than stages, or padding copies), and a prompt padded to 2C = 4
    positions, one of which is padding."""
    ref = runs.ref("tiny")
    setup = Setup(S=4, C=2)
    run = runs.run(setup, batch=(1,))
    layout = run.gen.layout
    assert len(run.prompts[0]) < 2 * setup.C and len(run.prompts) < setup.S
    assert layout["padded_prompt"] == 2 * setup.C and layout["requests"] == 1
    assert layout["batch"] % layout["groups"] == 0 and run.k.shape[1] == layout["batch"]
    assert len(run.gen.completions) == 1
    assert run.tokens[0][:8] == ref["greedy_tokens_1"].tolist()
    assert run.tokens[0] == runs.run(BASE).tokens[1]
    np.testing.assert_allclose(run.gen.first_logits[:8], ref["step_logits_1"], atol=TOL, rtol=0)


def test_yarn_on_a_seq_mesh_matches_the_fixture(runs):
    ref = runs.ref("yarn")
    cfg = runs.model("yarn")[0]
    run = runs.run(Setup(model="yarn", S=1, C=4), n_new=8)
    window = cfg.rope_scaling.original_max_position_embeddings
    assert all(len(p) > window for p in run.prompts)
    for i, toks in enumerate(run.tokens):
        assert toks == ref[f"greedy_tokens_{i}"].tolist(), i
    np.testing.assert_allclose(run.gen.first_logits, ref["step_logits_0"], atol=TOL, rtol=0)


def test_eight_stages_match_one_device():
    """8x1 needs >= 8 layers: a 9-layer random model (one stage holds two layers, the
    others one layer and one identity slot), against its own 1x1 run."""
    runs = Runs()
    one, eight = runs.run(Setup(model="rand9")), runs.run(Setup(model="rand9", S=8))
    assert eight.engine.plan.padded_layers == 16
    assert one.tokens == eight.tokens
    assert len({tuple(t) for t in one.tokens}) == len(one.tokens)  # not a degenerate model
    np.testing.assert_allclose(eight.gen.first_logits, one.gen.first_logits, atol=TOL, rtol=0)
    _check_memory(eight)
    _check_cache_matches(eight, one)


@pytest.mark.parametrize(
    "setup",
    [Setup(model="rand9"), Setup(model="rand9", S=2), Setup(model="rand9", S=2, C=2)],
    ids=str,
)
def test_a_layer_is_traced_once_per_program(setup, monkeypatch):
    """Slots share one traced layer (`pipeline.programs.stage.run_stage`): building the prefill
    and decode programs traces the decoder layer once each, not once per slot (9 on
    1x1; 5 per stage on 2x1, one an identity slot under `cond`; 2x2 the ring path,
    where bubbles skip the layer's own work around attention). The tokens are checked
    against the 1x1 run elsewhere; here only that they came."""
    traced = []
    original = DecoderLayer.attention_inputs

    def counted(self, x, rope):
        traced.append(x.shape)
        return original(self, x, rope)

    monkeypatch.setattr(DecoderLayer, "attention_inputs", counted)
    run = Runs().run(setup)
    assert len(run.engine.programs.compiled) == 2  # prefill, decode
    assert len(traced) == 2, traced
    assert all(len(t) == N_NEW for t in run.tokens)


# ---- sampling ----------------------------------------------------------------------------------


SAMPLING_MESHES = [BASE, Setup(S=1, C=4), Setup(S=2, C=2, M=2, poison=True)]


def test_seeded_sampling_identical_across_meshes(runs):
    """Keys come from (seed, request, step): the same tokens on every mesh."""
    ref = runs.run(BASE, sampling=SAMPLED)
    for setup in SAMPLING_MESHES[1:]:
        run = runs.run(setup, sampling=SAMPLED)
        assert run.tokens == ref.tokens, str(setup)
        np.testing.assert_allclose(run.gen.first_logits, ref.gen.first_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("setup", SAMPLING_MESHES, ids=str)
def test_sampling_after_greedy_on_one_engine_really_samples(runs, setup):
    """An engine that ran a greedy batch and then samples must sample in decode too.
    Request 0's token i was drawn from first_logits[i]: within its top 20, and (with this
    seed) not always its argmax. Greedy decode reused for sampling picks the argmax at
    every decode step."""
    greedy = runs.run(setup)
    sampled = runs.run(setup, sampling=SAMPLED)
    assert greedy.engine is sampled.engine
    logits = sampled.gen.first_logits
    toks = np.array(sampled.tokens[0])
    top20 = np.argsort(-logits, axis=-1)[:, :20]
    assert all(t in row for t, row in zip(toks, top20))
    decoded, argmax = toks[1:], np.argmax(logits[1:], axis=-1)
    assert (decoded != argmax).any(), (
        f"{setup}: every decode-step token is the argmax of its logits: decode did not sample"
    )


# ---- poison, NaN -------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", [s for s in MESHES if s.poison], ids=str)
def test_poisoned_bubbles_do_not_leak(runs, setup):
    run = runs.run(setup)
    assert run.engine.poison and setup.M > 1
    assert np.isfinite(run.gen.first_logits).all()
    assert np.isfinite(np.asarray(run.k)).all() and np.isfinite(np.asarray(run.v)).all()
    assert run.tokens == runs.run(BASE).tokens


@pytest.mark.parametrize("setup", [BASE, *MESHES], ids=str)
def test_no_nan_in_the_returned_cache(runs, setup):
    run = runs.run(setup)
    for a in (run.k, run.v):
        x = np.asarray(a)
        assert np.isfinite(x).all()
        assert np.abs(x).max() > 0


# ---- where decode writes -----------------------------------------------------------------------


def _lengths(run):
    B = run.slot_pos.shape[0]
    return [len(run.prompts[b]) if b < len(run.prompts) else len(run.prompts[0]) for b in range(B)]


def _check_slot_positions(run):
    """Decode step j writes the K/V of generated token j on seq device j % C at local slot
    P/C + j // C (one seq device: right after the prompt's n tokens, at n + j, over its
    padding: `RowBook.start`); the prompt's zigzag share fills local slots 0 .. P/C - 1."""
    eng, layout = run.engine, run.gen.layout
    C, S_loc, P = eng.C, eng.slots_per_device, layout["padded_prompt"]
    steps = layout["decode_steps"]
    assert steps == N_NEW - 1 or run.setup.model == "yarn"
    sp = run.slot_pos.reshape(-1, C, S_loc)  # device-major: device c owns its S_loc columns
    want = np.full_like(sp, -1)
    share = zigzag(P, C)
    for b, n in enumerate(_lengths(run)):
        for c in range(C):
            want[b, c, : P // C] = np.where(share[c] < n, share[c], -1)
        first = n if C == 1 else P // C
        for j in range(steps):
            want[b, j % C, first + j // C] = n + j
    np.testing.assert_array_equal(sp, want)
    return sp


@pytest.mark.parametrize("setup", [BASE, *MESHES], ids=str)
def test_decode_slots_follow_the_placement_rule(runs, setup):
    run = runs.run(setup)
    C, P = run.engine.C, run.gen.layout["padded_prompt"]
    sp = _check_slot_positions(run)
    # every seq device received decode slots
    assert all((sp[:, c, P // C :] >= 0).any() for c in range(C))
    # slots that hold no position were never written (the cache starts as zeros)
    # [L_pad, B, K, S_cap, H] -> [L_pad, B, C, S_cap / C, K, H]
    by_slot = lambda a: np.moveaxis(np.asarray(a), 2, 3)  # noqa: E731
    k = by_slot(run.k).reshape(run.k.shape[0], run.k.shape[1], C, -1, *run.k.shape[2:5:2])
    v = by_slot(run.v).reshape(k.shape)
    unwritten = np.zeros(sp.shape, bool)
    unwritten[:, :, P // C :] = sp[:, :, P // C :] < 0
    assert unwritten.any()
    assert not k[:, unwritten].any() and not v[:, unwritten].any()
    # slots that do hold a decode position were written, on every real layer
    decode = np.zeros(sp.shape, bool)
    decode[:, :, P // C :] = sp[:, :, P // C :] >= 0
    real = run.engine.plan.real_slots
    assert (np.abs(k[real][:, decode]).sum(axis=(-1, -2)) > 0).all()


def _by_position(run, layer_slot, b):
    """{position: (k, v) [K, H]} of request b on stacked layer slot `layer_slot`."""
    k = np.asarray(run.k)[layer_slot, b]  # [K, S_cap, H]
    v = np.asarray(run.v)[layer_slot, b]
    cols = {int(p): col for col, p in enumerate(run.slot_pos[b]) if p >= 0}
    return {p: (k[:, col], v[:, col]) for p, col in cols.items()}


def _check_cache_matches(run, base):
    """The K/V each position holds (wherever it lives) equals the 1x1 run's, layer by layer."""
    n_req = len(run.prompts)
    plan = run.engine.plan
    for slot, layer in enumerate(plan.layer_of_slot):
        if layer is None:
            continue
        for b in range(n_req):
            mine, theirs = _by_position(run, slot, b), _by_position(base, layer, b)
            assert sorted(mine) == sorted(theirs) == list(range(len(mine)))
            for p in mine:
                np.testing.assert_allclose(mine[p][0], theirs[p][0], atol=TOL, rtol=0)
                np.testing.assert_allclose(mine[p][1], theirs[p][1], atol=TOL, rtol=0)


@pytest.mark.parametrize("setup", MESHES, ids=ids)
def test_cache_contents_match_1x1(runs, setup):
    _check_cache_matches(runs.run(setup), runs.run(BASE))


# ---- per-device memory -------------------------------------------------------------------------


def _check_memory(run):
    eng = run.engine
    S, C = eng.stages, eng.C
    L_pad = eng.plan.padded_layers
    for a in run.pool:
        shards = a.addressable_shards
        assert len(shards) == S * C
        assert len({tuple((s.start, s.stop) for s in sh.index) for sh in shards}) == S * C
        for sh in shards:
            assert sh.data.nbytes * S * C == a.nbytes
            # [L_pad, pages, K, C bs, H]: layers split over stages, each page's slots over seq
            assert sh.data.shape == (L_pad // S, *a.shape[1:3], eng.block_size, a.shape[4])
    n_slots = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(eng.weights.state):
        name = jax.tree_util.keystr(path)
        shards = leaf.addressable_shards
        assert len(shards) == S * C
        if "layers" in name:
            # one buffer per slot: [S, ...], each stage holding its own layer of the slot
            n_slots += 1
            assert leaf.shape[0] == S
            for sh in shards:
                assert sh.data.shape == (1, *leaf.shape[1:]), name
                assert sh.data.nbytes * S == leaf.nbytes
            # one copy per stage, replicated along seq
            assert len({sh.index[0].start for sh in shards}) == S
        else:
            for sh in shards:
                assert sh.data.shape == leaf.shape, name
    assert n_slots >= 11 * L_pad // S


@pytest.mark.parametrize("setup", [BASE, *MESHES], ids=str)
def test_per_device_memory(runs, setup):
    _check_memory(runs.run(setup))


def test_identity_slots_hold_zero_weights(runs):
    eng = runs.engine(Setup(S=4, C=2))
    # slot j of stage s is stacked slot s * L_pad / S + j
    q = np.stack([np.asarray(a) for a in eng.weights.state["layers"]["q_nhd"].get_value()], axis=1)
    q = q.reshape(-1, *q.shape[2:])
    real = eng.plan.real_slots
    assert (~real).sum() == eng.plan.padded_layers - runs.model("tiny")[0].L
    assert not q[~real].any() and q[real].any()
