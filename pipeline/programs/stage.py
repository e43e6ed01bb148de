"""What one device does inside the mesh-wide `shard_map`: small helpers shared by the
prefill and decode loops.

Inside the map every device holds its stage's layers (its `tensor` share of them), one
[1, ...] buffer per slot and weight, its stage's pools of KV pages
`[L_pad / S, pages, K' / X, bs, H]` (`ring.pages`), and its `seq` share of the tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.layers import Qwen3
from qwen3_spmd.model.rope import rope_tables
from qwen3_spmd.ops.varying import make_varying
from qwen3_spmd.ring.pages import write_slots
from qwen3_spmd.sharding.mesh import AXES, MODEL_AXES
from qwen3_spmd.sharding.specs import SPECS
from qwen3_spmd.sharding.stages import StagePlan


class Weights(NamedTuple):
    """The placed model: read by every program, written by none."""

    state: Any  # nnx.State: each layer leaf a tuple of per-slot [stages, ...] buffers
    #             sharded P('stage') (sharding.place.place_params), the rest P()
    real: jax.Array  # [L_pad] bool, P('stage'): False for identity (padding) slots

    @staticmethod
    def specs(state_specs) -> Weights:
        return Weights(state_specs, SPECS.layers)


# The KV cache as the programs take it: pools k, v [L_pad, pages, K, C bs, H], the rows'
# slot positions pos [B, S_cap] and block tables [B, n] (`model.cache`).
CACHE_SPECS = KVCache(SPECS.cache_lbksh, SPECS.cache_lbksh, SPECS.slots_bs, SPECS.rows)


class StageCache(NamedTuple):
    """This stage's pools of pages: k, v [L_pad / S, pages, K, bs, H]."""

    k: jax.Array
    v: jax.Array


@dataclasses.dataclass(frozen=True)
class Run:
    """One device's program as its ticks read it: the model merged from this device's
    weights, the weights (their `real` slots), the program's inputs, the rows' slot
    positions [B, S_cap / C] and block tables [B, n] (`ring.pages`), and the program's
    shape record (`shape`: its static
    choices, `pipeline.runtime.shapes`). Made inside the shard_map."""

    model: Qwen3
    cfg: Qwen3Config
    weights: Weights
    inputs: Any
    slot_pos: jax.Array
    table: jax.Array
    shape: Any

    @property
    def B(self) -> int:
        """The batch's rows."""
        return self.inputs.tokens.shape[0]

    @property
    def gated(self) -> bool:
        """No collectives inside the layers (one `seq` device): a stage may skip them."""
        return jax.lax.axis_size("seq") == 1

    @property
    def always_active(self) -> bool:
        """One stage: no bubbles, no cond around its layers."""
        return jax.lax.axis_size("stage") == 1


def vary(x: jax.Array, axes=AXES) -> jax.Array:
    """Marks x as varying along `axes` (those it is not varying along already), so loop
    carries keep one type whether a step computed them or passed them through."""
    return make_varying(x, frozenset(axes))


def from_device(x: jax.Array, stage, seq) -> jax.Array:
    """x as held by device (stage, seq) (its first `tensor` device), made the same on
    every device. Exact: every other device adds zeros."""
    here = (
        (jax.lax.axis_index("stage") == stage)
        & (jax.lax.axis_index("seq") == seq)
        & (jax.lax.axis_index("tensor") == 0)
    )
    return jax.lax.psum(jnp.where(here, vary(x), jnp.zeros_like(x)), MODEL_AXES)


def from_last_stage(x: jax.Array) -> jax.Array:
    """x as the last stage holds it (its first `tensor` device), made the same on every
    stage and `tensor` device; each `seq` device keeps its own (its share of the
    tokens). Exact: the other devices add zeros."""
    here = (jax.lax.axis_index("stage") == jax.lax.axis_size("stage") - 1) & (
        jax.lax.axis_index("tensor") == 0
    )
    return jax.lax.psum(jnp.where(here, vary(x), jnp.zeros_like(x)), ("stage", "tensor"))


def seq_axis() -> str | None:
    """The axis decode attention merges over: "seq", or None on one `seq` device, whose
    slots are all the cache (`ring.decode_attention`: no merge collectives). The
    program's values vary along every axis anyway (`vary`); `from_device` makes its
    outputs invariant."""
    return "seq" if jax.lax.axis_size("seq") > 1 else None


def shift(x, cyclic: bool):
    """Sends x from stage s to stage s + 1 (and the last back to stage 0 when cyclic);
    a stage that receives nothing gets zeros."""
    n = jax.lax.axis_size("stage")
    if n == 1 and cyclic:
        return x  # one stage sends to itself: no permute (a launch a tick)
    perm = [(s, (s + 1) % n) for s in range(n if cyclic else n - 1)]
    return jax.lax.ppermute(x, "stage", perm) if perm else jax.tree.map(jnp.zeros_like, x)


def write_kv(cache: jax.Array, new: jax.Array, layer, table, slots, ok) -> jax.Array:
    """The stage's pool cache [L/S, pages, K, bs, H] with new [B', T, K, H] written at
    local layer slot `layer`, through the rows' block table [B', n] (`ring.pages`), where
    `ok`: slots [B', T] each token's own local slot (a verify pass: each row at its own
    steps), [B'] one per row for T = 1 (a decode step), or a scalar, the first of T
    consecutive slots every row writes (a prefill's chunk). ok: [B', T], [B'] or a
    scalar alike (False: a bubble, or a decode step whose slot lies on another `seq`
    device). One scatter; what is not `ok` is dropped."""
    B, T = new.shape[:2]
    slots = jnp.asarray(slots)
    if slots.ndim == 0:
        slots = jnp.broadcast_to(slots + jnp.arange(T), (B, T))
    elif slots.ndim == 1:
        slots = slots[:, None]
    ok = jnp.asarray(ok)
    ok = jnp.broadcast_to(ok[:, None] if ok.ndim == 1 else ok, (B, T))
    return write_slots(cache, new, table, slots, ok, at=(layer,))


def cache_attend(layer, table, slot0, ok, attention):
    """An attend function (`model.layers.Attend`) for local layer slot `layer` that
    first writes the new k, v into the stage's pool at the rows' slots from slot0 on
    (through their table [B', n], where `ok`: `write_kv`), then returns
    attention(q, k, v, cache) -> o with the updated cache."""

    def attend(q, k, v, cache: StageCache):
        cache = StageCache(
            write_kv(cache.k, k, layer, table, slot0, ok),
            write_kv(cache.v, v, layer, table, slot0, ok),
        )
        return attention(q, k, v, cache), cache

    return attend


def on_last_stage(active, fn, shapes, x):
    """fn(x) on the last stage when `active`, else zeros of `shapes` (a pytree of
    ShapeDtypeStructs): the final norm, lm_head and sampling run only where they count."""
    last = active & (jax.lax.axis_index("stage") == jax.lax.axis_size("stage") - 1)

    def zeros(x):
        return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), shapes)

    return last, jax.lax.cond(last, lambda x: jax.tree.map(vary, fn(x)), zeros, x)


# One stage's layers as one function: the layer loop, its cache writes and the shift
# are the body of a lax.scan/fori_loop that XLA sees whole.
def run_stage(
    model: Qwen3,
    cfg: Qwen3Config,
    real: jax.Array,
    x: jax.Array,
    positions: jax.Array,
    cache: StageCache,
    attend_at,
    gated: bool,
    active: jax.Array | None = None,
) -> tuple[jax.Array, StageCache]:
    """This stage's layers on x [B, T, D] at global positions [B, T], unrolled.

    The model's layer weights are per-slot tuples (`sharding.place.place_params`): slot j of
    every leaf is a [1, ...] local buffer, so each matmul reads its weight in place (XLA
    copies a layer's slice out of a stacked array first, on CPU and GPU alike, which
    about doubled a decode step).

    Args:
      real: [L_pad / S] bool, this stage's slots (False: padded identity layer).
      attend_at(j) -> attend function for local slot j, a traced int32 (see
        model.layers.Attend); it reads and writes `cache`.
      gated: attend holds no collectives, so a slot that does not run (padding) is
        skipped whole with `lax.cond`. Otherwise attend runs on every device (XLA runs
        a collective only when every device joins it): only the layer's own work
        before and after it is skipped, and attend sees zero q, k, v.
      active: optional traced bool, False on a pipeline bubble: no slot runs then
        (only meaningful with gated=False; a gated caller skips the stage whole).
    Returns:
      (x [B, T, D], cache); a slot that does not run leaves x unchanged.
    """
    layer_def, layer_state = nnx.split(model.layers)
    n = len(jax.tree.leaves(layer_state, is_leaf=_is_slots)[0])
    # Each stage's real layers come first: the first L // S slots are real everywhere.
    always = cfg.L // jax.lax.axis_size("stage")
    rope = rope_tables(cfg, positions, x.dtype)
    stages = jax.lax.axis_size("stage")
    # Whether slot j of this stage is a sparse (MoE) layer: a constant table indexed by
    # the stage, read only when the config mixes dense and sparse layers.
    sparse_slots = jnp.asarray(
        [i is not None and cfg.is_sparse(i) for i in StagePlan(cfg.L, stages).layer_of_slot]
    )

    def sparse_at(j: int):
        return sparse_slots[jax.lax.axis_index("stage") * n + j]

    # Slots differ only in their weights and their index j into the cache, so each
    # kind of call below is one jitted function with j traced: JAX traces a layer once
    # per program instead of once per slot (tracing was a large part of compile time),
    # and XLA inlines the calls: the compiled program is the same.
    def layer(params):
        return nnx.merge(layer_def, params)

    @jax.jit
    def whole(params, x, cache, j, sparse):
        return layer(params)(x, rope, cache, attend_at(j), sparse)

    @jax.jit
    def inputs(params, x):
        return layer(params).attention_inputs(x, rope)

    @jax.jit
    def attend(q, k, v, cache, j):
        return attend_at(j)(q, k, v, cache)

    @jax.jit
    def finish(params, x, o, sparse):
        return layer(params).finish(x, o, sparse)

    for j in range(n):
        params = jax.tree.map(lambda t, j=j: t[j][0], layer_state, is_leaf=_is_slots)
        slot = jnp.int32(j)
        sparse = sparse_at(j)
        runs = None if j < always else real[j]
        if active is not None:
            runs = active if runs is None else runs & active

        if runs is None:
            x, cache = whole(params, x, cache, slot, sparse)
        elif gated:
            x, cache = jax.lax.cond(
                runs,
                lambda x, c, p=params, j=slot, s=sparse: whole(p, x, c, j, s),
                lambda x, c: (x, c),
                x,
                cache,
            )
        else:
            zeros = jax.tree.map(
                lambda a: vary(jnp.zeros(a.shape, a.dtype)), jax.eval_shape(inputs, params, x)
            )
            q, k, v = jax.lax.cond(
                runs, lambda x, p=params: inputs(p, x), lambda x, zeros=zeros: zeros, x
            )
            o, cache = attend(q, k, v, cache, slot)
            x = jax.lax.cond(
                runs, lambda x, o, p=params, s=sparse: finish(p, x, o, s), lambda x, o: x, x, o
            )
    return x, cache


def _is_slots(x) -> bool:
    return isinstance(x, tuple)


def when(
    active: jax.Array,
    compute,
    x: jax.Array,
    cache: StageCache,
    gated: bool,
    always_active: bool = False,
):
    """compute(x, cache, gate) on ticks where this stage is active, else (x, cache)
    unchanged.

    XLA runs a collective only when every device of the program reaches it, so the
    stage is skipped whole with `lax.cond` only where it holds none (gated: no `seq`
    axis to communicate along). Otherwise `compute` runs on a bubble too: it gets
    gate = `active` and must skip its layers' own work with it (`run_stage`'s
    `active`) and leave the cache alone; its x is dropped. Where the stage is skipped
    whole or never idles, gate is None.
    always_active: the schedule has no bubbles (one stage), so no test is needed.
    """
    if always_active:
        return compute(x, cache, None)
    if gated:
        return jax.lax.cond(active, lambda x, c: compute(x, c, None), lambda x, c: (x, c), x, cache)
    y, cache = compute(x, cache, active)
    return jnp.where(active, y, x), cache


def chunk_slot(u, busy, period: int, groups: int, size: int):
    """A decode chunk's schedule slot u = t - s (`pipeline.programs.schedule`: period ticks a
    step, `busy` = steps x period slots) -> (whether it runs a group, the group's first
    row, groups of `size` rows; the chunk's step it runs)."""
    runs = (u >= 0) & (u < busy) & (u % period < groups)
    u = jnp.clip(u, 0, busy - 1)
    return runs, jnp.minimum(u % period, groups - 1) * size, u // period


def rows(x: jax.Array, start, size: int, axis: int = 0) -> jax.Array:
    """x[start : start + size] along `axis` (start may be traced)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def put_rows(x: jax.Array, update: jax.Array, start, axis: int = 0) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), start, axis)
