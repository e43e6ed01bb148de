"""Block attention with positions, and ring attention over the `seq` mesh axis.

`block_attention` is exact softmax attention of a query block over a key block,
masked by positions (a key is visible iff 0 <= k_pos <= q_pos), returning the
partial result (o, lse) that `ring.merge.merge` combines. It is also plain dense
causal attention when given a whole sequence.

`ring_attention` runs inside `jax.shard_map` over the `seq` axis (C devices). Each
device keeps its queries and passes its K/V block around the ring:

    step i = 0 .. C-1: device c holds the K/V block that started on device (c - i) mod C
      1. ppermute the held block to device c+1 (not on the last step)
      2. attend the local queries over the held block, merge into (o, lse)

The send is issued before the compute so XLA can overlap the transfer with it.
Queries and each K/V block are split into two halves; a (query half, key half) pair
whose valid keys all lie after every query in the half is skipped with `lax.cond`.
With the zigzag partition the halves are exactly its two chunks and every device
computes 3 pairs of its own block and 2 of every other block (2C+1 in all); with the
contiguous partition device c computes 3 + 4c.

Dimension letters: B batch, T query tokens, S key slots, N query heads, K KV heads,
H head dim, G = N/K query heads per KV head, R = G*T score rows of one KV head,
C devices on the ring.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qwen3_spmd.ops.matmul import few_rows, turned_product
from qwen3_spmd.ops.varying import make_varying, varying_axes
from qwen3_spmd.ring.merge import finite_or_zero, merge


def check_attention_shapes(name: str, q, k, v, q_pos, k_pos, kv_heads_major: bool = False) -> None:
    """Raises ValueError naming the sizes unless the shapes below agree.

    q [B, T, N, H], k and v [B, S, K, H] (kv_heads_major: [B, K, S, H]) with K dividing
    N, q_pos [B, T] and k_pos [B, S] of an integer dtype.
    """
    kv = "[B, K, S, H]" if kv_heads_major else "[B, S, K, H]"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{name}: q, k, v must be [B, T, N, H], {kv}, {kv}; "
            f"got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v shapes differ: {k.shape} vs {v.shape}")
    (b, t, n, h), (bk, s, kh, hk) = q.shape, k.shape
    if kv_heads_major:
        s, kh = kh, s
    if b != bk or h != hk:
        raise ValueError(
            f"{name}: q [B={b}, T={t}, N={n}, H={h}] and k [B={bk}, S={s}, K={kh}, H={hk}] "
            f"disagree on batch or head dim"
        )
    if kh == 0 or n % kh:
        raise ValueError(f"{name}: {n} query heads are not a multiple of {kh} KV heads")
    if q_pos.shape != (b, t) or k_pos.shape != (b, s):
        raise ValueError(
            f"{name}: positions must be q_pos [{b}, {t}] and k_pos [{b}, {s}]; "
            f"got {q_pos.shape} and {k_pos.shape}"
        )
    if not (jnp.issubdtype(q_pos.dtype, jnp.integer) and jnp.issubdtype(k_pos.dtype, jnp.integer)):
        raise ValueError(f"{name}: positions must be integers, got {q_pos.dtype} and {k_pos.dtype}")


def check_axis(name: str, axis_name: str) -> int:
    """The size of `axis_name`, or a ValueError if no enclosing shard_map binds it."""
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"{name}: axis {axis_name!r} is not an axis of the enclosing shard_map mesh; "
            f"call it inside jax.shard_map over a mesh with a {axis_name!r} axis"
        ) from err


def heads_major(x: jax.Array) -> jax.Array:
    """Keys or values [B, S, K, H] -> [B, K, S, H], the layout attention reads.

    XLA's CPU dot wants each KV head's [S, H] keys and values contiguous: given
    [B, S, K, H] it copies (transposes) them on every call, which for a decode step is
    the whole cache of the layer."""
    return jnp.swapaxes(x, 1, 2)


# Queries per score block. A long block's scores [B, K, G, T, S] would be written and
# re-read from memory several times (max, exp, sum, the second einsum); cut into query
# chunks of this size they stay in cache, which is faster and needs a fraction of the
# temporaries.
Q_CHUNK = 128


def partial_attention(q, k, v, q_pos, k_pos, scale):
    """`block_attention` without the shape checks, o left in float32, k and v
    heads-major [B, K, S, H].

    Partial results are merged in float32 so a bfloat16 o is rounded only once. Query
    rows are independent, so a long query block runs as a `lax.map` over Q_CHUNK-row
    chunks with the same result.
    """
    t = q.shape[1]
    if t <= Q_CHUNK or t % Q_CHUNK:
        return _scores_attention(q, k, v, q_pos, k_pos, scale)
    chunks = t // Q_CHUNK

    def split(x):  # [B, T, ...] -> [T / Q_CHUNK, B, Q_CHUNK, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], chunks, Q_CHUNK, *x.shape[2:]), 1, 0)

    def join(x):  # the inverse
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], t, *x.shape[3:])

    o, lse = lax.map(
        lambda c: _scores_attention(c[0], k, v, c[1], k_pos, scale), (split(q), split(q_pos))
    )
    return join(o), join(lse)


def _scores(qr, k):
    """qr [B, K, R, H] against k [B, K, S, H] -> scores [B, K, R, S] float32 (decode's
    few rows as k @ q^T on CPU: `ops.matmul`)."""
    if few_rows(qr.shape[2]):
        return turned_product("BKSH,BKRH->BKSR", k, qr, preferred_element_type=jnp.float32)
    return jnp.einsum("BKRH,BKSH->BKRS", qr, k, preferred_element_type=jnp.float32)


def _scores_attention(q, k, v, q_pos, k_pos, scale):
    """partial_attention on one query block, its whole score matrix at once.

    The G query heads of a KV head and the T queries form one block of R = G*T rows, so
    both products are plain batched matmuls over (B, K) whose big operand (k, v
    [S, H]) is read in place."""
    b, t, n, h = q.shape
    kh = k.shape[1]
    g = n // kh
    qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    s = _scores(qr, k) * scale
    # Visibility from positions only; k_pos >= 0 with k_pos <= q_pos also rules out q_pos = -1.
    visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    s = jnp.where(jnp.tile(visible, (1, g, 1))[:, None], s, -jnp.inf)  # row r = g*T + t
    m = finite_or_zero(jnp.max(s, axis=-1))  # [B, K, R]; 0 on fully masked rows
    p = jnp.exp(s - m[..., None])  # masked scores give exactly 0
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("BKRS,BKSH->BKRH", p, v.astype(jnp.float32))
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = m + jnp.log(l)  # log(0) = -inf on fully masked rows

    def by_query(x):  # [B, K, G*T, ...] -> [B, T, N, ...]
        x = x.reshape(b, kh, g, t, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1).reshape(b, t, n, *x.shape[4:])

    return by_query(o), by_query(lse)


def block_attention(q, k, v, q_pos, k_pos, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of a query block over a key block, masked by positions.

    Query head n uses KV head n // G (grouped-query attention, G = N/K).

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values.
      q_pos: [B, T] int32 query positions (-1: padding).
      k_pos: [B, S] int32 key positions (-1: padding or empty slot).
      scale: multiplier of the scores, usually H ** -0.5.

    Returns:
      o: [B, T, N, H] in q's dtype; 0 on rows with no visible key.
      lse: [B, T, N] float32 log-sum-exp of the visible scores; -inf on those rows.
    """
    check_attention_shapes("block_attention", q, k, v, q_pos, k_pos)
    o, lse = partial_attention(q, heads_major(k), heads_major(v), q_pos, k_pos, scale)
    return o.astype(q.dtype), lse


def fused_attention_available(dtype, head_dim: int) -> bool:
    """Whether `prompt_attention` can use a fused kernel here: cuDNN's flash attention,
    which XLA offers on GPUs for 16-bit inputs and head dims up to 128 in steps of 8."""
    return (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 128
    )


def prompt_attention(q, k, v, *, scale: float, implementation: str = "cudnn"):
    """Causal attention of one device's whole prompt over itself (no ring), through
    `jax.nn.dot_product_attention`: one fused kernel where cuDNN runs it, so the
    [T, T] scores never reach memory.

    The prompt is laid out by position: row t holds position t, a shorter request's
    padding follows its tokens. Causality by slot index is then causality by position,
    and no real query sees a padding key; padding rows get some finite output, which
    nothing reads (`block_attention` gives them 0).

    Args:
      q: [B, T, N, H]; k, v: [B, T, K, H] with N a multiple of K.
      implementation: "cudnn" (needs `fused_attention_available`) or "xla".
    Returns:
      o: [B, T, N, H] in q's dtype.
    """
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation=implementation
    )


class RingCarry(NamedTuple):
    """State carried from one ring step to the next (all local to one device)."""

    o: jax.Array  # [B, T, N, H] float32: local queries' output merged so far
    lse: jax.Array  # [B, T, N] float32
    k_blk: jax.Array  # [B, K, S, H] the K block held at this step (heads-major)
    v_blk: jax.Array  # [B, K, S, H]
    pos_blk: jax.Array  # [B, S] int32 positions of the held block
    blocks: jax.Array  # [1] int32: (query half, key half) pairs computed so far


def _any_visible(q_pos, k_pos):
    """Whether some query in q_pos [B, T] can see some key in k_pos [B, S]."""
    first_key = jnp.min(jnp.where(k_pos >= 0, k_pos, jnp.iinfo(jnp.int32).max))
    return first_key <= jnp.max(q_pos)


def _attend_pair(o, lse, blocks, q, q_pos, k, v, k_pos, scale):
    """Merges q's attention over one key half into (o, lse) and counts it in
    `blocks`, or skips it (`lax.cond`) when no query of q can see any of the keys."""

    def compute(o, lse, blocks):
        o, lse = merge(o, lse, *partial_attention(q, k, v, q_pos, k_pos, scale))
        return o, lse, blocks + 1

    return lax.cond(_any_visible(q_pos, k_pos), compute, lambda *skipped: skipped, o, lse, blocks)


def _attend_halves(q, q_pos, carry: RingCarry, scale) -> RingCarry:
    """Merges the local queries' attention over the held block into the carry, one
    (query half, key half) pair at a time."""
    tq, sk = q.shape[1] // 2, carry.k_blk.shape[2] // 2
    blocks = carry.blocks
    o_halves, lse_halves = [], []
    for qs in (slice(0, tq), slice(tq, None)):
        o, lse = carry.o[:, qs], carry.lse[:, qs]
        for ks in (slice(0, sk), slice(sk, None)):
            k, v, k_pos = carry.k_blk[:, :, ks], carry.v_blk[:, :, ks], carry.pos_blk[:, ks]
            o, lse, blocks = _attend_pair(
                o, lse, blocks, q[:, qs], q_pos[:, qs], k, v, k_pos, scale
            )
        o_halves.append(o)
        lse_halves.append(lse)
    return carry._replace(
        o=jnp.concatenate(o_halves, axis=1),
        lse=jnp.concatenate(lse_halves, axis=1),
        blocks=blocks,
    )


def ring_attention(
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    axis_name: str = "seq",
    scale: float,
    count_blocks: bool = False,
):
    """Causal attention over a sequence sharded along `axis_name`; call inside shard_map.

    Every argument is the local shard of a sequence laid out in partition order
    (`ring.partition.to_device_order`, sharded `P(None, axis_name)`). The positions
    decide visibility, so any partition (contiguous, zigzag) and padding (-1) work.
    Only `axis_name` is communicated along; inputs may also vary along other mesh
    axes (e.g. 'stage'), and the results then vary along the union of them.

    Args:
      q: [B, T, N, H] local queries, T even.
      k, v: [B, S, K, H] local keys and values, S even.
      q_pos: [B, T] int32 positions of the local queries (-1: padding).
      k_pos: [B, S] int32 positions of the local keys (-1: padding).
      axis_name: the mesh axis of the ring (C devices).
      scale: multiplier of the scores, usually H ** -0.5.
      count_blocks: also return how many (query half, key half) pairs this device
        computed, out of 4C.

    Returns:
      o: [B, T, N, H] in q's dtype; lse: [B, T, N] float32 (-inf: no visible key);
      with count_blocks, also blocks: [1] int32 (out_specs P(axis_name) gives [C]).
    """
    check_attention_shapes("ring_attention", q, k, v, q_pos, k_pos)
    if q.shape[1] % 2 or k.shape[1] % 2:
        raise ValueError(
            f"ring_attention: local T={q.shape[1]} queries and S={k.shape[1]} keys must be even "
            f"(each is split in halves); pad the sequence to a multiple of 2*C with "
            f"ring.partition.padded_length"
        )
    c = check_axis("ring_attention", axis_name)

    # The carry leaves each step varying along the ring axis and along whatever the
    # inputs vary along; scan and cond insist it enters with that same type.
    axes = frozenset({axis_name}).union(*(varying_axes(x) for x in (q, k, v, q_pos, k_pos)))
    q, k, v, q_pos, k_pos = (make_varying(x, axes) for x in (q, k, v, q_pos, k_pos))
    b, t, n, h = q.shape
    init = RingCarry(
        o=make_varying(jnp.zeros((b, t, n, h), jnp.float32), axes),
        lse=make_varying(jnp.full((b, t, n), -jnp.inf, jnp.float32), axes),
        k_blk=heads_major(k),
        v_blk=heads_major(v),
        pos_blk=k_pos,
        blocks=make_varying(jnp.zeros((1,), jnp.int32), axes),
    )
    perm = [(i, (i + 1) % c) for i in range(c)]

    def step(carry: RingCarry, _) -> tuple[RingCarry, None]:
        # Send the held block on first: XLA can overlap the transfer with the compute.
        k_next, v_next, pos_next = (
            lax.ppermute(x, axis_name, perm) for x in (carry.k_blk, carry.v_blk, carry.pos_blk)
        )
        carry = _attend_halves(q, q_pos, carry, scale)
        return carry._replace(k_blk=k_next, v_blk=v_next, pos_blk=pos_next), None

    carry, _ = lax.scan(step, init, length=c - 1)
    # The last block held needs no sending on.
    carry = _attend_halves(q, q_pos, carry, scale)
    o = carry.o.astype(q.dtype)
    return (o, carry.lse, carry.blocks) if count_blocks else (o, carry.lse)
