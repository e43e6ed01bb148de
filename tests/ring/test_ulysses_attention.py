"""Ulysses attention against dense causal attention (float64 numpy) and the ring.

It runs for real under jax.shard_map on 1, 2, 3, 4 and 8 emulated CPU devices, with
grouped-query heads split every way `head_split` knows (C < K, C = K, C > K, and C
not a divisor of K), padding and rows of different lengths; its jaxpr is checked for
the collectives it uses, and an impossible head split for its error.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import dense_attention
from test_ring_attention import _assert_close, _case, _count, _eqns, _reference, _run_ring

from qwen3_spmd import ring

SEQ = P(None, "seq")


@functools.cache
def _ulysses(c, scale):
    """The jitted shard_map Ulysses on c devices: (q, k, v, pos) -> (o, lse)."""
    mesh = jax.make_mesh((c,), ("seq",), devices=jax.devices()[:c])

    def fn(q, k, v, pos):
        return ring.ulysses_attention(
            q, k, v, pos, pos, axis_name="seq", scale=scale, with_lse=True
        )

    return mesh, jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * 4, out_specs=(SEQ, SEQ)))


def _run_ulysses(q, k, v, lengths, kind, c, dtype=jnp.float32):
    """As test_ring_attention._run_ring: o, lse in natural order."""
    partition = getattr(ring, kind)(q.shape[1], c)
    pos = ring.device_positions(partition)[None, :]
    pos = np.where(pos < lengths, pos, -1).astype(np.int32)
    mesh, fn = _ulysses(c, q.shape[-1] ** -0.5)
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, SEQ))  # noqa: E731
    o, lse = fn(
        *(put(jnp.asarray(ring.to_device_order(x, partition), dtype)) for x in (q, k, v)), put(pos)
    )
    o = ring.from_device_order(np.asarray(o.astype(jnp.float32)), partition)
    return o, ring.from_device_order(np.asarray(lse), partition)


# (C, N, K): C < K, C = K, C > K with K | C, and C > K or C < K with K not dividing C.
SPLITS = [(1, 4, 2), (2, 8, 4), (4, 8, 4), (8, 8, 4), (8, 16, 2), (4, 4, 1), (3, 6, 2), (2, 6, 3)]


@pytest.mark.parametrize("c,n,kh", SPLITS, ids=lambda x: str(x))
def test_ulysses_matches_dense_and_the_ring(c, n, kh):
    """Two rows of different lengths (the second padded to half), an odd head dim, both
    partitions: o and lse as dense attention gives them, and as the ring does."""
    length = 4 * c - 1
    q, k, v, lengths = _case(
        20 + c, b=2, length=length, n=n, kh=kh, h=5, row_lengths=[length, length // 2]
    )
    o_ref, lse_ref = _reference(q, k, v, lengths)
    assert np.isneginf(lse_ref).any()
    for kind in ("zigzag", "contiguous"):
        o, lse = _run_ulysses(q, k, v, lengths, kind, c)
        _assert_close(o, lse, o_ref, lse_ref, atol=1e-5)
        o_ring, lse_ring, _ = _run_ring(q, k, v, lengths, kind, c)
        np.testing.assert_allclose(o, o_ring, atol=1e-5, rtol=0)


def test_ulysses_long_blocks_and_bfloat16():
    """Blocks longer than Q_CHUNK (the query-chunked path) on 2 devices, in bfloat16:
    inputs rounded first, so the error left is o's final rounding (as the ring's)."""
    from qwen3_spmd.ring.attention import Q_CHUNK

    c = 2
    q, k, v, lengths = _case(4, b=1, length=4 * Q_CHUNK, n=4, kh=2, h=8)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    o_ref, lse_ref = _reference(q, k, v, lengths)
    o, lse = _run_ulysses(q, k, v, lengths, "zigzag", c, dtype=jnp.bfloat16)
    _assert_close(o, lse, o_ref, lse_ref, atol=2**-7)


def test_head_split():
    """Each device's query heads read exactly the KV heads it is sent, in groups."""
    cases = {
        (16, 8, 2): (8, 4, False),
        (16, 8, 8): (2, 1, False),
        (16, 8, 16): (1, 1, True),
        (6, 2, 3): (2, 2, True),
        (40, 8, 8): (5, 1, False),
        (8, 2, 4): (2, 1, True),
    }
    for (n, kh, c), want in cases.items():
        s = ring.head_split(n, kh, c)
        assert (s.q_heads, s.kv_heads, s.repeats) == want
        assert s.kv_sent == c * s.kv_heads and (s.kv_sent == kh) == (not s.repeats)
        per = s.q_heads // s.kv_heads
        for dev in range(c):
            for i in range(s.q_heads):
                head = dev * s.q_heads + i
                assert s.kv_index[dev * s.kv_heads + i // per] == head // (n // kh)


def test_impossible_head_split_is_a_clear_error():
    with pytest.raises(
        ValueError,
        match=r"6 query heads cannot be shared equally by 4 seq "
        r"devices; use ring attention, or a seq size that divides 6",
    ):
        ring.head_split(6, 2, 4)
    mesh, fn = _ulysses(4, 0.5)
    x = jax.ShapeDtypeStruct((1, 8, 6, 4), jnp.float32, sharding=NamedSharding(mesh, SEQ))
    kv = jax.ShapeDtypeStruct((1, 8, 2, 4), jnp.float32, sharding=NamedSharding(mesh, SEQ))
    pos = jax.ShapeDtypeStruct((1, 8), jnp.int32, sharding=NamedSharding(mesh, SEQ))
    with pytest.raises(ValueError, match="cannot be shared equally"):
        jax.eval_shape(fn, x, kv, kv, pos)


@pytest.mark.parametrize("c,n,kh", [(2, 8, 4), (4, 4, 1), (8, 8, 8)], ids=str)
def test_ulysses_collectives(c, n, kh):
    """All-to-all q, k, v there and o (and lse) back, one gather of the positions, no
    ppermute: the same count whatever C is."""
    mesh, fn = _ulysses(c, 0.5)
    spec = NamedSharding(mesh, SEQ)
    args = [
        jax.ShapeDtypeStruct((1, 2 * c, n, 4), jnp.float32, sharding=spec),
        *[jax.ShapeDtypeStruct((1, 2 * c, kh, 4), jnp.float32, sharding=spec)] * 2,
        jax.ShapeDtypeStruct((1, 2 * c), jnp.int32, sharding=spec),
    ]
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    assert _count(jaxpr, "all_to_all") == 5  # q, k, v, o, lse
    assert _count(jaxpr, "all_gather") == 1
    assert _count(jaxpr, "ppermute") == 0
    named = [
        eqn.params["axis_name"]
        for eqn, _ in _eqns(jaxpr)
        if eqn.primitive.name in ("all_to_all", "all_gather")
    ]
    # all_to_all names one axis, all_gather a tuple of them
    assert {a for x in named for a in (x if isinstance(x, tuple) else (x,))} == {"seq"}


def test_ulysses_inside_stage_seq_mesh():
    """On a (stage, seq) mesh with q varying along stage and k, v, positions not, it
    type-checks, communicates along seq only (4 all-to-alls without lse) and matches
    dense attention."""
    mesh = jax.make_mesh((2, 4), ("stage", "seq"))
    scale = 8**-0.5
    sharded = jax.jit(
        jax.shard_map(
            lambda q, k, v, pos: ring.ulysses_attention(
                q, k, v, pos, pos, axis_name="seq", scale=scale
            ),
            mesh=mesh,
            in_specs=(P("stage", "seq"), SEQ, SEQ, SEQ),
            out_specs=P("stage", "seq"),
        )
    )
    q, k, v, _ = _case(5, b=2, length=16, n=4, kh=2, h=8)
    partition = ring.zigzag(16, 4)
    pos = np.asarray(ring.device_positions(partition)[None], np.int32)
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))  # noqa: E731
    args = (
        put(ring.to_device_order(q, partition), P("stage", "seq")),
        put(ring.to_device_order(k[:1], partition), SEQ),
        put(ring.to_device_order(v[:1], partition), SEQ),
        put(pos, SEQ),
    )
    jaxpr = jax.make_jaxpr(sharded)(*args).jaxpr
    assert _count(jaxpr, "all_to_all") == 4 and _count(jaxpr, "ppermute") == 0
    o = ring.from_device_order(np.asarray(sharded(*args)), partition)
    natural = np.arange(16)[None].repeat(2, 0)
    o_ref, _ = dense_attention(
        q, np.repeat(k[:1], 2, 0), np.repeat(v[:1], 2, 0), natural, natural, scale
    )
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("c,n,kh", [(2, 4, 2), (4, 8, 2)], ids=str)
def test_fused_path_in_position_order(c, n, kh):
    """With the partition's order given, the gathered sequence is attended in position
    order by `prompt_attention` (here its "xla" implementation; cuDNN's on GPUs): real
    rows as dense attention gives them, a shorter row's padding after its tokens."""
    length = 4 * c
    q, k, v, lengths = _case(
        30 + c, b=2, length=length, n=n, kh=kh, h=8, row_lengths=[length, length // 2 + 1]
    )
    partition = ring.zigzag(length, c)
    order = ring.device_positions(partition)
    pos = np.where(order[None] < lengths, order[None], -1).astype(np.int32)
    mesh = jax.make_mesh((c,), ("seq",), devices=jax.devices()[:c])
    fn = jax.jit(
        jax.shard_map(
            lambda q, k, v, p: ring.ulysses_attention(
                q, k, v, p, p, scale=0.3, fused_order=order, implementation="xla"
            ),
            mesh=mesh,
            in_specs=(SEQ,) * 4,
            out_specs=SEQ,
        )
    )
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, SEQ))  # noqa: E731
    o = fn(*(put(ring.to_device_order(x, partition)) for x in (q, k, v)), put(pos))
    o = ring.from_device_order(np.asarray(o), partition)
    natural = np.where(np.arange(length)[None] < lengths, np.arange(length)[None], -1)
    o_ref, _ = dense_attention(q, k, v, natural, natural, 0.3)
    real = natural >= 0
    assert not real.all()
    np.testing.assert_allclose(o[real], o_ref[real], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="fused_order must order all"):
        jax.eval_shape(
            jax.shard_map(
                lambda q, k, v, p: ring.ulysses_attention(
                    q, k, v, p, p, scale=0.3, fused_order=order[:-1]
                ),
                mesh=mesh,
                in_specs=(SEQ,) * 4,
                out_specs=SEQ,
            ),
            *(put(ring.to_device_order(x, partition)) for x in (q, k, v)),
            put(pos),
        )
