"""Dense, position-masked attention: the single-device reference for every sharded path.

A key is visible to a query when `0 <= pos_k <= pos_q`: causality and padding come
from positions alone, never from slot order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array
) -> jax.Array:
    """Grouped-query attention with a softmax in float32.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H] with N a multiple of K.
      q_pos: [B, T] int32; k_pos: [B, S] int32 (-1 = padding or empty slot).
    Returns:
      o [B, T, N, H] in q's dtype; a query that sees no key gets 0.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * H**-0.5
    visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N, H).astype(q.dtype)
