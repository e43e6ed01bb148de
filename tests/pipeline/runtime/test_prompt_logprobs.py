"""The prompt's log-probabilities (`Params.prompt_logprobs`): at every prompt position the
log-probability of the next prompt token, its rank and the top ones equal transformers'
log_softmax of its logits (the tiny fixture's reference.npz, float32) within 1e-4, on
every mesh kind: one device, Ulysses along `seq`, and 2x2x2 (stages, the ring along
`seq` and `tensor` at once: the last stage's positions spread over seq, the vocabulary
over tensor);
for batches of prompts of different lengths (7 and 3, 11 and 1 tokens, each pair
prefilled together) and a prompt longer than a prefill chunk (32 tokens in chunks of
16, the later attending to the earlier); with the prefix cache on, where the same
prompts were cached by requests before them, and off.

Each request generates one token, so only prefill programs compile (two per mesh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import fixture

from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.programs.sampling import TOP_LOGPROBS
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.sharding.mesh import make_mesh

TOL = 1e-4
CHUNK = 16  # prefill tokens a round: the 32-token prompt goes in two chunks


@pytest.fixture(scope="module")
def tiny():
    folder, cfg, ref, prompts = fixture("tiny")
    from qwen3_spmd.model.checkpoint.hf import HFCheckpoint

    want = []  # per prompt: log_softmax [T, V] float64 of transformers' logits
    for i in range(len(prompts)):
        logits = ref[f"prefill_logits_{i}"].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        want.append(logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True)))
    return cfg, HFCheckpoint(folder, cfg), prompts, want


def _check(prompt: list[int], got, want: np.ndarray) -> None:
    """One prompt's Logprobs (one per token after the first) against log_softmax `want`
    [T, V] of transformers' logits at each position."""
    assert len(got) == len(prompt) - 1
    for p, lp in enumerate(got):
        row, token = want[p], prompt[p + 1]
        assert lp.chosen == pytest.approx(row[token], abs=TOL), (p, token)
        # The rank counts the tokens more likely than this one (ties within TOL either way).
        assert 1 + np.sum(row > row[token] + TOL) <= lp.rank <= 1 + np.sum(row > row[token] - TOL)
        ids, values = zip(*lp.top)
        assert len(ids) == TOP_LOGPROBS == len(set(ids))
        np.testing.assert_allclose(values, row[list(ids)], atol=TOL)
        assert list(values) == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:TOP_LOGPROBS], atol=TOL)


MESHES = [  # (stage, seq, tensor, cp): each axis split, all three at once on 2x2x2
    (1, 1, 1, "ring"),
    (1, 2, 1, "ulysses"),
    (2, 2, 2, "ring"),
]


def _scored(engine: Engine, prompts: list[list[int]], cached: bool) -> list:
    """Each prompt's Logprobs through a scheduler over `engine` (cached: with a prefix
    cache, in 8-token pages, which the prompts fill first: a request that asks for its
    prompt's log-probabilities is still prefilled whole)."""
    scheduler = Scheduler(
        engine,
        max_batch=4,
        prefill_tokens=CHUNK,
        prefix_caching=cached,
    )
    asked = Params(max_new_tokens=1, prompt_logprobs=True)
    for _ in range(2 if cached else 1):  # the second time, every long prompt could hit
        handles = [scheduler.submit(p, asked) for p in prompts]
        scheduler.run()
        assert all(h.cached_tokens == 0 for h in handles)
    if cached:
        assert scheduler.prefix.blocks_held > 0
    return [h.prompt_logprobs for h in handles]


@pytest.mark.parametrize("stage, seq, tensor, cp", MESHES)
def test_prompt_logprobs_equal_transformers(tiny, stage, seq, tensor, cp):
    """Two microbatches: a batch of two short prompts and a chunk of the long one (two
    copies of it) are one program shape, so each mesh compiles two scoring programs
    (a first chunk, a later one). 1x1 runs with the prefix cache off and on (the same
    numbers), 2x2x2 with it on (prompts laid out block by block)."""
    cfg, source, prompts, want = tiny
    assert max(map(len, prompts)) > CHUNK
    devices = jax.devices()[: stage * seq * tensor]
    mesh = make_mesh(stage, seq, devices, tensor=tensor)
    engine = Engine(
        cfg, source, mesh, jnp.float32, max_seq_len=48, microbatches=2, cp=cp, block_size=8 // seq
    )
    runs = [_scored(engine, prompts, cached=(stage, seq) == (2, 2))]
    if (stage, seq, tensor) == (1, 1, 1):
        runs.append(_scored(engine, prompts, cached=True))
        assert runs[1] == runs[0]  # exactly
    for got in runs:
        for p, scored, w in zip(prompts, got, want):
            _check(p, scored, w)
