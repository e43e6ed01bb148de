"""Engine.check: every request precondition refused in words before anything compiles.
No program runs here: the engines are built once and only `check` is called."""

import math
from pathlib import Path

import jax
import pytest

from model.config import Qwen3Config
from model.checkpoint.hf import HFCheckpoint
from pipeline.engine import Engine, RequestError
from ring import padded_length
from sharding.mesh import make_mesh
from sharding.plan import PlanError
from reference import TINY

MAX_SEQ = 64


@pytest.fixture(scope="module")
def cfg():
    return Qwen3Config.from_hf(TINY)


@pytest.fixture(scope="module")
def engine(cfg):
    """1x4: four seq devices, 16 cache slots each."""
    return Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 4, jax.devices()[:4]),
                  max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def roomy(cfg):
    """A cache longer than the model's positions, so that check is the one to fire."""
    return Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]),
                  max_seq_len=cfg.max_position_embeddings + 64)


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
    assert f"--max-seq-len to {need * C}" in msg
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


@pytest.mark.parametrize("kwargs,word", [
    (dict(microbatches=0), "--microbatches"),
    (dict(groups=0), "--groups"),
    (dict(max_seq_len=0), "--max-seq-len"),
])
def test_bad_engine_settings(cfg, kwargs, word):
    with pytest.raises(RequestError, match=word):
        Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]), **kwargs)


def test_more_stages_than_layers_is_refused(cfg):
    with pytest.raises(PlanError) as e:
        Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(8, 1, jax.devices()[:8]))
    assert "8" in str(e.value) and str(cfg.L) in str(e.value)
