"""Decode attention over a sequence-sharded, paged cache against dense attention over
the gathered cache, on 1, 4 and 8 emulated CPU devices, empty devices included.

A plain cache [B, K, S, H] is a pool of B pages of S slots, row b in page b (the table
`_rows_table`); the stacked test reads a pool of small pages in shuffled order."""

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
CACHE = P(None, None, "seq")  # a heads-major cache [B, K, S, H], slots along seq
SLOTS = 4  # cache slots per device


def _rows_table(b: int) -> np.ndarray:
    """Each row its own page: a plain cache [B, K, S, H] as a pool of B pages."""
    return np.arange(b, dtype=np.int32)[:, None]


@functools.cache
def _decode(c):
    """Jitted shard_map decode on c devices; o and lse come back stacked [C, ...]
    (one copy per device) so a test can see that every device holds the same."""

    def fn(q, k_cache, v_cache, q_pos, slot_pos):
        table = _rows_table(q.shape[0])
        o, lse = ring.decode_attention(
            q, k_cache, v_cache, q_pos, slot_pos, table=table, axis_name="seq", scale=0.25
        )
        return o[None], lse[None]

    mesh = jax.make_mesh((c,), ("seq",), devices=jax.devices()[:c])
    in_specs = (P(), CACHE, CACHE, P(), SEQ)
    return mesh, jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(P("seq"), P("seq")))
    )


def _case(seed, c, *, n=4, kh=2, h=8):
    """B=2, T=2 queries over a cache of 4C slots holding 3C positions, scattered.

    Device 1 holds nothing (for C > 1); query (0, 1) is padding and sees nothing on
    any device; the other queries see a prefix of the cached positions.
    """
    rng = np.random.default_rng(seed)
    b, t, s = 2, 2, SLOTS * c
    q = rng.standard_normal((b, t, n, h), dtype=np.float32)
    k, v = rng.standard_normal((2, b, s, kh, h), dtype=np.float32)
    filled = 3 * c
    usable = (
        np.array([d != 1 for d in range(c) for _ in range(SLOTS)]) if c > 1 else np.ones(s, bool)
    )
    slot_pos = np.full((b, s), -1, np.int32)
    for row in range(b):
        slots = rng.permutation(np.flatnonzero(usable))[:filled]
        slot_pos[row, slots] = np.arange(filled)
    q_pos = np.array([[filled - 1, -1], [filled // 2, filled - 1]], np.int32)
    return q, k, v, q_pos, slot_pos


def _run(c, q, k, v, q_pos, slot_pos, dtype=jnp.float32):
    mesh, fn = _decode(c)
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    o, lse = fn(
        put(jnp.asarray(q, dtype), P()),
        put(ring.heads_major(jnp.asarray(k, dtype)), CACHE),
        put(ring.heads_major(jnp.asarray(v, dtype)), CACHE),
        put(q_pos, P()),
        put(slot_pos, SEQ),
    )
    return np.asarray(o.astype(jnp.float32)), np.asarray(lse)


@pytest.mark.parametrize("c", [1, 4, 8])
def test_decode_matches_dense_over_gathered_cache(c):
    q, k, v, q_pos, slot_pos = _case(c, c)
    o, lse = _run(c, q, k, v, q_pos, slot_pos)
    o_ref, lse_ref = dense_attention(q, k, v, q_pos, slot_pos, 0.25)

    # Every device holds the same result, bit for bit.
    assert all(np.array_equal(o[0], o[d]) and np.array_equal(lse[0], lse[d]) for d in range(c))
    o, lse = o[0], lse[0]
    assert np.all(np.isfinite(o)) and not np.isnan(lse).any()
    assert np.all(np.isneginf(lse[0, 1])) and np.all(o[0, 1] == 0)  # the padding query
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=0)
    masked = np.isneginf(lse_ref)
    np.testing.assert_allclose(lse[~masked], lse_ref[~masked], atol=1e-5, rtol=0)


def test_decode_bfloat16():
    # Inputs rounded to bfloat16 first; the merge runs in float32, so the error is
    # o's final rounding: measured 3.2e-3 here (at most 3.2e-3 over seeds 0-7);
    # the bound is half a bfloat16 ulp at |o| < 4.
    c = 4
    q, k, v, q_pos, slot_pos = _case(7, c)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    o, _ = _run(c, q, k, v, q_pos, slot_pos, dtype=jnp.bfloat16)
    o_ref, _ = dense_attention(q, k, v, q_pos, slot_pos, 0.25)
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o[0], o_ref, atol=2**-7, rtol=0)


def test_decode_inside_stage_seq_mesh():
    """On a (stage, seq) mesh with q and the cache varying along stage and the slot
    positions not, decode type-checks and each stage matches dense attention."""
    mesh = jax.make_mesh((2, 4), ("stage", "seq"))

    def fn(q, k_cache, v_cache, q_pos, slot_pos):
        table = _rows_table(q.shape[0])
        return ring.decode_attention(
            q, k_cache, v_cache, q_pos, slot_pos, table=table, axis_name="seq", scale=0.25
        )

    in_specs = (P("stage"), P("stage", None, "seq"), P("stage", None, "seq"), P(), SEQ)
    sharded = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(P("stage"), P("stage")))
    )
    # Batch row b of q and of the cache goes to stage b; both stages share row 0's positions.
    q, k, v, q_pos, slot_pos = _case(3, 4)
    q_pos, slot_pos = q_pos[:1], slot_pos[:1]
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    cached = (q, ring.heads_major(k), ring.heads_major(v), q_pos, slot_pos)
    o, lse = sharded(*(put(x, spec) for x, spec in zip(cached, in_specs)))
    for stage in range(2):
        rows = slice(stage, stage + 1)
        o_ref, lse_ref = dense_attention(q[rows], k[rows], v[rows], q_pos, slot_pos, 0.25)
        np.testing.assert_allclose(np.asarray(o)[rows], o_ref, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)[rows]), np.isneginf(lse_ref))


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def test_decode_collectives_are_small_reductions():
    """No ppermute or gather: one pmax of lse and psums of (o, lse)-sized values."""
    c = 4
    mesh, fn = _decode(c)
    spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, p)
    )
    b, t, n, h, s = 2, 1, 4, 8, SLOTS * c
    jaxpr = jax.make_jaxpr(fn)(
        spec((b, t, n, h), jnp.float32, P()),
        spec((b, 2, s, h), jnp.float32, CACHE),
        spec((b, 2, s, h), jnp.float32, CACHE),
        spec((b, t), jnp.int32, P()),
        spec((b, s), jnp.int32, SEQ),
    ).jaxpr
    names = [eqn.primitive.name for eqn in _eqns(jaxpr)]
    for moving in (
        "ppermute",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "reduce_scatter",
    ):
        assert moving not in names
    reductions = [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name.startswith(("psum", "pmax"))]
    assert sorted(eqn.primitive.name for eqn in reductions) == [
        "pmax",
        "psum_invariant",
        "psum_invariant",
    ]
    for eqn in reductions:
        assert eqn.params["axes"] == ("seq",)
        assert all(x.aval.size <= b * t * n * h for x in eqn.invars)  # never the cache


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 3, "kh": 2}, "3 query heads are not a multiple of 2 KV heads"),
        ({"slots": 6}, r"k_pos \[2, 4\].*\(2, 3\)"),
        ({"axis_name": "sq"}, "axis 'sq' is not an axis"),
    ],
)
def test_decode_bad_input(kwargs, message):
    mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2])
    n, kh, slots = kwargs.get("n", 4), kwargs.get("kh", 2), kwargs.get("slots", 8)

    def fn(q, k_cache, v_cache, q_pos, slot_pos):
        return ring.decode_attention(
            q,
            k_cache,
            v_cache,
            q_pos,
            slot_pos,
            table=_rows_table(2),
            axis_name=kwargs.get("axis_name", "seq"),
            scale=1.0,
        )

    spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, p)
    )
    args = (
        spec((2, 1, n, 8), jnp.float32, P()),
        spec((2, kh, 8, 8), jnp.float32, CACHE),
        spec((2, kh, 8, 8), jnp.float32, CACHE),
        spec((2, 1), jnp.int32, P()),
        spec((2, slots), jnp.int32, SEQ),
    )
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(
            jax.shard_map(
                fn, mesh=mesh, in_specs=(P(), CACHE, CACHE, P(), SEQ), out_specs=(P(), P())
            ),
            *args,
        )


@pytest.mark.parametrize("c", [1, 4])
@pytest.mark.parametrize("filled", [0, 5, 8, 9, 10])
def test_decode_reads_only_the_filled_blocks_of_a_stacked_cache(c, filled, monkeypatch):
    """With blocks of 4 of a device's 10 slots, decode attention reads rows 1..2 of
    layer 1 of a stacked pool [L, pages, K, C bs, H] of pages of 2 slots (in shuffled
    order) block by block below `filled` (slots 8 and 9 as a last, shorter block). It matches dense attention over the slots below
    `filled`: the slots at or past it hold positions the queries could see, and are
    ignored. Whole blocks past `filled` hold NaN keys and values: on CPU they are never
    read."""
    from qwen3_spmd.ring import decode as ring_decode

    monkeypatch.setattr(ring_decode, "DECODE_BLOCK", 4)  # read when fn is traced below
    layers, rows, b, n, kh, h, s_loc = 2, 3, 2, 4, 2, 8, 10
    layer, row0 = 1, 1
    rng = np.random.default_rng(filled + 10 * c)
    q = rng.standard_normal((b, 1, n, h), dtype=np.float32)
    k, v = rng.standard_normal((2, layers, rows, c * s_loc, kh, h), dtype=np.float32)
    local = np.tile(np.arange(s_loc), c)  # local slot index of each global slot
    slot_pos = np.stack([rng.permutation(c * s_loc) for _ in range(b)]).astype(np.int32)
    slot_pos[1, rng.random(c * s_loc) < 0.2] = -1  # some empty slots
    q_pos = np.array([[c * s_loc], [c * s_loc // 2]], np.int32)
    unread = local >= min(-(-filled // 4) * 4, s_loc)
    k_in, v_in = k.copy(), v.copy()
    if jax.default_backend() == "cpu":  # elsewhere the cache is read in one pass
        k_in[:, :, unread] = v_in[:, :, unread] = np.nan
    assert unread.any() == (filled <= 8)

    mesh = jax.make_mesh((c,), ("seq",), devices=jax.devices()[:c])
    stacked = P(None, None, None, "seq")

    def fn(q, k_cache, v_cache, q_pos, slot_pos, table, filled):
        return ring.decode_attention(
            q,
            k_cache,
            v_cache,
            q_pos,
            slot_pos,
            table=table,
            axis_name="seq",
            scale=0.25,
            at=(layer,),
            filled=filled,
        )

    bs = 2
    perm = rng.permutation(rows * s_loc // bs).astype(np.int32)
    k_pool, table = _paged(np.swapaxes(k_in, 2, 3), c, bs, perm)
    v_pool, _ = _paged(np.swapaxes(v_in, 2, 3), c, bs, perm)
    in_specs = (P(), stacked, stacked, P(), SEQ, P(), P())
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(P(), P())))
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    group = slice(row0, row0 + b)
    args = (q, k_pool, v_pool, q_pos, slot_pos, table[group], np.int32(filled))
    o, lse = sharded(*(put(x, spec) for x, spec in zip(args, in_specs)))

    seen = np.where(local < filled, slot_pos, -1)
    o_ref, lse_ref = dense_attention(q, k[layer, group], v[layer, group], q_pos, seen, 0.25)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=0)
    finite = ~np.isneginf(lse_ref)
    np.testing.assert_allclose(np.asarray(lse)[finite], lse_ref[finite], atol=1e-5, rtol=0)
    assert filled > 0 or not np.asarray(o).any()


def _paged(x, c: int, bs: int, perm: np.ndarray):
    """A stacked rows cache x [L, R, K, C S, H] (each `seq` device its S local slots of
    a row) as a pool of pages of bs slots [L, R S / bs, K, C bs, H], page j of row r at
    perm[r n + j], and the rows' table [R, n]."""
    L, R, K, CS, H = x.shape
    n = CS // c // bs
    pages = x.reshape(L, R, K, c, n, bs, H).transpose(0, 1, 4, 2, 3, 5, 6)
    pool = np.empty_like(pages.reshape(L, R * n, K, c * bs, H))
    pool[:, perm] = pages.reshape(L, R * n, K, c * bs, H)
    return pool, perm.reshape(R, n)
