"""The engine's contract beyond the mesh (tests/pipeline/runtime/test_engine_mesh.py checks the meshes):
bad requests refused in words before anything compiles, stopping at EOS, and the KV
cache updated in place by the programs."""

import math

import jax
import numpy as np
import pytest
from reference import TINY

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.ring import padded_length
from qwen3_spmd.sharding.mesh import make_mesh
from qwen3_spmd.sharding.stages import PlanError

# ---- bad requests ------------------------------------------------------------
# Engine.check: every request precondition refused in words before anything compiles.
# No program runs here: the engines are built once and only `check` is called.

MAX_SEQ = 64


@pytest.fixture(scope="module")
def cfg():
    return Qwen3Config.from_hf(TINY)


@pytest.fixture(scope="module")
def engine(cfg):
    """1x4: four seq devices, 16 cache slots each."""
    return Engine(
        cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 4, jax.devices()[:4]), max_seq_len=MAX_SEQ
    )


@pytest.fixture(scope="module")
def roomy(cfg):
    """A cache longer than the model's positions, so that check is the one to fire."""
    return Engine(
        cfg,
        HFCheckpoint(TINY, cfg),
        make_mesh(1, 1, jax.devices()[:1]),
        max_seq_len=cfg.max_position_embeddings + 64,
    )


def _refused(engine, prompts, n) -> str:
    with pytest.raises(RequestError) as e:
        engine.check(prompts, n)
    return str(e.value)


def test_a_fitting_request_passes(engine):
    engine.check([[1, 2, 3], list(range(20))], 8)


def test_empty_prompt_list(engine):
    assert "no prompt" in _refused(engine, [], 4)


def test_empty_prompt(engine):
    msg = _refused(engine, [[1, 2], []], 4)
    assert "prompt 1" in msg and "empty" in msg


@pytest.mark.parametrize("bad", [-1, 331, 10_000])
def test_ids_outside_the_vocabulary(engine, cfg, bad):
    assert cfg.V == 331
    msg = _refused(engine, [[1, 2], [5, bad, 7]], 4)
    assert "prompt 1" in msg and str(bad) in msg and str(cfg.V) in msg


def test_last_id_of_the_vocabulary_is_fine(engine, cfg):
    engine.check([[0, cfg.V - 1]], 2)


def test_beyond_max_seq_len(engine):
    prompt, n = list(range(40)), 30  # 70 > 64
    msg = _refused(engine, [[1], prompt], n)
    assert "prompt 1" in msg
    assert "70" in msg and str(MAX_SEQ) in msg and "40" in msg and "30" in msg


def test_exactly_max_seq_len_fits_when_slots_allow(engine):
    # 48 tokens pad to 48 (a multiple of 8): 12 slots per device, + ceil(15 / 4) = 4 -> 16
    engine.check([list(range(48))], 16)


def test_beyond_max_position_embeddings(roomy, cfg):
    limit = cfg.max_position_embeddings
    prompt = [1] * (limit - 10)
    roomy.check([prompt], 10)  # exactly the model's positions: fine
    msg = _refused(roomy, [prompt], 11)
    assert str(limit) in msg and str(limit + 1) in msg


def test_padded_prompt_does_not_fit_the_cache_slots(engine):
    """33 tokens pad to 40 on 4 seq devices: 10 prompt slots per device, and 29 new tokens
    need ceil(28 / 4) = 7 more: 17 > 16 slots, although 33 + 29 = 62 <= 64."""
    prompt, n = list(range(33)), 29
    C = 4
    P = padded_length(len(prompt), C)
    need = P // C + math.ceil((n - 1) / C)
    assert len(prompt) + n <= MAX_SEQ and need > MAX_SEQ // C
    msg = _refused(engine, [prompt], n)
    assert f"raise max_seq_len to {need * C}" in msg
    assert str(P) in msg and str(need) in msg and str(MAX_SEQ // C) in msg
    most = (MAX_SEQ // C - P // C) * C + 1  # the most new tokens that fit: 25
    engine.check([prompt], most)
    assert "17" in _refused(engine, [prompt], most + 1) or most + 1 < n


def test_the_suggested_max_seq_len_is_enough(cfg):
    prompt, n = list(range(33)), 29
    eng = Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 4, jax.devices()[:4]), max_seq_len=68)
    eng.check([prompt], n)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one(engine, n):
    assert str(n) in _refused(engine, [[1, 2, 3]], n)


@pytest.mark.parametrize(
    "word,value,least",
    [
        ("microbatches", 0, 1),
        ("groups", 0, 1),
        ("max_seq_len", 0, 2),
        ("max_seq_len", 1, 2),  # a prompt token and a new one at least
        ("chunk", 0, 1),
    ],
)
def test_bad_engine_settings(cfg, word, value, least):
    """The error names the parameter as Engine does (the CLI spells it as its flag)."""
    with pytest.raises(RequestError, match=f"^{word} {value} must be at least {least}$") as e:
        Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]), **{word: value})
    assert e.value.param == word
    assert e.value.spelled({word: "--flag"}) == f"--flag {value} must be at least {least}"


def test_more_stages_than_layers_is_refused(cfg):
    with pytest.raises(PlanError) as e:
        Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(8, 1, jax.devices()[:8]))
    assert "8" in str(e.value) and str(cfg.L) in str(e.value)


# ---- stopping at eos ---------------------------------------------------------
# Stopping at EOS: a request ends at its first EOS id (kept, finish_reason "stop"),
# mid-chunk and on any mesh, while the others go on; all finished ends the loop early.


@pytest.fixture(scope="module")
def fixture():
    cfg = Qwen3Config.from_hf(TINY)
    ref = np.load(f"{TINY}/reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    greedy = [ref[f"greedy_tokens_{i}"].tolist() for i in range(3)]
    return cfg, prompts, greedy


def expected(tokens, eos):
    for n, t in enumerate(tokens):
        if t in eos:
            return tokens[: n + 1], "stop"
    return tokens, "length"


@pytest.mark.parametrize("S, C", [(1, 1), (2, 2)])
def test_request_stops_at_its_first_eos(fixture, S, C):
    cfg, prompts, greedy = fixture
    eos = (greedy[0][4],)  # request 0's fifth token: inside the second chunk of 3 steps
    eng = Engine(
        cfg,
        HFCheckpoint(TINY, cfg),
        make_mesh(S, C, jax.devices()[: S * C]),
        max_seq_len=64,
        chunk=3,
    )
    out = static_batch.generate(eng, prompts, 8, eos_ids=eos)
    for got, want in zip(out.completions, greedy):
        tokens, reason = expected(want, eos)
        assert got.token_ids == tokens and got.finish_reason == reason
    assert out.completions[0].finish_reason == "stop"
    assert len(out.first_logits) == len(out.completions[0].token_ids)


def test_all_finished_ends_the_loop_early(fixture):
    cfg, prompts, greedy = fixture
    eos = tuple(g[1] for g in greedy)  # every request stops by its second token
    eng = Engine(
        cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]), max_seq_len=64, chunk=2
    )
    out = static_batch.generate(eng, prompts, 8, eos_ids=eos)
    assert all(c.finish_reason == "stop" and len(c.token_ids) <= 2 for c in out.completions)
    assert out.layout["chunks"] == 1  # no chunk ran after every request had stopped


# ---- the cache updated in place ----------------------------------------------
# The KV cache is donated to the compiled programs and updated in place: XLA's memory
# analysis shows the cache aliased between input and output and no cache-sized copy.


@pytest.mark.parametrize("S, C", [(1, 1), (2, 2)])
def test_programs_alias_the_cache(S, C):
    cfg = Qwen3Config.from_hf(TINY)
    # A cache large against everything else, so a copy of it could not hide in temp.
    eng = Engine(
        cfg,
        HFCheckpoint(TINY, cfg),
        make_mesh(S, C, jax.devices()[: S * C]),
        max_seq_len=4096,
        chunk=4,
    )
    out = static_batch.generate(eng, [[5, 6, 7, 8, 9]] * S, 6, with_logits=False)
    assert isinstance(out.cache, KVCache)
    k, v, pos, table = out.cache
    kv_bytes = 2 * k.addressable_shards[0].data.nbytes  # one device's k and v
    # k [L_pad, pages, K, C bs, H]: each row its most pages (a static batch's pool)
    B, n = np.asarray(table).shape
    assert k.shape[1] == B * n and np.asarray(pos).shape == (B, n * k.shape[3])
    names = list(eng.programs.compiled)
    assert any(n.startswith("prefill") for n in names) and any(
        n.startswith("decode") for n in names
    )
    for name, program in eng.programs.compiled.items():
        m = program.memory_analysis()
        assert m.alias_size_in_bytes >= kv_bytes, name  # k and v updated in place
        assert m.temp_size_in_bytes < kv_bytes / 4, name  # no copy of either
