"""Decode attention over a KV cache sharded along the `seq` mesh axis.

During decode the new tokens' queries are on every `seq` device and the cache stays
where it is: each device attends over its own slots, giving a partial (o, lse), and
the C partial results merge with the LSE formula of `ring.merge`, generalised to C
terms and done with collectives on (o, lse)-sized values only:

    m   = pmax(lse)                       (0 where every device is -inf)
    w_c = exp(lse_c - m)                  (0 on a device with no visible slot)
    o   = psum(o_c * w_c) / psum(w_c),    lse = m + log(psum(w_c))

The cache is never gathered. The result is the same (invariant) on every device.
Given how far the cache is filled, a device reads only its filled blocks of slots (on
CPU; see DECODE_BLOCK).

Dimension letters: B batch, T query tokens, S local cache slots, N query heads,
K KV heads, H head dim, C devices on the axis.
"""

import jax
import jax.numpy as jnp
from jax import lax

from qwen3_spmd.ops.varying import make_varying, varying_axes
from qwen3_spmd.ring.attention import (
    check_attention_shapes,
    check_axis,
    partial_attention,
)
from qwen3_spmd.ring.merge import finite_or_zero, merge

# Cache slots per block when decode attention reads only the filled part of the cache
# (on CPU). A cache has room for every token its requests may reach, and a request
# early in its generation has most of it empty: reading all of it at every step would
# spend much of a decode step on empty slots. Each block is copied out of the
# layer-stacked cache before its two products, and small blocks run much faster
# (likely: the copy is still in the core's caches when the products read it). 64 was
# the fastest measured at batch 8 (0.6B float32, 1x1, a 1024-slot cache, 512-token
# prompt: 292-331 ms a step, against 608-711 at 256 and 666-676 at 128; 32 was no
# faster) and as fast as any at batch 1.
DECODE_BLOCK = 64


def decode_slot(step, prompt_slots, n):
    """Where decode step `step` writes its K/V: (device j mod n, local slot
    prompt_slots + j // n), after the prompt's `prompt_slots` slots per device, so every
    device's cache fills at the same rate. Ints, arrays (one per row) or traced int32
    alike."""
    return step % n, prompt_slots + step // n


def decode_attention(
    q,
    k_cache,
    v_cache,
    q_pos,
    slot_pos,
    *,
    axis_name: str = "seq",
    scale: float,
    at: tuple = (0,),
    filled=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of new tokens over a sequence-sharded cache; call inside shard_map.

    Args:
      q: [B, T, N, H] queries of the new tokens (T usually 1), the same on every device.
      k_cache, v_cache: [*A, B', K, S, H] this device's cache slots, heads-major (the
        layout attention reads in place: `ring.attention.heads_major`). The queries'
        rows are the B from index `at` = (*A indices, first row): a layer-stacked
        cache [L, B', K, S, H] is read at (layer, row0), and where blocks are read
        only they are sliced out of it (XLA copies a slice before a product). A plain
        [B, K, S, H] cache takes the default (0,).
      q_pos: [B, T] int32 positions of the new tokens.
      slot_pos: [B, S] int32 positions held in this device's slots (-1: empty).
      axis_name: the mesh axis the cache is sharded along.
      scale: multiplier of the scores, usually H ** -0.5.
      filled: optional int32, a scalar or one per row [B] (traced or not): a row's
        slots at or past it are ignored (a cache filled in slot order holds nothing
        visible there yet). On CPU, with more than DECODE_BLOCK slots, attention then
        reads only the blocks below the largest.

    Returns:
      o: [B, T, N, H] in q's dtype; lse: [B, T, N] float32 (-inf: no visible slot on
      any device). Both invariant along `axis_name`.
    """
    b = q.shape[0]
    if k_cache.ndim != len(at) + 3 or v_cache.ndim != len(at) + 3:
        raise ValueError(
            f"decode_attention: caches {k_cache.shape}, {v_cache.shape} must have the "
            f"{len(at) - 1} leading axes that at={at} indexes, then [B, K, S, H]"
        )

    def rows(x):  # the queries' rows of a cache, as a shape
        return jax.ShapeDtypeStruct((b, *x.shape[-3:]), x.dtype)

    check_attention_shapes(
        "decode_attention", q, rows(k_cache), rows(v_cache), q_pos, slot_pos, kv_heads_major=True
    )
    check_axis("decode_attention", axis_name)
    S = k_cache.shape[-2]
    if filled is not None:
        filled = jnp.asarray(filled)
        per_row = filled[:, None] if filled.ndim else filled
        slot_pos = jnp.where(jnp.arange(S) < per_row, slot_pos, -1)
    if filled is None or S <= DECODE_BLOCK or jax.default_backend() != "cpu":
        o, lse = partial_attention(
            q, _rows(k_cache, at, b), _rows(v_cache, at, b), q_pos, slot_pos, scale
        )
    else:
        most = jnp.max(filled)
        o, lse = _filled_blocks(q, k_cache, v_cache, at, q_pos, slot_pos, most, scale)
    m = finite_or_zero(lax.pmax(lse, axis_name))
    w = jnp.exp(lse - m)  # [B, T, N]
    den = lax.psum(w, axis_name)
    o = lax.psum(o * w[..., None], axis_name) / jnp.where(den > 0, den, 1.0)[..., None]
    return o.astype(q.dtype), m + jnp.log(den)


def _rows(x, at, b: int, start=0, size: int | None = None):
    """The [b, K, size, H] block of cache x [*A, B', K, S, H] at rows at[-1] .. + b of
    index at[:-1], slots start .. start + size (all of them by default)."""
    size = x.shape[-2] if size is None else size
    lead = len(at) - 1
    sizes = (1,) * lead + (b, x.shape[-3], size, x.shape[-1])
    return lax.dynamic_slice(x, (*at, 0, start, 0), sizes).reshape(sizes[lead:])


def _filled_blocks(q, k_cache, v_cache, at, q_pos, slot_pos, filled, scale):
    """partial_attention over the DECODE_BLOCK-slot blocks below `filled`, merged one by
    one in a loop whose trip count is the number of such blocks, then over the slots
    after the last whole block (fewer than DECODE_BLOCK) if `filled` reaches them. Each
    block is sliced from the cache as it is read: the rest is neither copied nor read."""
    b, t, n, h = q.shape
    S, block = k_cache.shape[-2], DECODE_BLOCK
    whole = S // block
    axes = frozenset().union(*(varying_axes(x) for x in (q, k_cache, v_cache, q_pos, slot_pos)))

    def attend(carry, start, size):
        pos = lax.dynamic_slice_in_dim(slot_pos, start, size, axis=1)
        part = partial_attention(
            q,
            _rows(k_cache, at, b, start, size),
            _rows(v_cache, at, b, start, size),
            q_pos,
            pos,
            scale,
        )
        return tuple(make_varying(x, axes) for x in merge(*carry, *part))

    init = (
        make_varying(jnp.zeros((b, t, n, h), jnp.float32), axes),
        make_varying(jnp.full((b, t, n), -jnp.inf, jnp.float32), axes),
    )
    blocks = jnp.clip((filled + block - 1) // block, 0, whole)
    carry = lax.fori_loop(0, blocks, lambda i, c: attend(c, i * block, block), init)
    if S % block:
        carry = lax.cond(
            filled > whole * block,
            lambda c: attend(c, whole * block, S % block),
            lambda c: c,
            carry,
        )
    return carry


def context_attention(
    q, k_cache, v_cache, q_pos, slot_pos, *, axis_name: str = "seq", scale: float, at, filled
) -> tuple[jax.Array, jax.Array]:
    """Attention of a chunk of prompt queries, sharded along `axis_name` as prefill holds
    them, over the cached slots below `filled` on every device (the same prompt's
    earlier chunks); call inside shard_map. The chunk's queries are gathered along the
    axis, each device attends over its own cached slots and the partial results merge
    with LSE (`decode_attention`, as decode context parallelism reads the cache); each
    device keeps its own queries' rows, to merge with the ring over the chunk's keys.

    Args:
      q: [B, T, N, H] local queries; q_pos: [B, T] their positions (-1: padding).
      k_cache, v_cache, at, slot_pos, filled: as `decode_attention` (filled: a scalar).
    Returns:
      o: [B, T, N, H] in q's dtype; lse: [B, T, N] float32 (-inf: nothing cached is
      visible), for the local queries.
    """
    T = q.shape[1]
    q_all = lax.all_gather(q, axis_name, axis=1, tiled=True)
    pos_all = lax.all_gather(q_pos, axis_name, axis=1, tiled=True)
    o, lse = decode_attention(
        q_all,
        k_cache,
        v_cache,
        pos_all,
        slot_pos,
        axis_name=axis_name,
        scale=scale,
        at=at,
        filled=filled,
    )
    start = lax.axis_index(axis_name) * T
    return lax.dynamic_slice_in_dim(o, start, T, 1), lax.dynamic_slice_in_dim(lse, start, T, 1)
