"""Qwen3-MoE's sparse MLP: a router picks A of E experts for each token; each expert is
a SwiGLU MLP, and the chosen experts' outputs, weighted by the router, are summed.
Dropless: every token reaches all A of its experts (no capacity factor).

Letters: R rows (the B * T tokens flattened), D width, E experts, A experts chosen per
token, F one expert's MLP width (moe_intermediate_size).

Routing as transformers' Qwen3MoeTopKRouter computes it: logits = x @ router^T,
softmax over all E experts in float32, the top A, divided by their sum only when
norm_topk_prob, cast back to the activation dtype. Here the logits are float32 too
(highest precision), and the weighted sum of the experts' outputs is float32.

Five formulations of the experts compute the same sum:
- `experts_dense`: every expert on every row, weight 0 where not chosen: the exact
  reference, and a prefill formulation (chunked over rows);
- `experts_gathered`: for few rows (decode), the chosen experts' weights gathered per
  row and one batched product, so a step reads about A/E of the expert bytes;
- `experts_looped`: the same reads as a loop over the (row, choice) pairs, each a
  slice of the stacked weights and three matrix-vector products (`_expert_times`);
- `experts_grouped`: for many rows (prefill), the (row, choice) pairs sorted by expert,
  each expert's run of rows one matmul (`jax.lax.ragged_dot`);
- `experts_blocked`: the same sort, each expert's run padded to blocks of rows, and a
  loop of one expert's matmul per block (a grouped matmul without ragged_dot).
`formulation` picks one by the number of rows and the platform (DECODE, PREFILL).
Each reads the experts' weights through `Stacked`: whole, the experts of some pairs, or
one expert, so an FP8 checkpoint's experts are dequantized only where they are read: a
decode step of R * A < E pairs dequantizes those experts, not all E; a formulation that
would read experts E times or more dequantizes the stack once (`Stacked.for_reads`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.linear import Linear
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.ops.varying import make_varying, varying_axes

HIGHEST = jax.lax.Precision.HIGHEST

# Formulation per platform. On XLA's CPU backend a gather of whole experts and a
# batched product over them run far below the memory bandwidth, and ragged_dot has no
# grouped kernel (it runs slower than computing every expert), so CPU loops over the
# chosen experts for decode and over blocks of sorted rows for a prefill; other
# platforms take the batched forms, unmeasured. The measurements: docs/benchmarks.md,
# Qwen3-MoE (`python tools/moe_measure.py`).
DECODE = {"cpu": "looped"}
PREFILL = {"cpu": "blocked"}
# (row, expert) pairs per expert up to which the decode formulation runs: it reads
# rows x A experts, a prefill one each chosen expert about once. On CPU `looped`, which
# reads experts in place, stays ahead of `blocked` up to about 6E pairs, where the two
# cross (docs/benchmarks.md, Qwen3-MoE); elsewhere, unmeasured, up to E.
DECODE_PAIRS_PER_EXPERT = {"cpu": 6}
# The longest expert row (in elements) `experts_looped` reads with the fused one-row
# product: up to it the fused product reads a slice of the stack in place, several
# times faster than the plain one; on wider rows it falls far below it (docs/benchmarks.md,
# Qwen3-MoE: the rates by row length), so those take the plain product.
FUSED_MAX_K = 2048
# Rows per chunk of the dense formulation (bounds its [rows, E * F] intermediate).
DENSE_CHUNK = 256


def route(x: jax.Array, router_ed: jax.Array, top: int, normalize: bool):
    """x [R, D], router_ed [E, D] -> (weights [R, A] in x's dtype, experts [R, A] int32,
    logits [R, E] float32)."""
    logits = jnp.einsum(
        "RD,ED->RE", x.astype(jnp.float32), router_ed.astype(jnp.float32), precision=HIGHEST
    )
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32), logits


@dataclasses.dataclass(frozen=True)
class Stacked:
    """One projection of the experts, stacked [E, N, K] ([out, in] per expert), as a
    formulation reads it: `whole()`, the experts `take(ids)` names, or `one(e)`. It is
    held as stored (float8 and its scales in an FP8 checkpoint) and dequantized in what
    is read (`Linear.product`)."""

    w: jax.Array
    scale: jax.Array | None = None  # FP8: the scales, experts leading as w's
    name: str = ""  # the parameter (which axis is D, for the scales)
    linear: Linear | None = None  # FP8: how to dequantize

    @classmethod
    def of(cls, module: nnx.Module, name: str, linear: Linear) -> Stacked:
        return cls(*linear.stored(module, name), name, linear)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def _product(self, w, scale) -> jax.Array:
        return w if scale is None else self.linear.product(self.name, w, scale)

    def whole(self) -> jax.Array:
        """[E, N, K] in the activations' dtype."""
        return self._product(self.w, self.scale)

    def take(self, ids: jax.Array) -> jax.Array:
        """The experts ids [...] names: [..., N, K]."""
        return self._product(self.w[ids], None if self.scale is None else self.scale[ids])

    def for_reads(self, n: int) -> Stacked:
        """This stack for a formulation that reads an expert `n` times (pairs, or
        blocks): as it is while n < E, so each read dequantizes one expert; from E on,
        its experts dequantized once, whole (n reads of one would dequantize more)."""
        if self.scale is None or n < self.shape[0]:
            return self
        return Stacked(self.whole())

    def one(self, e: jax.Array) -> jax.Array:
        """Expert e (a traced scalar): [N, K]."""

        def at(a):
            return jax.lax.dynamic_index_in_dim(a, e, keepdims=False)

        return self._product(at(self.w), None if self.scale is None else at(self.scale))


def _swiglu(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
    return jax.nn.silu(h_gate) * h_up


def experts_dense(x, weights, ids, gate_efd, up_efd, down_edf, chunk: int = DENSE_CHUNK):
    """All E experts on every row, chunked over rows. x [R, D], weights and ids [R, A]
    -> [R, D] float32.

    The experts are flattened to one [E * F, D] matrix per projection (XLA's CPU
    backend runs an einsum with the expert axis apart an order of magnitude slower),
    and each expert's activation is weighted before the down projection, whose
    float32 accumulation over E * F is then the weighted sum."""
    R, D = x.shape
    E, F, _ = gate_efd.shape
    gate_efd, up_efd, down_edf = (w.whole() for w in (gate_efd, up_efd, down_edf))
    combine = (
        jnp.zeros((R, E), jnp.float32)
        .at[jnp.arange(R)[:, None], ids]
        .add(weights.astype(jnp.float32))
    )
    gate, up = gate_efd.reshape(E * F, D), up_efd.reshape(E * F, D)
    down = down_edf.transpose(0, 2, 1).reshape(E * F, D)  # once per call, not per chunk

    def block(args):
        xb, cb = args  # [c, D], [c, E]
        h = _swiglu(jnp.einsum("RD,MD->RM", xb, gate), jnp.einsum("RD,MD->RM", xb, up))
        hw = h.reshape(-1, E, F).astype(jnp.float32) * cb[:, :, None]
        return jnp.einsum(
            "RM,MD->RD",
            hw.reshape(-1, E * F).astype(x.dtype),
            down,
            preferred_element_type=jnp.float32,
        )

    c = min(chunk, R)
    pad = -R % c
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, c, D)
    cs = jnp.pad(combine, ((0, pad), (0, 0))).reshape(-1, c, E)
    return jax.lax.map(block, (xs, cs)).reshape(-1, D)[:R]


def experts_gathered(x, weights, ids, gate_efd, up_efd, down_edf):
    """Each row through its own A experts, their weights gathered. x [R, D], weights and
    ids [R, A] -> [R, D] float32. Reads R * A experts' weights (fewer when rows share)."""
    gate, up, down = (w.for_reads(ids.size).take(ids) for w in (gate_efd, up_efd, down_edf))
    h = _swiglu(jnp.einsum("RD,RAFD->RAF", x, gate), jnp.einsum("RD,RAFD->RAF", x, up))
    y = jnp.einsum("RAF,RADF->RAD", h, down)
    return jnp.einsum(
        "RAD,RA->RD", y.astype(jnp.float32), weights.astype(jnp.float32), precision=HIGHEST
    )


def _expert_times(w_eno: Stacked, e, v) -> jax.Array:
    """w_eno [E, N, K] experts stacked [out, in], e a scalar expert, v [K] -> w[e] @ v
    [N]. With K <= FUSED_MAX_K it is written v @ w[e]^T, which XLA's CPU backend fuses
    with the slice into one loop on both cores that reads the expert in place; the
    plain form copies the slice out of the stack first, then reads it on one thread."""
    w = w_eno.one(e)
    return v @ w.T if w.shape[1] <= FUSED_MAX_K else w @ v


def experts_looped(x, weights, ids, gate_efd, up_efd, down_edf, skip_zero: bool = False):
    """A loop over the R * A (row, choice) pairs: the pair's expert sliced out of the
    stacked weights, three matrix-vector products, the weighted outputs summed per row
    in float32. x [R, D], weights and ids [R, A] -> [R, D] float32. skip_zero: a pair of
    weight 0 (routed to another device's experts) reads and computes nothing."""
    R, A = ids.shape
    gate_efd, up_efd, down_edf = (w.for_reads(R * A) for w in (gate_efd, up_efd, down_edf))

    def product(r, e, w):
        xr = x[r]
        h = _swiglu(_expert_times(gate_efd, e, xr), _expert_times(up_efd, e, xr))
        return w.astype(jnp.float32) * _expert_times(down_edf, e, h).astype(jnp.float32)

    def pair(p):  # no carry: under shard_map its type would have to track x's axes
        if not skip_zero:
            return product(*p)
        # Inside shard_map both branches must vary along the same mesh axes.
        axes = frozenset().union(*(varying_axes(a) for a in (x, weights, down_edf.w)))
        zeros = make_varying(jnp.zeros((down_edf.shape[1],), jnp.float32), axes)
        return jax.lax.cond(p[2] != 0, lambda p: product(*p), lambda p: zeros, p)

    rows = jnp.repeat(jnp.arange(R, dtype=jnp.int32), A)
    ys = jax.lax.map(pair, (rows, ids.reshape(-1), weights.reshape(-1)))  # [R * A, D]
    return jnp.sum(ys.reshape(R, A, -1), axis=1)


def _ragged(lhs, rhs_egk, sizes):
    """lhs [M, k] rows sorted by expert, rhs [E, n, k] ([out, in] per expert), sizes [E]
    -> [M, n]: rows of expert e times rhs[e]^T."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(lhs, rhs_egk, sizes, numbers)


def experts_grouped(x, weights, ids, gate_efd, up_efd, down_edf):
    """The (row, choice) pairs sorted by expert, one grouped matmul per projection.
    x [R, D], weights and ids [R, A] -> [R, D] float32."""
    R, A = ids.shape
    E = gate_efd.shape[0]
    flat = ids.reshape(-1)  # [R * A], pair p = (row p // A, choice p % A)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[order // A]  # [R * A, D], grouped by expert
    gate_efd, up_efd, down_edf = (w.whole() for w in (gate_efd, up_efd, down_edf))
    h = _swiglu(_ragged(xs, gate_efd, sizes), _ragged(xs, up_efd, sizes))
    ys = _ragged(h, down_edf, sizes)  # [R * A, D]
    y = ys[jnp.argsort(order)].reshape(R, A, -1)  # back to (row, choice) order
    return jnp.einsum(
        "RAD,RA->RD", y.astype(jnp.float32), weights.astype(jnp.float32), precision=HIGHEST
    )


def experts_blocked(x, weights, ids, gate_efd, up_efd, down_edf, skip_zero: bool = False):
    """The grouped matmul by hand: the (row, choice) pairs sorted by expert, each
    expert's run padded to whole blocks of b rows, and a loop over the blocks, each one
    expert's slice of the stack times b rows. x [R, D], weights and ids [R, A] ->
    [R, D] float32. skip_zero: pairs of weight 0 (an all-to-all's empty slots, or
    choices another device's experts serve) take no place in a block: they sort after
    every expert's run and compute nothing.

    b is about the mean run length (R * A / E, in multiples of 8), so the loop runs at
    most R * A / b + E <= 2E + 1 blocks and reads each chosen expert about once."""
    R, A = ids.shape
    E = gate_efd.shape[0]
    P = R * A
    b = 8 * max(1, -(-P // (8 * E)))
    blocks = P // b + E  # sum over experts of ceil(run / b) never exceeds this
    gate_efd, up_efd, down_edf = (w.for_reads(blocks) for w in (gate_efd, up_efd, down_edf))
    flat = ids.reshape(-1)
    if skip_zero:  # expert E: no expert's, after every run
        flat = jnp.where(weights.reshape(-1) != 0, flat, E)
    order = jnp.argsort(flat, stable=True)  # sorted pair -> pair
    expert = flat[order]
    sizes = jnp.bincount(flat, length=E + 1)[:E]
    padded = -(-sizes // b) * b
    ends = jnp.cumsum(padded)
    at = jnp.minimum(expert, E - 1)
    rank = jnp.arange(P) - (jnp.cumsum(sizes) - sizes)[at]
    dest = (ends - padded)[at] + rank  # sorted pair -> its place among the blocks
    dest = jnp.where(expert < E, dest, blocks * b)  # a skipped pair: none (dropped)
    row = (
        jnp.full((blocks * b,), R, jnp.int32)
        .at[dest]
        .set((order // A).astype(jnp.int32), mode="drop")
    )
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[row]  # row R: zeros
    block_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * b, side="right"), E - 1)

    def block(args):
        xb, e = args  # [b, D]; padding rows are zeros and give zeros
        h = _swiglu(xb @ gate_efd.one(e).T, xb @ up_efd.one(e).T)
        return h @ down_edf.one(e).T

    ys = jax.lax.map(block, (xs.reshape(blocks, b, -1), block_expert)).reshape(blocks * b, -1)
    ys = jnp.concatenate([ys, jnp.zeros((1, ys.shape[1]), ys.dtype)])  # a skipped pair's
    y = ys[dest][jnp.argsort(order)].reshape(R, A, -1)  # back to (row, choice) order
    return jnp.einsum(
        "RAD,RA->RD", y.astype(jnp.float32), weights.astype(jnp.float32), precision=HIGHEST
    )


FORMULATIONS = {
    "dense": experts_dense,
    "gathered": experts_gathered,
    "looped": experts_looped,
    "grouped": experts_grouped,
    "blocked": experts_blocked,
}


def formulation(rows: int, experts: int, top: int) -> str:
    """Which formulation runs `rows` rows: decode's while rows * A is at most
    DECODE_PAIRS_PER_EXPERT x E, else prefill's."""
    backend = jax.default_backend()
    if rows * top <= DECODE_PAIRS_PER_EXPERT.get(backend, 1) * experts:
        return DECODE.get(backend, "gathered")
    return PREFILL.get(backend, "grouped")


class MoE(nnx.Module):
    """Router [E, D] and E SwiGLU experts stacked on an expert axis, each stored
    [out, in] as the checkpoint has them: gate and up [E, F, D], down [E, D, F].

    Under a tensor split (model.split) a device holds E/X whole experts ("ep") or the
    F/X columns of every expert ("tp"), and returns its part of the sum; the router is
    whole on every device, so all route alike. Under "a2a" a device holds E/n whole
    experts, n the devices of `data` x `tensor`, and serves every token that chose one
    of them (`_all_to_all`)."""

    def __init__(self, cfg: Qwen3Config, *, dtype, rngs: nnx.Rngs, split=TensorSplit()):
        E, D, F = cfg.E, cfg.D, split.expert_width(cfg)
        self.split = split

        def param(shape):
            return nnx.Param(
                (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
            )

        self.router_ed = param((E, D))  # the router stays unquantized in FP8 checkpoints
        self.linear = linear = Linear.of(cfg, dtype)
        linear.make(self, "gate_efd", rngs, (E, F, D))
        linear.make(self, "up_efd", rngs, (E, F, D))
        linear.make(self, "down_edf", rngs, (E, D, F))
        self.top = cfg.A
        self.normalize = cfg.norm_topk_prob

    def __call__(self, h: jax.Array, how: str | None = None) -> jax.Array:
        """h [B, T, D] -> [B, T, D]; how: a key of FORMULATIONS (default: `formulation`)."""
        B, T, D = h.shape
        x = h.reshape(B * T, D)
        weights, ids, _ = route(x, self.router_ed[...], self.top, self.normalize)
        if self.split.exchanges:
            return self._all_to_all(x, weights, ids, how).astype(h.dtype).reshape(B, T, D)
        experts = self.gate_efd.shape[0]  # this device's
        if self.split.size > 1 and self.split.experts == "ep":
            # The pairs routed to another device's experts weigh zero here.
            local = ids - self.split.first(experts)
            mine = (local >= 0) & (local < experts)
            weights = jnp.where(mine, weights, jnp.zeros_like(weights))
            ids = jnp.clip(local, 0, experts - 1)
        how = how or formulation(B * T, experts, self.top)
        ep = self.split.size > 1 and self.split.experts == "ep"
        extra = {"skip_zero": True} if ep and how == "looped" else {}
        gate, up, down = (
            Stacked.of(self, w, self.linear) for w in ("gate_efd", "up_efd", "down_edf")
        )
        y = FORMULATIONS[how](x, weights, ids, gate, up, down, **extra)
        return y.astype(h.dtype).reshape(B, T, D)

    def _all_to_all(self, x, weights, ids, how: str | None) -> jax.Array:
        """The "a2a" split: x [R, D] (this replica's tokens, the same on its X tensor
        devices), weights and ids [R, A] (every device routed alike) -> this device's
        part of the output [R, D] float32: its 1/X of the tokens' rows, zeros elsewhere
        (the layer's psum over `tensor` puts the rows together).

        Tensor device t takes tokens t R_x .. (R_x = ceil(R / X)), and sends each to
        those of the n devices of `data` x `tensor` (`TensorSplit.expert_axes`) that
        hold at least one of its chosen experts, once, with the weights and local ids
        of the choices that device serves: the slots of a [n, R_x] buffer, the tokens
        for device g packed first in row g. A row holds all R_x tokens, so no routing drops
        a token (dropless), and one `all_to_all` carries every row to its device. There
        the received [n R_x] slots run through a formulation, pairs of weight 0 (empty
        slots, other devices' choices) skipped where it can, and a second `all_to_all`
        brings each slot's weighted sum back to its token, which adds the sums of its
        (at most A) devices."""
        split = self.split
        X, n = split.size, split.expert_devices
        E_loc = self.gate_efd.shape[0]  # this device's experts
        R, A = ids.shape
        D = x.shape[1]
        R_x = -(-R // X)
        pad = ((0, X * R_x - R), (0, 0))  # padding rows weigh nothing: never sent
        x, weights, ids = jnp.pad(x, pad), jnp.pad(weights, pad), jnp.pad(ids, pad)
        t = jax.lax.axis_index(split.axis) if X > 1 else 0
        x, weights, ids = (jax.lax.dynamic_slice_in_dim(a, t * R_x, R_x) for a in (x, weights, ids))
        g = jnp.arange(n, dtype=jnp.int32)
        serves = (ids[:, :, None] // E_loc == g) & (weights != 0)[:, :, None]  # [R_x, A, n]
        sent = serves.any(axis=1)  # [R_x, n]: token r goes to device g
        slot = jnp.where(sent, jnp.cumsum(sent, axis=0) - 1, R_x)  # its place in row g
        to = (jnp.broadcast_to(g, (R_x, n)), slot)  # R_x: past the row, dropped

        def buffer(values):  # values [R_x, n, ...] -> [n, R_x, ...], each at its slot
            empty = jnp.zeros((n, R_x, *values.shape[2:]), values.dtype)
            return empty.at[to].set(values, mode="drop")

        chosen = jnp.where(serves, weights[:, :, None], 0).transpose(0, 2, 1)  # [R_x, n, A]
        local = jnp.clip(ids[:, :, None] - g * E_loc, 0, E_loc - 1).transpose(0, 2, 1)
        send = (buffer(jnp.broadcast_to(x[:, None], (R_x, n, D))), buffer(chosen), buffer(local))

        def exchange(a):
            return jax.lax.all_to_all(a, split.expert_axes, 0, 0, tiled=True)

        got_x, got_w, got_ids = (exchange(a) for a in send)  # [n, R_x, ...] by source
        how = how or formulation(R, E_loc * n, self.top)  # the whole model's regime
        extra = {"skip_zero": True} if how in ("looped", "blocked") else {}
        gate, up, down = (
            Stacked.of(self, w, self.linear) for w in ("gate_efd", "up_efd", "down_edf")
        )
        y = FORMULATIONS[how](
            got_x.reshape(n * R_x, D),
            got_w.reshape(n * R_x, A),
            got_ids.reshape(n * R_x, A),
            gate,
            up,
            down,
            **extra,
        )
        back = exchange(y.astype(x.dtype).reshape(n, R_x, D))  # [n, R_x, D]: by server
        at = jnp.minimum(slot, R_x - 1).T[:, :, None]  # [n, R_x, 1]
        mine = jnp.take_along_axis(back, at, axis=1).astype(jnp.float32)
        out = jnp.sum(jnp.where(sent.T[:, :, None], mine, 0.0), axis=0)  # [R_x, D]
        rows = jnp.zeros((X * R_x, D), jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(rows, out, t * R_x, 0)[:R]
