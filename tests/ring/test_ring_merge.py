"""LSE merge: attention over A ∪ B from partial results over A and B, masked rows finite."""

import jax.numpy as jnp
import numpy as np
import pytest
from reference import dense_attention

from qwen3_spmd import ring

SCALE = 8**-0.5


def _random_case(seed, dtype):
    """Two key blocks with random positions, and every kind of fully masked row.

    Query row t=0 is padding (sees nothing anywhere); batch 0 sees nothing in block 1,
    batch 1 nothing in block 2; random positions mask the rest at random.
    """
    rng = np.random.default_rng(seed)
    b, t, n, kh, h, s1, s2 = 2, 6, 4, 2, 8, 5, 7
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k1, v1 = rng.standard_normal((2, b, s1, kh, h)).astype(np.float32)
    k2, v2 = rng.standard_normal((2, b, s2, kh, h)).astype(np.float32)
    q_pos = rng.integers(-1, 12, (b, t)).astype(np.int32)
    q_pos[:, 0] = -1
    p1 = rng.integers(-1, 12, (b, s1)).astype(np.int32)
    p2 = rng.integers(-1, 12, (b, s2)).astype(np.int32)
    p1[0] = -1
    p2[1] = 20  # present but after every query
    # Round the inputs to dtype so the reference sees exactly what the kernel sees.
    q, k1, v1, k2, v2 = (
        np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k1, v1, k2, v2)
    )
    return q, (k1, v1, p1), (k2, v2, p2), q_pos


@pytest.mark.parametrize("seed", range(4))
# bfloat16: o is rounded twice (each partial, then the merge), 2**-8 relative each;
# measured at most 7.4e-3 over 20 seeds. lse stays float32 in both dtypes.
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_merge_equals_attention_over_union(seed, dtype, tol):
    q, (k1, v1, p1), (k2, v2, p2), q_pos = _random_case(seed, dtype)
    as_dtype = lambda x: jnp.asarray(x, dtype)
    o1, lse1 = ring.block_attention(as_dtype(q), as_dtype(k1), as_dtype(v1), q_pos, p1, scale=SCALE)
    o2, lse2 = ring.block_attention(as_dtype(q), as_dtype(k2), as_dtype(v2), q_pos, p2, scale=SCALE)
    o, lse = ring.merge(o1, lse1, o2, lse2)

    o_ref, lse_ref = dense_attention(
        q,
        np.concatenate([k1, k2], 1),
        np.concatenate([v1, v2], 1),
        q_pos,
        np.concatenate([p1, p2], 1),
        SCALE,
    )
    assert o.dtype == dtype and lse.dtype == jnp.float32
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert np.all(np.isfinite(o))
    masked = np.isneginf(lse_ref)
    assert masked[:, 0].all() and not masked.all()  # the case has both kinds of rows
    assert np.array_equal(np.isneginf(lse), masked) and not np.isnan(lse).any()
    assert np.all(o[masked] == 0)
    np.testing.assert_allclose(o, o_ref, atol=tol, rtol=0)
    np.testing.assert_allclose(lse[~masked], lse_ref[~masked], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_masked_sides(dtype):
    o_a = jnp.full((1, 3, 2, 4), 0.5, dtype)
    lse_a = jnp.array([[[0.3, -jnp.inf], [-jnp.inf, -jnp.inf], [1.0, 2.0]]], jnp.float32)
    o_b = jnp.zeros((1, 3, 2, 4), dtype)
    lse_b = jnp.full((1, 3, 2), -jnp.inf, jnp.float32)

    o, lse = ring.merge(o_a, lse_a, o_b, lse_b)  # one side fully masked: the other unchanged
    assert o.dtype == dtype
    assert np.array_equal(np.asarray(lse), np.asarray(lse_a))
    expected = np.where(np.isneginf(np.asarray(lse_a))[..., None], 0.0, 0.5)
    assert np.array_equal(np.asarray(o, np.float32), np.broadcast_to(expected, o.shape))

    o, lse = ring.merge(o_b, lse_b, o_b, lse_b)  # both masked: 0 and -inf, no NaN
    assert np.all(np.asarray(o, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_merge_is_symmetric():
    rng = np.random.default_rng(0)
    o1, o2 = jnp.asarray(rng.standard_normal((2, 1, 3, 2, 4)), jnp.float32)
    lse1, lse2 = jnp.asarray(rng.standard_normal((2, 1, 3, 2)) * 5, jnp.float32)
    a = ring.merge(o1, lse1, o2, lse2)
    b = ring.merge(o2, lse2, o1, lse1)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6)
