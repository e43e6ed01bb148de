"""What one device does inside the mesh-wide `shard_map`: small helpers shared by the
prefill and decode loops.

Inside the map every device holds its stage's slice of the stacked layers
`[L_pad / S, ...]` and of the KV cache `[L_pad / S, B, S_cap / C, K, H]`, and its
`seq` share of the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import Qwen3Config
from model.layers import Qwen3
from model.rope import rope_tables
from model.stack import run_slots
from ring.attention import make_varying

AXES = ("stage", "seq")


class StageCache(NamedTuple):
    """This stage's KV cache: k, v [L_pad / S, B, S_cap / C, K, H]."""

    k: jax.Array
    v: jax.Array


def vary(x: jax.Array, axes=AXES) -> jax.Array:
    """Marks x as varying along `axes` (those it is not varying along already), so loop
    carries keep one type whether a step computed them or passed them through."""
    return make_varying(x, frozenset(axes))


def from_device(x: jax.Array, stage, seq) -> jax.Array:
    """x as held by device (stage, seq), made the same on every device. Exact: every
    other device adds zeros."""
    here = (jax.lax.axis_index("stage") == stage) & (jax.lax.axis_index("seq") == seq)
    return jax.lax.psum(jnp.where(here, vary(x), jnp.zeros_like(x)), AXES)


def shift(x, cyclic: bool):
    """Sends x from stage s to stage s + 1 (and the last back to stage 0 when cyclic);
    a stage that receives nothing gets zeros."""
    n = jax.lax.axis_size("stage")
    perm = [(s, (s + 1) % n) for s in range(n if cyclic else n - 1)]
    return jax.lax.ppermute(x, "stage", perm) if perm else jax.tree.map(jnp.zeros_like, x)


def run_stage(model: Qwen3, cfg: Qwen3Config, real: jax.Array, x: jax.Array,
              positions: jax.Array, cache: StageCache, attend_at,
              gated: bool) -> tuple[jax.Array, StageCache]:
    """This stage's layers on x [B, T, D] at global positions [B, T].

    The model's layer weights are per-slot tuples (`sharding.place.to_slots`): slot j of
    every leaf is a [1, ...] local buffer. real: [L_pad / S] bool, this stage's slots.
    attend_at(j) -> attend function for local slot j (see model.layers.Attend); it
    reads and writes `cache`. gated: see model.stack.run_layers.
    """
    layer_def, layer_state = nnx.split(model.layers)
    n = len(jax.tree.leaves(layer_state, is_leaf=_is_slots)[0])
    slots = [jax.tree.map(lambda t, j=j: t[j][0], layer_state, is_leaf=_is_slots)
             for j in range(n)]
    # Each stage's real layers come first; the first L // S slots are real everywhere.
    always = cfg.L // jax.lax.axis_size("stage")
    rope = rope_tables(cfg, positions, x.dtype)
    return run_slots(layer_def, slots, x, rope, cache, attend_at,
                     [None if j < always else real[j] for j in range(n)], gated)


def _is_slots(x) -> bool:
    return isinstance(x, tuple)


def when(active: jax.Array, compute, x: jax.Array, cache: StageCache, gated: bool,
         always_active: bool = False):
    """compute(x, cache) on ticks where this stage is active, else (x, cache) unchanged.

    XLA runs a collective only when every device of the program reaches it, so the
    work is skipped with `lax.cond` only where it holds none (gated: no `seq` axis to
    communicate along). Otherwise the stage computes on a bubble too and drops the
    result; `compute` must then itself leave the cache alone when inactive.
    always_active: the schedule has no bubbles (one stage), so no test is needed.
    """
    if always_active:
        return compute(x, cache)
    if gated:
        return jax.lax.cond(active, compute, lambda x, c: (x, c), x, cache)
    y, cache = compute(x, cache)
    return jnp.where(active, y, x), cache


def rows(x: jax.Array, start, size: int, axis: int = 0) -> jax.Array:
    """x[start : start + size] along `axis` (start may be traced)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def put_rows(x: jax.Array, update: jax.Array, start, axis: int = 0) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), start, axis)
