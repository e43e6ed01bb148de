"""Rotary position embeddings from global positions: `default`, `yarn`, `linear` and
`llama3`, as transformers computes them (same inverse frequencies, same attention factor
folded into cos/sin).

Positions are global token positions, so a token's rotation does not depend on where
it sits in a zigzag layout or on which device holds it. Padding positions (-1) give
some rotation; their keys are masked out by position anyway.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model.config import Qwen3Config


def inverse_frequencies(cfg: Qwen3Config) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [H/2] float32, attention_factor) for the config's rope type."""
    dim = cfg.head_dim
    base = np.float32(cfg.rope_theta)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    y = cfg.rope_scaling
    if y is None:
        return inv_freq, 1.0
    if y.rope_type == "linear":
        return (inv_freq / np.float32(y.factor)).astype(np.float32), 1.0
    if y.rope_type == "llama3":
        return _llama3(inv_freq, y), 1.0

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if y.attention_factor is not None:
        attention_factor = float(y.attention_factor)
    elif y.mscale and y.mscale_all_dim:
        attention_factor = mscale(y.factor, y.mscale) / mscale(y.factor, y.mscale_all_dim)
    else:
        attention_factor = mscale(y.factor)

    def correction_dim(rotations):
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(cfg.rope_theta)
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolation = np.float32(1.0) / (np.float32(y.factor) * pos_freqs)
    inv_freq = interpolation * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def _llama3(inv_freq: np.ndarray, y) -> np.ndarray:
    """Llama 3.1's scaling: wavelengths past the original window / low_freq_factor are
    divided by `factor`, those under it / high_freq_factor kept, the band between
    blended (transformers' _compute_llama3_parameters)."""
    old = y.original_max_position_embeddings
    low_wavelen, high_wavelen = old / y.low_freq_factor, old / y.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(y.factor), inv_freq)
    smooth = (old / wavelen - y.low_freq_factor) / (y.high_freq_factor - y.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(y.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: Qwen3Config, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin tables [B, T, H] for positions [B, T] (int32), in `dtype`."""
    inv_freq, factor = inverse_frequencies(cfg)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * factor).astype(dtype), (jnp.sin(emb) * factor).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [B, T, heads, H] by cos/sin [B, T, H] (transformers' rotate_half form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
