"""Decode attention over a KV cache sharded along the `seq` mesh axis.

During decode the new tokens' queries are on every `seq` device and the cache stays
where it is: each device attends over its own slots, giving a partial (o, lse), and
the C partial results merge with the LSE formula of `ring.merge`, generalised to C
terms and done with collectives on (o, lse)-sized values only:

    m   = pmax(lse)                       (0 where every device is -inf)
    w_c = exp(lse_c - m)                  (0 on a device with no visible slot)
    o   = psum(o_c * w_c) / psum(w_c),    lse = m + log(psum(w_c))

The cache is never gathered. The result is the same (invariant) on every device.

Dimension letters: B batch, T query tokens, S local cache slots, N query heads,
K KV heads, H head dim, C devices on the axis.
"""

import jax
import jax.numpy as jnp
from jax import lax

from ring.attention import check_attention_shapes, check_axis, partial_attention
from ring.merge import finite_or_zero


def decode_attention(
    q, k_cache, v_cache, q_pos, slot_pos, *, axis_name: str = "seq", scale: float
) -> tuple[jax.Array, jax.Array]:
    """Attention of new tokens over a sequence-sharded cache; call inside shard_map.

    Args:
      q: [B, T, N, H] queries of the new tokens (T usually 1), the same on every device.
      k_cache, v_cache: [B, K, S, H] this device's cache slots, heads-major (the layout
        attention reads in place: `ring.attention.heads_major`).
      q_pos: [B, T] int32 positions of the new tokens.
      slot_pos: [B, S] int32 positions held in this device's slots (-1: empty).
      axis_name: the mesh axis the cache is sharded along.
      scale: multiplier of the scores, usually H ** -0.5.

    Returns:
      o: [B, T, N, H] in q's dtype; lse: [B, T, N] float32 (-inf: no visible slot on
      any device). Both invariant along `axis_name`.
    """
    check_attention_shapes("decode_attention", q, k_cache, v_cache, q_pos, slot_pos,
                           kv_heads_major=True)
    check_axis("decode_attention", axis_name)
    o, lse = partial_attention(q, k_cache, v_cache, q_pos, slot_pos, scale)
    m = finite_or_zero(lax.pmax(lse, axis_name))
    w = jnp.exp(lse - m)  # [B, T, N]
    den = lax.psum(w, axis_name)
    o = lax.psum(o * w[..., None], axis_name) / jnp.where(den > 0, den, 1.0)[..., None]
    return o.astype(q.dtype), m + jnp.log(den)
