"""Token sampling: greedy, or temperature with top-k and top-p.

Random keys come from (seed, request index, step) only, so a request samples the same
tokens whatever its place in the batch, its group, the mesh or the tick it runs at.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


class SamplingError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __str__(self) -> str:
        if self == Sampling():
            return "greedy"
        return f"temperature {self.temperature} top-k {self.top_k} top-p {self.top_p}"

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise SamplingError(
                f"--temperature {self.temperature} must be a finite number >= 0 (0 = greedy)"
            )
        if self.top_k < 0:
            raise SamplingError(f"--top-k {self.top_k} must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p {self.top_p} must be in (0, 1] (1 = off)")


def greedy(logits: jax.Array) -> jax.Array:
    """argmax over the last axis, first index on ties, [B, V] -> [B] int32.

    Written as max, then the smallest index holding it: XLA's CPU argmax over a
    150K-wide vocabulary is an order of magnitude slower for B > 1. A row holding NaN
    gives its first NaN, as numpy's argmax does (never an id outside the vocabulary)."""
    V = logits.shape[-1]
    hit = (logits == jnp.max(logits, axis=-1, keepdims=True)) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1).astype(jnp.int32)


def sample(
    logits: jax.Array, request: jax.Array, step: jax.Array, seed: jax.Array, cfg: Sampling
) -> jax.Array:
    """Next tokens.

    Args:
      logits: [B, V] float32; request: [B] int32 request indices; step: [B] or scalar
        int32, the index of the token being produced; seed: scalar int32.
    Returns:
      tokens [B] int32.
    """
    if cfg.temperature == 0.0:
        return greedy(logits)
    x = logits / cfg.temperature
    V = x.shape[-1]
    if 0 < cfg.top_k < V:
        kth = jax.lax.top_k(x, cfg.top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= cfg.top_p
        drop = (
            jnp.zeros_like(drop_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(drop_sorted)
        )
        x = jnp.where(drop, -jnp.inf, x)
    step = jnp.broadcast_to(step, request.shape)

    def one(r, s, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), r), s)
        return jax.random.categorical(key, row)

    return jax.vmap(one)(request, step, x).astype(jnp.int32)
