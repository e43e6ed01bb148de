"""Log-sum-exp (LSE) merge of two partial attention results.

Attention of queries over a key set A ∪ B can be computed as two partial results,
(o_A, lse_A) over A and (o_B, lse_B) over B, where o is the softmax-weighted value
average and lse the log of the softmax denominator. They combine exactly:

    lse = logaddexp(lse_A, lse_B)
    o   = o_A * exp(lse_A - lse) + o_B * exp(lse_B - lse)

A row that sees no key has lse = -inf and o = 0. When both sides are -inf the
naive weights are exp(-inf - -inf) = NaN, so the reference subtracted is 0 there.
"""

import jax
import jax.numpy as jnp


def finite_or_zero(lse: jax.Array) -> jax.Array:
    """`lse` with -inf replaced by 0: a safe reference to subtract before exp."""
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


def merge(
    o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merges two partial attention results over disjoint key sets.

    Args:
      o1, o2: [B, T, N, H] partial outputs (any float dtype; 0 on fully masked rows).
      lse1, lse2: [B, T, N] float32 log-sum-exp of the scores (-inf: no visible key).

    Returns:
      o: [B, T, N, H] in o1's dtype, computed in float32; 0 where both sides are masked.
      lse: [B, T, N] float32.
    """
    lse = jnp.logaddexp(lse1, lse2)
    ref = finite_or_zero(lse)
    # exp(-inf - ref) = 0: a masked side contributes nothing, whatever its o holds.
    w1 = jnp.exp(lse1 - ref)[..., None]
    w2 = jnp.exp(lse2 - ref)[..., None]
    o = o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2
    return o.astype(o1.dtype), lse
