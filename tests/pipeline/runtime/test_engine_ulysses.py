"""The engine with Ulysses prefill (`cp="ulysses"`) against the ring, 1x1 and the
transformers fixtures, on (stage, seq) meshes of emulated CPU devices.

Two models: the `tiny` fixture (N=6 query heads over K=2 KV heads: C = 2 = K, and
C = 3 > K, where a KV head goes to devices whose query heads straddle two KV heads),
and a random one with N=8, K=4 for C = 2 < K, C = 4 = K, C = 8 > K. Every engine is
built once and every batch generated once (module-scoped cache).
"""

import jax
import numpy as np
import pytest
from reference import FIXTURES

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.checkpoint.random_weights import RandomWeights
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.ring.pages import as_rows
from qwen3_spmd.sharding.mesh import make_mesh

TOL = 1e-4
N_NEW = 10  # 9 decode steps: every seq device of C <= 8 gets a decode slot
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9)
SEED = 3

# N=8 query heads over K=4 KV heads, prime-ish sizes, head_dim independent of the width.
RAND8 = Qwen3Config(
    vocab_size=263,
    hidden_size=44,
    intermediate_size=73,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=10,
    max_position_embeddings=256,
    rope_theta=10_000.0,
)


def _model(name):
    if name == "rand8":
        rng = np.random.default_rng(11)
        # shorter than 2C for every C > 1 here (1, 3), and longer ones of other lengths
        prompts = [rng.integers(0, RAND8.V, n).tolist() for n in (19, 3, 1, 34)]
        return RAND8, RandomWeights(RAND8, seed=2), prompts, None
    folder = FIXTURES / name
    cfg = Qwen3Config.from_hf(folder)
    ref = np.load(folder / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(int(ref["num_prompts"]))]
    return cfg, HFCheckpoint(folder, cfg), prompts, ref


class Runs:
    def __init__(self):
        self.models, self.engines, self.runs = {}, {}, {}

    def model(self, name):
        if name not in self.models:
            self.models[name] = _model(name)
        return self.models[name]

    def run(self, name, S, C, cp="ulysses", M=1, poison=False, sampling=Sampling()):
        """(engine, generation, (k, v, slot_pos) as numpy) for the model's prompts."""
        key = (name, S, C, cp, M, poison)
        if key not in self.engines:
            cfg, source, _, _ = self.model(name)
            mesh = make_mesh(S, C, jax.devices()[: S * C])
            self.engines[key] = Engine(
                cfg, source, mesh, max_seq_len=80, microbatches=M, chunk=N_NEW, poison=poison, cp=cp
            )
        if (key, sampling) not in self.runs:
            eng = self.engines[key]
            gen = static_batch.generate(
                eng, self.model(name)[2], N_NEW, sampling=sampling, seed=SEED
            )
            k, v, slot_pos, table = (np.asarray(a) for a in gen.cache)
            cache = (as_rows(k, table, eng.C), as_rows(v, table, eng.C), slot_pos)
            self.runs[key, sampling] = (eng, gen, cache)
        return self.runs[key, sampling]


@pytest.fixture(scope="module")
def runs():
    return Runs()


def _tokens(gen):
    return [c.token_ids for c in gen.completions]


def _by_position(run, b):
    """{position: (k, v) [L, K, H]} of request b, wherever its slot lies, layers in
    model order (identity slots of a padded stage plan dropped)."""
    engine, _, (k, v, slot_pos) = run
    layers = [
        slot
        for layer, slot in sorted(
            (layer, slot)
            for slot, layer in enumerate(engine.plan.layer_of_slot)
            if layer is not None
        )
    ]
    return {
        int(p): (k[layers, b, :, col], v[layers, b, :, col])
        for col, p in enumerate(slot_pos[b])
        if p >= 0
    }


def _check_same(run, ref, n_req):
    """Tokens identical, first-token and per-step logits and every cached K/V within TOL."""
    gen, gen_ref = run[1], ref[1]
    assert _tokens(gen) == _tokens(gen_ref)
    assert np.isfinite(gen.first_logits).all()
    np.testing.assert_allclose(gen.first_logits, gen_ref.first_logits, atol=TOL, rtol=0)
    for b in range(n_req):
        mine, theirs = _by_position(run, b), _by_position(ref, b)
        assert sorted(mine) == sorted(theirs)
        for p in mine:
            np.testing.assert_allclose(mine[p][0], theirs[p][0], atol=TOL, rtol=0)
            np.testing.assert_allclose(mine[p][1], theirs[p][1], atol=TOL, rtol=0)


TINY_MESHES = [(1, 2, 1, False), (2, 2, 2, True), (1, 3, 1, False)]


@pytest.mark.parametrize("S,C,M,poison", TINY_MESHES, ids=lambda x: str(x))
def test_tiny_fixture_matches_transformers_and_1x1(runs, S, C, M, poison):
    ref = runs.model("tiny")[3]
    base = runs.run("tiny", 1, 1, cp="ring")
    run = runs.run("tiny", S, C, M=M, poison=poison)
    assert run[1].layout["cp_strategy"] == "ulysses"
    for i, toks in enumerate(_tokens(run[1])):
        assert toks[:8] == ref[f"greedy_tokens_{i}"].tolist(), i
    np.testing.assert_allclose(run[1].first_logits[:8], ref["step_logits_0"], atol=TOL, rtol=0)
    _check_same(run, base, len(runs.model("tiny")[2]))


RAND_MESHES = [(1, 2), (1, 4), (2, 2), (1, 8), (2, 4)]  # C < K, C = K, C > K


@pytest.mark.parametrize("S,C", RAND_MESHES, ids=lambda x: str(x))
def test_grouped_heads_every_split_matches_1x1(runs, S, C):
    base = runs.run("rand8", 1, 1, cp="ring")
    assert len({tuple(t) for t in _tokens(base[1])}) > 1  # not a degenerate model
    run = runs.run("rand8", S, C)
    assert run[1].layout["cp_strategy"] == "ulysses"
    prefill = [
        c.as_text() for name, c in run[0].programs.compiled.items() if name.startswith("prefill")
    ]
    assert len(prefill) == 1 and "all-to-all" in prefill[0]
    if S == 1:  # nothing moves along `stage`: no point-to-point transfer at all
        assert "collective-permute" not in prefill[0]
    _check_same(run, base, 4)


@pytest.mark.parametrize("S,C", [(1, 8), (2, 4)], ids=lambda x: str(x))
def test_ulysses_matches_the_ring_on_the_same_mesh(runs, S, C):
    ring_run = runs.run("rand8", S, C, cp="ring")
    assert ring_run[1].layout["cp_strategy"] == "ring"
    _check_same(runs.run("rand8", S, C), ring_run, 4)


def test_seeded_sampling_identical(runs):
    ref = runs.run("tiny", 1, 1, cp="ring", sampling=SAMPLED)
    run = runs.run("tiny", 1, 2, sampling=SAMPLED)
    assert _tokens(run[1]) == _tokens(ref[1])
    np.testing.assert_allclose(run[1].first_logits, ref[1].first_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "links,strategy",
    [
        ({"ppermute": 1e3, "all_to_all": 1e12}, "ulysses"),
        ({"ppermute": 1e12, "all_to_all": 1e3}, "ring"),
    ],
)
def test_auto_runs_what_the_model_picks(runs, links, strategy):
    """cp="auto" with link figures that make one strategy's transfers crawl runs the
    other; the tokens are the 1x1 run's either way."""
    cfg, source, prompts, _ = runs.model("tiny")
    engine = Engine(
        cfg,
        source,
        make_mesh(1, 2, jax.devices()[:2]),
        max_seq_len=80,
        chunk=N_NEW,
        cp="auto",
        link_bytes_per_s=links,
    )
    gen = static_batch.generate(engine, prompts, 2, seed=SEED)
    assert gen.layout["cp_strategy"] == strategy and set(gen.layout["cp"]) == {"ring", "ulysses"}
    assert [t[:2] for t in _tokens(runs.run("tiny", 1, 1, cp="ring")[1])] == _tokens(gen)


def test_emulated_cpu_devices_share_the_hosts_matmul_rate():
    """The cost model's compute term: the C emulated devices of a 1xC CPU mesh work at
    once on one host's cores, so each gets 1/C of its measured (or nominal) rate."""
    cfg, source, _, _ = _model("tiny")
    for C in (1, 2):
        engine = Engine(cfg, source, make_mesh(1, C, jax.devices()[:C]), flops_per_s=1e11)
        assert engine.flops_per_s == 1e11 / C


def test_impossible_head_split_fails_before_compiling():
    cfg, source, _, _ = _model("tiny")
    with pytest.raises(
        RequestError, match="6 query heads cannot be shared equally by 4 seq devices; use cp ring"
    ) as e:
        Engine(cfg, source, make_mesh(1, 4, jax.devices()[:4]), cp="ulysses")
    assert e.value.param == "cp"
    with pytest.raises(RequestError, match="^cp 'ulyses' is not one of ring, ulysses, auto") as e:
        Engine(cfg, source, make_mesh(1, 2, jax.devices()[:2]), cp="ulyses")
    assert e.value.param == "cp"


def test_eight_query_heads_on_1x4_and_1x8_match_transformers(tmp_path):
    """The fixtures' 6 query heads split over 2 or 3 devices only; a model written by
    transformers itself with N=8 over K=2 runs Ulysses on 1x4 and 1x8 (C > K: KV heads
    repeated): greedy tokens equal transformers' and the prefill logits within TOL."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3Config(
        vocab_size=211,
        hidden_size=40,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
    )
    torch.manual_seed(5)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.float32).eval()
    with torch.no_grad():  # norms away from 1, so a wrong one shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 211, n).tolist() for n in (21, 3, 40)]
    steps = 6
    want, want_logits = [], []
    with torch.no_grad():  # greedy by full forward passes: argmax of transformers' logits
        for p in prompts:
            ids = list(p)
            for step in range(steps):
                logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
                if step == 0:
                    want_logits.append(logits)
                ids.append(int(logits.argmax()))
            want.append(ids[len(p) :])
    cfg = Qwen3Config.from_hf(tmp_path)
    for C in (4, 8):
        engine = Engine(
            cfg,
            HFCheckpoint(tmp_path, cfg),
            make_mesh(1, C, jax.devices()[:C]),
            max_seq_len=64,
            chunk=steps,
            cp="ulysses",
        )
        gen = static_batch.generate(engine, prompts, steps)
        assert gen.layout["cp_strategy"] == "ulysses"
        assert _tokens(gen) == want, C
        np.testing.assert_allclose(gen.first_logits[0], want_logits[0], atol=TOL, rtol=0)
