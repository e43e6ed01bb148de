"""Decode attention over a KV cache sharded along the `seq` mesh axis.

During decode the new tokens' queries are on every `seq` device and the cache stays
where it is: each device attends over its own slots, giving a partial (o, lse), and
the C partial results merge with the LSE formula of `ring.merge`, generalised to C
terms and done with collectives on (o, lse)-sized values only:

    m   = pmax(lse)                       (0 where every device is -inf)
    w_c = exp(lse_c - m)                  (0 on a device with no visible slot)
    o   = psum(o_c * w_c) / psum(w_c),    lse = m + log(psum(w_c))

The cache is never gathered. The result is the same (invariant) on every device.
The cache is paged (`ring.pages`): each row's slots are read through its block table.
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
from qwen3_spmd.ring.pages import page_size, read_slots

# Cache slots per block (whole pages: `read_block`) when decode attention reads only the
# filled part of the cache (on CPU). A cache has room for every token its requests may reach, and a request
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
    table,
    axis_name: str = "seq",
    scale: float,
    at: tuple = (),
    filled=None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of new tokens over a sequence-sharded, paged cache; call inside shard_map.

    Args:
      q: [B, T, N, H] queries of the new tokens (T usually 1), the same on every device.
      k_cache, v_cache: [*A, pages, K, bs, H] this device's pool of pages (`ring.pages`),
        read at leading indices `at` (a layer-stacked pool [L, pages, K, bs, H] at
        (layer,)); a plain pool [pages, K, bs, H] takes the default ().
      q_pos: [B, T] int32 positions of the new tokens.
      slot_pos: [B, S] int32 positions held in the rows' local slots (-1: empty),
        S = n bs.
      table: [B, n] int32 the rows' pages (the same on every device).
      axis_name: the mesh axis the cache is sharded along; None: this device holds
        every slot (one `seq` device), and its partial result is the whole (no merge:
        over one device, its three all-reduces would each still be a launch a layer).
      scale: multiplier of the scores, usually H ** -0.5.
      filled: optional int32, a scalar or one per row [B] (traced or not): a row's
        slots at or past it are ignored (a cache filled in slot order holds nothing
        visible there yet). On CPU, with more than a read block of slots (`read_block`),
        attention then reads only the blocks below the largest.

    Returns:
      o: [B, T, N, H] in q's dtype; lse: [B, T, N] float32 (-inf: no visible slot on
      any device). Both invariant along `axis_name`.
    """
    b, n = table.shape
    bs = page_size(k_cache)
    if k_cache.ndim != len(at) + 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode_attention: pools {k_cache.shape}, {v_cache.shape} must have the "
            f"{len(at)} leading axes that at={at} indexes, then [pages, K, bs, H]"
        )

    def rows(x):  # the queries' rows of a pool, as a shape
        return jax.ShapeDtypeStruct((b, x.shape[-3], n * bs, x.shape[-1]), x.dtype)

    check_attention_shapes(
        "decode_attention", q, rows(k_cache), rows(v_cache), q_pos, slot_pos, kv_heads_major=True
    )
    if axis_name is not None:
        check_axis("decode_attention", axis_name)
    S = n * bs
    if filled is not None:
        filled = jnp.asarray(filled)
        per_row = filled[:, None] if filled.ndim else filled
        slot_pos = jnp.where(jnp.arange(S) < per_row, slot_pos, -1)
    if filled is None or S <= read_block(bs) or jax.default_backend() != "cpu":
        o, lse = partial_attention(
            q,
            read_slots(k_cache, table, at),
            read_slots(v_cache, table, at),
            q_pos,
            slot_pos,
            scale,
        )
    else:
        most = jnp.max(filled)
        o, lse = _filled_blocks(q, k_cache, v_cache, at, table, q_pos, slot_pos, most, scale)
    if axis_name is None:
        return o.astype(q.dtype), lse
    m = finite_or_zero(lax.pmax(lse, axis_name))
    w = jnp.exp(lse - m)  # [B, T, N]
    den = lax.psum(w, axis_name)
    o = lax.psum(o * w[..., None], axis_name) / jnp.where(den > 0, den, 1.0)[..., None]
    return o.astype(q.dtype), m + jnp.log(den)


def read_block(bs: int) -> int:
    """Slots a block of `_filled_blocks` reads: DECODE_BLOCK, in whole pages of bs."""
    return bs * max(1, DECODE_BLOCK // bs)


def _filled_blocks(q, k_cache, v_cache, at, table, q_pos, slot_pos, filled, scale):
    """partial_attention over the `read_block`-slot blocks below `filled`, merged one by
    one in a loop whose trip count is the number of such blocks, then over the slots
    after the last whole block (fewer than a block) if `filled` reaches them. Each
    block's pages are gathered from the pool as it is read: the rest is neither copied
    nor read."""
    b, t, n, h = q.shape
    bs = page_size(k_cache)
    S, block = table.shape[1] * bs, read_block(bs)
    whole = S // block
    axes = frozenset().union(
        *(varying_axes(x) for x in (q, k_cache, v_cache, q_pos, slot_pos, table))
    )

    def attend(carry, start, size):
        pos = lax.dynamic_slice_in_dim(slot_pos, start, size, axis=1)
        first, count = start // bs, size // bs
        part = partial_attention(
            q,
            read_slots(k_cache, table, at, first, count),
            read_slots(v_cache, table, at, first, count),
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
    q, k_cache, v_cache, q_pos, slot_pos, *, table, axis_name: str = "seq", scale: float, at, filled
) -> tuple[jax.Array, jax.Array]:
    """Attention of a chunk of prompt queries, sharded along `axis_name` as prefill holds
    them, over the cached slots below `filled` on every device (the same prompt's
    earlier chunks); call inside shard_map. The chunk's queries are gathered along the
    axis, each device attends over its own cached slots and the partial results merge
    with LSE (`decode_attention`, as decode context parallelism reads the cache); each
    device keeps its own queries' rows, to merge with the ring over the chunk's keys.

    Args:
      q: [B, T, N, H] local queries; q_pos: [B, T] their positions (-1: padding).
      k_cache, v_cache, at, slot_pos, table, filled: as `decode_attention` (filled: a
        scalar).
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
        table=table,
        axis_name=axis_name,
        scale=scale,
        at=at,
        filled=filled,
    )
    start = lax.axis_index(axis_name) * T
    return lax.dynamic_slice_in_dim(o, start, T, 1), lax.dynamic_slice_in_dim(lse, start, T, 1)
