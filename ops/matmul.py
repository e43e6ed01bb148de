"""Products with few rows, in the order XLA's CPU backend runs fastest.

A decode step multiplies a few rows (a row per request, or the G query heads of a KV
head) by a large operand (a weight, or a head's cached keys). XLA's CPU dot reads the
large operand about twice as fast when it is the left operand and the result comes out
[large, rows], turned after; the optimization barrier keeps XLA from folding the turn
back into the product. GPUs, and products with many rows, take the plain form. Both
`model.layers.dense` and the attention scores of `ring.attention` use it: it sits
below both (`ops/`), since the model knows no mesh and the ring no model.
"""

import jax
import jax.numpy as jnp
from jax import lax

# Up to this many rows the turned form is faster on CPU; from 1 row up to here alike.
FEW_ROWS = 32


def few_rows(rows: int) -> bool:
    """Whether a product with `rows` rows of its small operand takes the turned form."""
    return rows <= FEW_ROWS and jax.default_backend() == "cpu"


def turned_product(spec: str, big: jax.Array, small: jax.Array, **einsum_kw) -> jax.Array:
    """einsum(spec, big, small) with its last two result axes swapped after: `spec`
    writes the result [..., big's axis, rows], the caller gets [..., rows, big's axis]."""
    y = lax.optimization_barrier(jnp.einsum(spec, big, small, **einsum_kw))
    return jnp.swapaxes(y, -1, -2)
