"""Stopping at EOS: a request ends at its first EOS id (kept, finish_reason "stop"),
mid-chunk and on any mesh, while the others go on; all finished ends the loop early."""

import jax
import numpy as np
import pytest

from model.config import Qwen3Config
from model.checkpoint.hf import HFCheckpoint
from pipeline.engine import Engine
from sharding.mesh import make_mesh
from reference import TINY



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
            return tokens[:n + 1], "stop"
    return tokens, "length"


@pytest.mark.parametrize("S, C", [(1, 1), (2, 2)])
def test_request_stops_at_its_first_eos(fixture, S, C):
    cfg, prompts, greedy = fixture
    eos = (greedy[0][4],)  # request 0's fifth token: inside the second chunk of 3 steps
    eng = Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(S, C, jax.devices()[:S * C]),
                 max_seq_len=64, chunk=3)
    out = eng.generate(prompts, 8, eos_ids=eos)
    for got, want in zip(out.completions, greedy):
        tokens, reason = expected(want, eos)
        assert got.token_ids == tokens and got.finish_reason == reason
    assert out.completions[0].finish_reason == "stop"
    assert len(out.first_logits) == len(out.completions[0].token_ids)


def test_all_finished_ends_the_loop_early(fixture):
    cfg, prompts, greedy = fixture
    eos = tuple(g[1] for g in greedy)  # every request stops by its second token
    eng = Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]),
                 max_seq_len=64, chunk=2)
    out = eng.generate(prompts, 8, eos_ids=eos)
    assert all(c.finish_reason == "stop" and len(c.token_ids) <= 2 for c in out.completions)
    assert out.layout["chunks"] == 1  # no chunk ran after every request had stopped
