"""RoPE: inverse frequencies against transformers' formulas, re-derived here in numpy
(`_compute_default_rope_parameters` / `_compute_yarn_parameters` of
transformers.modeling_rope_utils), and the rotation's algebra."""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from reference import FIXTURES

from qwen3_spmd.model.config import PRESETS, Qwen3Config, RopeScaling
from qwen3_spmd.model.rope import apply_rope, inverse_frequencies, rope_tables


def reference_default(theta: float, dim: int) -> np.ndarray:
    """inv_freq = 1 / theta^(2i/dim), in float32 as torch computes it."""
    exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def reference_yarn(
    theta: float,
    dim: int,
    factor: float,
    original: int,
    beta_fast=None,
    beta_slow=None,
    attention_factor=None,
    mscale=None,
    mscale_all_dim=None,
    truncate=True,
) -> tuple[np.ndarray, float]:
    """YaRN as transformers computes it (the NTK-by-parts blend of interpolated and
    extrapolated frequencies, and the attention factor that scales cos/sin)."""

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = beta_fast or 32
    beta_slow = beta_slow or 1

    def correction_dim(rotations):
        # the dimension whose wavelength makes `rotations` turns over `original` positions
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv = interpolated * (1 - extrapolation_factor) + extrapolated * extrapolation_factor
    return inv.astype(np.float32), float(attention_factor)


def _yarn_cfg(theta=10_000.0, head_dim=16, **scaling) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=RopeScaling(**scaling),
    )


@pytest.mark.parametrize(
    "theta,dim", [(10_000.0, 16), (1_000_000.0, 128), (500_000.0, 64), (10_000.0, 6)]
)
def test_default_inverse_frequencies(theta, dim):
    cfg = dataclasses.replace(PRESETS["tiny"], rope_theta=theta, head_dim=dim)
    inv, factor = inverse_frequencies(cfg)
    assert inv.shape == (dim // 2,) and inv.dtype == np.float32
    np.testing.assert_allclose(inv, reference_default(theta, dim), rtol=1e-6)
    assert factor == 1.0


YARN_CASES = {
    # the fixture's settings
    "fixture": dict(theta=10_000.0, head_dim=16, factor=4.0, original_max_position_embeddings=32),
    # Qwen3's model card: factor 4 over the 32768-token window
    "qwen3-card": dict(
        theta=1_000_000.0, head_dim=128, factor=4.0, original_max_position_embeddings=32768
    ),
    "betas": dict(
        theta=10_000.0,
        head_dim=64,
        factor=8.0,
        original_max_position_embeddings=256,
        beta_fast=16.0,
        beta_slow=2.0,
    ),
    "no-truncate": dict(
        theta=1_000_000.0,
        head_dim=128,
        factor=4.0,
        original_max_position_embeddings=32768,
        truncate=False,
    ),
    "no-truncate-small": dict(
        theta=10_000.0, head_dim=16, factor=4.0, original_max_position_embeddings=32, truncate=False
    ),
    "mscale": dict(
        theta=10_000.0,
        head_dim=64,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=0.707,
    ),
    "mscale-equal": dict(
        theta=10_000.0,
        head_dim=64,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    "mscale-only": dict(
        theta=10_000.0,
        head_dim=64,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=0.707,
    ),
    "attention-factor": dict(
        theta=10_000.0,
        head_dim=32,
        factor=4.0,
        original_max_position_embeddings=64,
        attention_factor=0.8,
    ),
    "factor-below-one": dict(
        theta=10_000.0, head_dim=32, factor=0.5, original_max_position_embeddings=64
    ),
    # correction range collapses to one point (low == high): the ramp guard
    "narrow": dict(theta=10_000.0, head_dim=8, factor=2.0, original_max_position_embeddings=4),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_inverse_frequencies(case):
    args = dict(YARN_CASES[case])
    theta, dim = args.pop("theta"), args.pop("head_dim")
    cfg = _yarn_cfg(theta=theta, head_dim=dim, **args)
    inv, factor = inverse_frequencies(cfg)
    want, want_factor = reference_yarn(
        theta,
        dim,
        args["factor"],
        args["original_max_position_embeddings"],
        args.get("beta_fast"),
        args.get("beta_slow"),
        args.get("attention_factor"),
        args.get("mscale"),
        args.get("mscale_all_dim"),
        args.get("truncate", True),
    )
    np.testing.assert_allclose(inv, want, rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_yarn_ramp_guard_case_really_collapses():
    # The "narrow" case must exercise low == high after truncation, or it tests nothing new.
    dim, theta, original = 8, 10_000.0, 4
    low = math.floor(dim * math.log(original / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(dim * math.log(original / (1.0 * 2 * math.pi)) / (2 * math.log(theta)))
    assert max(low, 0) == min(high, dim - 1)


def test_yarn_attention_factor_formulas():
    _, f = inverse_frequencies(_yarn_cfg(factor=4.0, original_max_position_embeddings=32))
    assert f == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)  # 1.1386
    _, f = inverse_frequencies(
        _yarn_cfg(
            factor=40.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.707
        )
    )
    assert f == pytest.approx(
        (0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1), rel=1e-12
    )
    _, f = inverse_frequencies(
        _yarn_cfg(
            factor=4.0,
            original_max_position_embeddings=32,
            attention_factor=0.5,
            mscale=1.0,
            mscale_all_dim=0.5,
        )
    )
    assert f == 0.5  # an explicit attention_factor wins


def test_yarn_blends_between_extrapolation_and_interpolation():
    cfg = _yarn_cfg(
        theta=1_000_000.0, head_dim=128, factor=4.0, original_max_position_embeddings=32768
    )
    inv, _ = inverse_frequencies(cfg)
    base = reference_default(1_000_000.0, 128)
    # high frequencies are kept, low ones divided by the factor, a ramp in between
    np.testing.assert_allclose(inv[:4], base[:4], rtol=1e-6)
    np.testing.assert_allclose(inv[-4:], base[-4:] / 4.0, rtol=1e-6)
    ratio = base / inv
    assert np.all(np.diff(ratio) >= -1e-6) and 1.0 < ratio[32] < 4.0


def test_fixture_yarn_config_uses_yarn():
    cfg = Qwen3Config.from_hf(FIXTURES / "yarn")
    inv, f = inverse_frequencies(cfg)
    want, want_f = reference_yarn(10_000.0, 16, 4.0, 32)
    np.testing.assert_allclose(inv, want, rtol=1e-6)
    assert f == pytest.approx(1.1386, abs=1e-4)
    assert not np.allclose(inv, reference_default(10_000.0, 16))


# ---- tables and the rotation -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "yarn"])
def test_rope_tables_are_cos_sin_times_attention_factor(name):
    cfg = Qwen3Config.from_hf(FIXTURES / name)
    positions = np.array([[0, 1, 5, 31, 32, 100], [-1, 2, 3, 64, 127, 7]], np.int32)
    cos, sin = rope_tables(cfg, jnp.asarray(positions), jnp.float32)
    inv, f = inverse_frequencies(cfg)
    angles = positions[..., None].astype(np.float64) * inv.astype(np.float64)
    angles = np.concatenate([angles, angles], axis=-1)
    assert cos.shape == (2, 6, cfg.H)
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles) * f, atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles) * f, atol=2e-5)


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_apply_rope_preserves_norms_when_attention_factor_is_one():
    cfg = Qwen3Config.from_hf(FIXTURES / "tiny")
    assert inverse_frequencies(cfg)[1] == 1.0
    positions = jnp.asarray(np.array([[0, 3, 17, 200], [511, 1, 2, 64]], np.int32))
    x = _x((2, 4, 5, cfg.H))
    y = apply_rope(x, *rope_tables(cfg, positions, jnp.float32))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # ... and is a real rotation: away from position 0 the vectors change
    assert not np.allclose(np.asarray(y[:, 1:]), np.asarray(x[:, 1:]), atol=1e-3)
    np.testing.assert_allclose(np.asarray(y[0, 0]), np.asarray(x[0, 0]), atol=1e-6)


def test_apply_rope_scales_norms_by_the_attention_factor():
    cfg = Qwen3Config.from_hf(FIXTURES / "yarn")
    _, f = inverse_frequencies(cfg)
    positions = jnp.asarray(np.array([[0, 40, 100]], np.int32))
    x = _x((1, 3, 2, cfg.H), seed=1)
    y = apply_rope(x, *rope_tables(cfg, positions, jnp.float32))
    np.testing.assert_allclose(
        np.linalg.norm(y, axis=-1), f * np.linalg.norm(x, axis=-1), rtol=1e-5
    )


def test_apply_rope_is_rotate_half_pairs():
    """Dimension i pairs with i + H/2: (a, b) -> (a cos - b sin, b cos + a sin)."""
    cfg = Qwen3Config.from_hf(FIXTURES / "tiny")
    H = cfg.H
    pos = np.array([[9]], np.int32)
    x = np.asarray(_x((1, 1, 1, H), seed=2))
    y = np.asarray(apply_rope(jnp.asarray(x), *rope_tables(cfg, jnp.asarray(pos), jnp.float32)))
    inv, _ = inverse_frequencies(cfg)
    a, b = x[0, 0, 0, : H // 2].astype(np.float64), x[0, 0, 0, H // 2 :].astype(np.float64)
    ang = 9 * inv.astype(np.float64)
    np.testing.assert_allclose(y[0, 0, 0, : H // 2], a * np.cos(ang) - b * np.sin(ang), atol=1e-5)
    np.testing.assert_allclose(y[0, 0, 0, H // 2 :], b * np.cos(ang) + a * np.sin(ang), atol=1e-5)


def test_scores_depend_only_on_relative_position():
    cfg = Qwen3Config.from_hf(FIXTURES / "tiny")
    q, k = _x((1, 1, 1, cfg.H), seed=3), _x((1, 1, 1, cfg.H), seed=4)

    def score(m, n):
        rq = apply_rope(q, *rope_tables(cfg, jnp.array([[m]], jnp.int32), jnp.float32))
        rk = apply_rope(k, *rope_tables(cfg, jnp.array([[n]], jnp.int32), jnp.float32))
        return float(jnp.sum(rq * rk))

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) == pytest.approx(score(7, 0), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


def _scaled(rope_type: str, **params) -> Qwen3Config:
    cfg = PRESETS["tiny"]
    return dataclasses.replace(
        cfg,
        rope_theta=10_000.0,
        rope_scaling=RopeScaling(
            rope_type=rope_type,
            original_max_position_embeddings=params.pop("original", 64),
            **params,
        ),
    )


def test_linear_divides_every_frequency_by_the_factor():
    inv_freq, attention_factor = inverse_frequencies(_scaled("linear", factor=4.0))
    np.testing.assert_array_equal(inv_freq, reference_default(10_000.0, 32) / np.float32(4.0))
    assert attention_factor == 1.0


def test_llama3_keeps_high_frequencies_divides_low_ones_and_blends_between():
    """Wavelengths (2 pi / inv_freq) below original / high_freq_factor stay, above
    original / low_freq_factor are divided by the factor, between them a blend."""
    cfg = _scaled("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=64)
    inv_freq, attention_factor = inverse_frequencies(cfg)
    base = reference_default(10_000.0, 32)
    wavelen = 2 * np.pi / base
    high, low = wavelen < 64 / 4.0, wavelen > 64 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()  # all three bands occur
    np.testing.assert_array_equal(inv_freq[high], base[high])
    np.testing.assert_allclose(inv_freq[low], base[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(inv_freq[mid] < base[mid]) and np.all(inv_freq[mid] > base[mid] / 8.0)
    assert attention_factor == 1.0


def _transformers_cases() -> list[dict]:
    """transformers' own values, written by tests/fixtures/make_rope_reference.py (its
    RoPE functions need torch, which the project does not install)."""
    return json.loads((FIXTURES / "rope_scaled.json").read_text())["cases"]


@pytest.mark.parametrize("case", _transformers_cases(), ids=lambda c: c["rope_type"])
def test_scaled_rope_matches_transformers(case):
    cfg = dataclasses.replace(
        _scaled(
            case["rope_type"], original=case["original_max_position_embeddings"], **case["params"]
        ),
        head_dim=case["head_dim"],
        rope_theta=case["rope_theta"],
    )
    ours, our_factor = inverse_frequencies(cfg)
    theirs = np.asarray(case["inv_freq"], dtype=np.float32)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert our_factor == pytest.approx(case["attention_factor"])
