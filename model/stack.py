"""Running the stacked decoder layers: `lax.scan` over the leading layer axis, each step
merging one layer's slice of the NNX state back into a `DecoderLayer`.

This is the single-device reference path (`forward`); a pipeline stage holds its layers
as separate per-slot buffers instead and applies them with `pipeline.programs.stage.run_stage`.
A padded (identity) layer is skipped with `lax.cond`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qwen3_spmd.model.attention import dense_attention
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.layers import Attend, Qwen3
from qwen3_spmd.model.rope import rope_tables


def run_layers(
    layer_def: nnx.GraphDef,
    layer_state: nnx.State,
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    state: Any,
    attend: Callable[[jax.Array], Attend],
    real: jax.Array | None = None,
    gated: bool = True,
    sparse: jax.Array | None = None,
):
    """Applies the stacked layers in order.

    Args:
      layer_def, layer_state: `nnx.split` of the stacked layers; state leaves [L, ...].
      x: hidden states [B, T, D]; rope: (cos, sin) [B, T, H].
      state: what `attend` threads through (e.g. the KV cache), carried across layers.
      attend: layer index (traced int32, 0-based within this stack) -> attend function.
      real: optional [L] bool; False marks a padded identity layer, which is skipped.
      gated: skip identity layers with `lax.cond`. Pass False when `attend` holds
        collectives and `real` differs between devices: a collective that only some
        devices reach deadlocks, so the layer then runs and its result is dropped
        (its cache writes land in the identity slot's own cache, which nothing reads).
      sparse: optional [L] bool, which layers are a mixture of experts (needed when the
        config mixes dense and sparse layers).
    Returns:
      (x [B, T, D], state).
    """
    n = jax.tree.leaves(layer_state)[0].shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    if real is None:
        real = jnp.ones((n,), bool)
    if sparse is None:
        sparse = jnp.zeros((n,), bool)

    def body(carry, xs):
        x, st = carry
        params, l, is_real, is_sparse = xs

        def apply(x, st):
            return nnx.merge(layer_def, params)(x, rope, st, attend(l), is_sparse)

        if gated:
            return jax.lax.cond(is_real, apply, lambda x, st: (x, st), x, st), None
        y, st = apply(x, st)
        return (jnp.where(is_real, y, x), st), None

    (x, state), _ = jax.lax.scan(body, (x, state), (layer_state, index, real, sparse))
    return x, state


def forward(model: Qwen3, cfg: Qwen3Config, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Full forward pass without a cache, dense attention: the reference.

    tokens, positions [B, T] int32 -> logits [B, T, V] float32.
    """
    x = model.embed(tokens)
    layer_def, layer_state = nnx.split(model.layers)
    rope = rope_tables(cfg, positions, x.dtype)

    def attend(_):
        return lambda q, k, v, st: (dense_attention(q, k, v, positions, positions), st)

    x, _ = run_layers(
        layer_def, layer_state, x, rope, None, attend, sparse=jnp.asarray(cfg.sparse_layers)
    )
    return model.logits(x)
