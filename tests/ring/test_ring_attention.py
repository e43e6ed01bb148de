"""Block attention and ring attention against dense causal attention (float64 numpy).

The ring runs for real under jax.shard_map on 1, 2, 4 and 8 emulated CPU devices,
with both partitions; its jaxpr is checked for the collectives it may use, and its
block counter for the pairs it skips.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import dense_attention

from qwen3_spmd import ring

SEQ = P(None, "seq")


def _mesh(c):
    return jax.make_mesh((c,), ("seq",), devices=jax.devices()[:c])


@functools.cache
def _ring(c, scale):
    """The jitted shard_map ring on c devices: (q, k, v, pos) -> (o, lse, blocks)."""

    def fn(q, k, v, pos):
        return ring.ring_attention(
            q, k, v, pos, pos, axis_name="seq", scale=scale, count_blocks=True
        )

    mesh = _mesh(c)
    return mesh, jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * 4, out_specs=(SEQ, SEQ, P("seq")))
    )


def _case(seed, *, b, length, n, kh, h, row_lengths=None):
    """Random q, k, v [B, length, ...] float32 and natural positions; row b may be shorter."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, length, n, h), dtype=np.float32)
    k, v = rng.standard_normal((2, b, length, kh, h), dtype=np.float32)
    lengths = np.asarray(row_lengths or [length] * b)[:, None]
    return q, k, v, lengths


def _run_ring(q, k, v, lengths, kind, c, dtype=jnp.float32):
    """Runs the ring on the partition `kind`; returns o, lse in natural order, blocks [C]."""
    length = q.shape[1]
    partition = getattr(ring, kind)(length, c)
    pos = ring.device_positions(partition)[None, :]
    pos = np.where(pos < lengths, pos, -1).astype(np.int32)  # -1 past each row's length
    mesh, fn = _ring(c, q.shape[-1] ** -0.5)
    placed = [
        jax.device_put(
            jnp.asarray(ring.to_device_order(x, partition), dtype),
            NamedSharding(mesh, SEQ),
        )
        for x in (q, k, v)
    ]
    o, lse, blocks = fn(*placed, jax.device_put(jnp.asarray(pos), NamedSharding(mesh, SEQ)))
    o = ring.from_device_order(np.asarray(o.astype(jnp.float32)), partition)
    return o, ring.from_device_order(np.asarray(lse), partition), np.asarray(blocks)


def _reference(q, k, v, lengths):
    pos = np.arange(q.shape[1])[None, :]
    pos = np.where(pos < lengths, pos, -1)
    return dense_attention(q, k, v, pos, pos, q.shape[-1] ** -0.5)


def _assert_close(o, lse, o_ref, lse_ref, atol, lse_atol=1e-5):
    masked = np.isneginf(lse_ref)
    assert np.all(np.isfinite(o))
    assert np.array_equal(np.isneginf(lse), masked) and not np.isnan(lse).any()
    assert np.all(o[np.broadcast_to(masked[..., None], o.shape)] == 0)
    np.testing.assert_allclose(o, o_ref, atol=atol, rtol=0)
    np.testing.assert_allclose(lse[~masked], lse_ref[~masked], atol=lse_atol, rtol=0)


def test_block_attention_is_dense_causal_attention():
    q, k, v, lengths = _case(0, b=2, length=7, n=6, kh=2, h=5, row_lengths=[7, 4])
    pos = np.where(np.arange(7)[None] < lengths, np.arange(7)[None], -1).astype(np.int32)
    o, lse = ring.block_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pos, pos, scale=0.3
    )
    o_ref, lse_ref = dense_attention(q, k, v, pos, pos, 0.3)
    assert o.dtype == jnp.float32 and lse.shape == (2, 7, 6)
    _assert_close(np.asarray(o), np.asarray(lse), o_ref, lse_ref, atol=1e-5)


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_ring_matches_dense_grouped_heads(c):
    """B=2, N=4 query heads over K=2 KV heads, 4 tokens per device, no padding."""
    q, k, v, lengths = _case(c, b=2, length=4 * c, n=4, kh=2, h=8)
    o_ref, lse_ref = _reference(q, k, v, lengths)
    for kind in ("contiguous", "zigzag"):
        o, lse, blocks = _run_ring(q, k, v, lengths, kind, c)
        _assert_close(o, lse, o_ref, lse_ref, atol=1e-5)
        work = ring.causal_work(getattr(ring, kind)(4 * c, c))
        if kind == "contiguous":
            # Device c: 3 pairs of its own block, all 4 of every earlier block, none later.
            assert blocks.tolist() == [3 + 4 * d for d in range(c)]
            assert work == sorted(work)
        else:
            # 3 pairs of its own block, 2 of each other: equal, like the work.
            assert blocks.tolist() == [2 * c + 1] * c
            assert len(set(work)) == 1


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_ring_matches_dense_odd_heads_padded(c):
    """N=3 query heads over K=1, head dim 5, a padded tail and a shorter second row."""
    length = 4 * c - 1
    q, k, v, lengths = _case(
        10 + c, b=2, length=length, n=3, kh=1, h=5, row_lengths=[length, length // 2]
    )
    o_ref, lse_ref = _reference(q, k, v, lengths)
    assert np.isneginf(lse_ref).any()  # the short row's padding sees nothing
    for kind in ("contiguous", "zigzag"):
        o, lse, blocks = _run_ring(q, k, v, lengths, kind, c)
        _assert_close(o, lse, o_ref, lse_ref, atol=1e-5)
        # Padding only removes work: never more pairs than the unpadded counts.
        full = [3 + 4 * d for d in range(c)] if kind == "contiguous" else [2 * c + 1] * c
        assert np.all(blocks <= full)


def test_ring_bfloat16():
    # Inputs are rounded to bfloat16 first, so the only error left is o's final
    # rounding (the ring accumulates in float32): measured 3.7e-3 on this case and
    # at most 6.2e-3 over seeds 0-5, both partitions. The bound is half a bfloat16
    # ulp at |o| < 4 (2**-7); lse stays float32 (error 3e-7).
    c = 4
    q, k, v, lengths = _case(3, b=2, length=4 * c, n=4, kh=2, h=8)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    o_ref, lse_ref = _reference(q, k, v, lengths)
    o, lse, _ = _run_ring(q, k, v, lengths, "zigzag", c, dtype=jnp.bfloat16)
    _assert_close(o, lse, o_ref, lse_ref, atol=2**-7)


def _eqns(jaxpr, weight=1):
    """(equation, runs) for every equation of a jaxpr and the jaxprs nested in it;
    runs multiplies by the length of each enclosing scan."""
    for eqn in jaxpr.eqns:
        yield eqn, weight
        inner = weight * eqn.params["length"] if eqn.primitive.name == "scan" else weight
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr, inner)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub, inner)


def _count(jaxpr, name):
    """How many times primitive `name` runs (cond branches counted once each)."""
    return sum(runs for eqn, runs in _eqns(jaxpr) if eqn.primitive.name == name)


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_ring_collectives(c):
    """(C-1) steps send k, v and positions: 3 ppermutes each, and nothing is gathered."""
    mesh, fn = _ring(c, 0.5)
    args = [
        jax.ShapeDtypeStruct((1, 2 * c, 2, 4), jnp.float32, sharding=NamedSharding(mesh, SEQ))
    ] * 3
    args.append(jax.ShapeDtypeStruct((1, 2 * c), jnp.int32, sharding=NamedSharding(mesh, SEQ)))
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    assert _count(jaxpr, "ppermute") == 3 * (c - 1)
    for gather in ("all_gather", "all_gather_invariant", "all_to_all", "psum", "pmax"):
        assert _count(jaxpr, gather) == 0, gather
    assert _count(jaxpr, "cond") == 4 * c  # 4 (query half, key half) pairs per step


def test_ring_inside_stage_seq_mesh():
    """On a (stage, seq) mesh with q varying along stage and k, v, positions not,
    the ring type-checks, communicates along seq only and matches dense attention."""
    mesh = jax.make_mesh((2, 4), ("stage", "seq"))
    scale = 8**-0.5

    def fn(q, k, v, pos):
        return ring.ring_attention(q, k, v, pos, pos, axis_name="seq", scale=scale)

    sharded = jax.jit(
        jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(P("stage", "seq"), SEQ, SEQ, SEQ),
            out_specs=(P("stage", "seq"),) * 2,
        )
    )
    q, k, v, _ = _case(5, b=2, length=16, n=4, kh=2, h=8)
    partition = ring.zigzag(16, 4)
    pos = np.asarray(ring.device_positions(partition)[None], np.int32)
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    args = (
        put(ring.to_device_order(q, partition), P("stage", "seq")),  # one batch row per stage
        put(ring.to_device_order(k[:1], partition), SEQ),
        put(ring.to_device_order(v[:1], partition), SEQ),
        put(pos, SEQ),
    )
    jaxpr = jax.make_jaxpr(sharded)(*args).jaxpr
    assert _count(jaxpr, "ppermute") == 3 * 3
    axes = {eqn.params["axis_name"] for eqn, _ in _eqns(jaxpr) if eqn.primitive.name == "ppermute"}
    assert axes == {("seq",)}

    o, lse = sharded(*args)
    natural = np.arange(16)[None].repeat(2, 0)
    k, v = np.repeat(k[:1], 2, 0), np.repeat(v[:1], 2, 0)  # both stages see the same k, v
    o_ref, lse_ref = dense_attention(q, k, v, natural, natural, scale)
    o = ring.from_device_order(np.asarray(o), partition)
    lse = ring.from_device_order(np.asarray(lse), partition)
    _assert_close(o, lse, o_ref, lse_ref, atol=1e-5)


def _trace_ring(q_shape, k_shape, v_shape, t_pos, s_pos, axis_name="seq"):
    mesh = _mesh(2)

    def fn(q, k, v, q_pos, k_pos):
        return ring.ring_attention(q, k, v, q_pos, k_pos, axis_name=axis_name, scale=1.0)

    shapes = [(q_shape, jnp.float32), (k_shape, jnp.float32), (v_shape, jnp.float32)]
    shapes += [((q_shape[0], t_pos), jnp.int32), ((k_shape[0], s_pos), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, SEQ)) for s, d in shapes]
    jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * 5, out_specs=(SEQ, SEQ)), *args)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (
            ((1, 8, 3, 4), (1, 8, 2, 4), (1, 8, 2, 4), 8, 8),
            "3 query heads are not a multiple of 2 KV heads",
        ),
        (((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 2, 5), 8, 8), r"k and v shapes differ"),
        (((1, 8, 4, 4), (1, 8, 2, 6), (1, 8, 2, 6), 8, 8), r"H=4.*H=6"),
        (((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4), 8, 6), r"k_pos \[1, 4\].*\(1, 3\)"),
        (
            ((1, 6, 4, 4), (1, 6, 2, 4), (1, 6, 2, 4), 6, 6),
            "local T=3 queries and S=3 keys must be even",
        ),
    ],
)
def test_ring_bad_shapes(shapes, message):
    with pytest.raises(ValueError, match=message):
        _trace_ring(*shapes)


def test_ring_bad_axis_name():
    with pytest.raises(ValueError, match="axis 'sq' is not an axis"):
        _trace_ring((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4), 8, 8, axis_name="sq")
    x, pos = jnp.zeros((1, 4, 2, 4)), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="axis 'seq' is not an axis"):
        ring.ring_attention(x, x, x, pos, pos, scale=1.0)


def test_long_query_blocks_run_in_chunks_with_the_same_result():
    """Past Q_CHUNK queries partial_attention maps over query chunks; every row must
    come out as the whole-matrix computation gives it, padding rows included."""
    from qwen3_spmd.ring.attention import Q_CHUNK, _scores_attention, partial_attention

    rng = np.random.default_rng(7)
    B, T, S, N, K, H = 2, 3 * Q_CHUNK, 320, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32)  # heads-major
    v = jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32)
    q_pos = np.tile(np.arange(T, dtype=np.int32) + 40, (B, 1))
    q_pos[1, -50:] = -1  # padding queries see nothing
    k_pos = np.tile(np.arange(S, dtype=np.int32), (B, 1))
    k_pos[0, 100:120] = -1
    o, lse = jax.jit(partial_attention, static_argnums=5)(q, k, v, q_pos, k_pos, H**-0.5)
    o_ref, lse_ref = _scores_attention(q, k, v, q_pos, k_pos, H**-0.5)
    np.testing.assert_allclose(o, o_ref, atol=1e-6)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    assert np.isinf(lse[1, -50:]).all() and not np.asarray(o[1, -50:]).any()
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 32, 33])
def test_scores_in_either_product_order_are_q_dot_k(rows):
    """Up to FEW_ROWS rows the scores are computed as k @ q^T on CPU (33: the plain
    order); either way score [b, k, r, s] is q[b, k, r] . k[b, k, s]."""
    from qwen3_spmd.ops.matmul import FEW_ROWS
    from qwen3_spmd.ring.attention import _scores

    assert FEW_ROWS == 32
    rng = np.random.default_rng(rows)
    qr = rng.standard_normal((2, 3, rows, 16)).astype(np.float32)
    k = rng.standard_normal((2, 3, 40, 16)).astype(np.float32)
    s = jax.jit(_scores)(qr, k)
    assert s.shape == (2, 3, rows, 40) and s.dtype == jnp.float32
    np.testing.assert_allclose(s, np.einsum("bkrh,bksh->bkrs", qr, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_prompt_attention_is_block_attention_on_real_rows(implementation):
    """The fused prompt path (one device, prompts in position order, padding after)
    agrees with position-masked block attention on every real row; "cudnn" runs where
    a GPU offers it, in bfloat16."""
    if implementation == "cudnn" and not ring.fused_attention_available(jnp.bfloat16, 64):
        pytest.skip("cuDNN fused attention needs a GPU")
    dtype = jnp.float32 if implementation == "xla" else jnp.bfloat16
    q, k, v, lengths = _case(3, b=3, length=64, n=8, kh=2, h=64, row_lengths=[64, 37, 1])
    pos = np.where(np.arange(64)[None] < lengths, np.arange(64)[None], -1).astype(np.int32)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    o = ring.prompt_attention(q, k, v, scale=0.125, implementation=implementation)
    o_ref, _ = ring.block_attention(q, k, v, pos, pos, scale=0.125)
    real = pos >= 0
    assert o.shape == q.shape and o.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(o, np.float32)[real],
        np.asarray(o_ref, np.float32)[real],
        atol=1e-5 if dtype == jnp.float32 else 2e-2,
        rtol=0,
    )
