"""pipeline.programs.sampling: greedy, temperature with top-k / top-p, keys from (seed, request,
step) only, and refused parameters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen3_spmd.pipeline.programs.sampling import (
    RowSampling,
    Sampling,
    SamplingError,
    sample,
    sample_rows,
)

V = 37


@functools.partial(jax.jit, static_argnums=4)
def _sample(logits, request, step, seed, cfg):
    return sample(logits, request, step, seed, cfg)


def _logits(B, seed=0, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal((B, V)), jnp.float32)


def _draws(logits_row, cfg, n=512, seed=0, request=0):
    """n draws for one row at steps 0..n-1 (each step its own key)."""
    logits = jnp.broadcast_to(logits_row, (n, logits_row.shape[-1]))
    req = jnp.full((n,), request, jnp.int32)
    return np.asarray(_sample(logits, req, jnp.arange(n, dtype=jnp.int32), jnp.int32(seed), cfg))


def test_greedy_is_argmax():
    logits = _logits(16, seed=1)
    got = _sample(logits, jnp.arange(16, dtype=jnp.int32), jnp.int32(5), jnp.int32(0), Sampling())
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
    assert got.dtype == jnp.int32


def test_greedy_of_a_row_with_nan_is_its_first_nan_as_numpy_argmax():
    logits = np.array(_logits(3, seed=2))
    logits[0, [5, 9]] = np.nan
    logits[2, :] = np.nan
    got = np.asarray(
        _sample(
            jnp.asarray(logits),
            jnp.arange(3, dtype=jnp.int32),
            jnp.int32(0),
            jnp.int32(0),
            Sampling(),
        )
    )
    np.testing.assert_array_equal(got, np.argmax(logits, -1))  # [5, argmax, 0]
    assert got.max() < V


@pytest.mark.parametrize("temperature", [0.3, 5.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = _logits(8, seed=2)
    want = np.argmax(np.asarray(logits), -1)
    for step in range(6):
        got = _sample(
            logits,
            jnp.arange(8, dtype=jnp.int32),
            jnp.int32(step),
            jnp.int32(step + 11),
            Sampling(temperature=temperature, top_k=1),
        )
        np.testing.assert_array_equal(np.asarray(got), want)


def test_tiny_top_p_only_ever_draws_the_argmax():
    row = _logits(1, seed=3, scale=0.3)[0]  # nearly flat: a leak would show
    got = _draws(row, Sampling(temperature=1.0, top_p=1e-6))
    assert set(got.tolist()) == {int(np.argmax(np.asarray(row)))}


def test_top_k_draws_only_the_k_largest():
    row = _logits(1, seed=4, scale=0.3)[0]
    top = set(np.argsort(-np.asarray(row))[:3].tolist())
    got = set(_draws(row, Sampling(temperature=1.0, top_k=3)).tolist())
    assert got == top  # every one of the three shows up, nothing else


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = jnp.asarray(np.log(probs), jnp.float32)
    # mass before each token: 0, .5, .8, .95 -> p = .7 keeps the first two, p = .85 three
    assert set(_draws(row, Sampling(temperature=1.0, top_p=0.7)).tolist()) == {0, 1}
    assert set(_draws(row, Sampling(temperature=1.0, top_p=0.85)).tolist()) == {0, 1, 2}
    assert set(_draws(row, Sampling(temperature=1.0)).tolist()) == {0, 1, 2, 3}


def test_temperature_one_follows_the_softmax():
    row = jnp.asarray([0.0, np.log(3.0)], jnp.float32)
    got = _draws(row, Sampling(temperature=1.0), n=4000)
    assert abs(np.mean(got == 1) - 0.75) < 0.04  # 6 sigma
    hot = _draws(row, Sampling(temperature=100.0), n=4000)
    assert abs(np.mean(hot == 1) - 0.5) < 0.04
    cold = _draws(row, Sampling(temperature=0.05), n=4000)
    assert np.mean(cold == 1) > 0.999


CFG = Sampling(temperature=0.8, top_k=20, top_p=0.9)


def test_token_depends_on_request_not_row():
    B = 12
    logits = _logits(1, seed=5, scale=0.5)[0]
    rows = jnp.broadcast_to(logits, (B, V))
    request = jnp.arange(B, dtype=jnp.int32)
    a = np.asarray(_sample(rows, request, jnp.int32(3), jnp.int32(7), CFG))
    perm = np.random.default_rng(0).permutation(B)
    b = np.asarray(_sample(rows, request[perm], jnp.int32(3), jnp.int32(7), CFG))
    np.testing.assert_array_equal(b, a[perm])
    # and on batch size: request 4 alone draws what it drew in the batch
    c = np.asarray(_sample(rows[:1], request[4:5], jnp.int32(3), jnp.int32(7), CFG))
    assert c[0] == a[4]
    # different requests on the same logits do not all draw alike (keys differ)
    assert len(set(a.tolist())) > 1


def test_token_depends_on_seed_and_step():
    logits = _logits(1, seed=6, scale=0.5)
    req = jnp.zeros((1,), jnp.int32)
    by_step = {int(_sample(logits, req, jnp.int32(s), jnp.int32(1), CFG)[0]) for s in range(20)}
    by_seed = {int(_sample(logits, req, jnp.int32(0), jnp.int32(s), CFG)[0]) for s in range(20)}
    assert len(by_step) > 1 and len(by_seed) > 1
    again = [int(_sample(logits, req, jnp.int32(s), jnp.int32(1), CFG)[0]) for s in range(20)]
    assert set(again) == by_step


def test_per_row_steps_equal_scalar_steps():
    B = 6
    logits = _logits(B, seed=8, scale=0.5)
    request = jnp.arange(B, dtype=jnp.int32)
    steps = jnp.array([0, 3, 3, 9, 1, 2], jnp.int32)
    together = np.asarray(_sample(logits, request, steps, jnp.int32(2), CFG))
    for b in range(B):
        alone = _sample(logits[b : b + 1], request[b : b + 1], steps[b], jnp.int32(2), CFG)
        assert int(alone[0]) == together[b]


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2**31), "top_k"),  # an int32 per row: past it, a clear error
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
    ],
)
def test_invalid_parameters_raise(kwargs, word):
    """The message and `param` name the field as `Sampling` does, not as a CLI flag."""
    with pytest.raises(SamplingError, match=f"^{word} ") as e:
        Sampling(**kwargs)
    assert e.value.param == word and "--" not in str(e.value)


def test_sampling_is_hashable_for_jit():
    assert hash(Sampling(0.8, 20, 0.9)) == hash(Sampling(0.8, 20, 0.9))
    assert Sampling(0.8, 20, 0.9) != Sampling(0.8, 20, 0.95)


def test_each_row_samples_with_its_own_settings_as_it_would_alone():
    """One batch mixing greedy rows and rows with different temperatures, top-k and
    top-p draws, row by row, what `sample` draws for that row alone with its settings,
    its seed and its request index: the batch around a request changes nothing."""
    settings = [
        Sampling(),
        Sampling(temperature=0.7),
        Sampling(temperature=1.3, top_k=5),
        Sampling(temperature=0.9, top_p=0.6),
        Sampling(temperature=1.0, top_k=8, top_p=0.8),
        Sampling(),
    ]
    B = len(settings)
    logits = _logits(B, seed=8, scale=2.0)
    seeds, requests = [3, 11, 11, 4, 9, 2], [0, 0, 5, 1, 2, 7]
    rows = RowSampling.stack(list(zip(settings, seeds, requests)))
    rows = RowSampling(*map(jnp.asarray, rows))
    sample_all = jax.jit(sample_rows)
    for step in range(8):
        got = np.asarray(sample_all(logits, rows, jnp.int32(step)))
        for b, cfg in enumerate(settings):
            alone = _sample(
                logits[b : b + 1],
                jnp.asarray([requests[b]], jnp.int32),
                jnp.int32(step),
                jnp.int32(seeds[b]),
                cfg,
            )
            assert got[b] == int(alone[0]), (step, b, cfg)
    greedy_rows = [b for b, cfg in enumerate(settings) if cfg.temperature == 0]
    np.testing.assert_array_equal(got[greedy_rows], np.argmax(np.asarray(logits), -1)[greedy_rows])
