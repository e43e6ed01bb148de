"""Ulysses attention over the `seq` mesh axis: all-to-all swaps the sequence split for
a head split, each device attends over the whole sequence of its share of heads, and
a second all-to-all swaps back.

Inside `jax.shard_map` over `seq` (C devices), device c holds its T tokens of every
head. Then:

    1. all_to_all q [B, T, N, H] -> [B, C*T, N/C, H]: the whole sequence (device 0's
       tokens first, in the order each device holds them) of query heads
       [c*N/C, (c+1)*N/C); k and v likewise to the KV heads those query heads read;
       all_gather the positions [B, T] -> [B, C*T].
    2. causal attention of the N/C heads over the whole sequence, masked by positions
       (`ring.attention.partial_attention`), block pair by block pair: the sequence is
       cut into 2C blocks and a pair whose keys all lie after every query is skipped,
       so with the zigzag partition a device computes (2C)(2C+1)/2 pairs of N/C heads,
       the ring's 2C+1 pairs of N heads.
    3. all_to_all o [B, C*T, N/C, H] -> [B, T, N, H].

Step 2 may instead run one fused causal kernel (`ring.attention.prompt_attention`, cuDNN
on GPUs) when the caller passes the static order of its partition (`fused_order`): the
whole sequence is put in position order first, so causality by index is causality by
position.

The token order and the positions are untouched, so the caller's KV cache (each device
its own tokens' K/V) is the one the ring leaves.

Grouped-query heads (`head_split`): query head n reads KV head n // G (G = N/K). Each
device takes N/C consecutive query heads (C must divide N) and the KV heads they read,
in groups of g = gcd(G, N/C) query heads per KV head. When C divides K that is K/C
KV heads per device and nothing is repeated; when C > K, a KV head is sent to every
device whose query heads read it (C*N/(C*g) heads travel instead of K, counted in
`HeadSplit.kv_sent`).

Dimension letters: B batch, T local tokens, N query heads, K KV heads, H head dim,
G = N/K, C devices on `seq`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from qwen3_spmd.ops.varying import make_varying, varying_axes
from qwen3_spmd.ring.attention import (
    _any_visible,
    check_attention_shapes,
    check_axis,
    heads_major,
    partial_attention,
    prompt_attention,
)
from qwen3_spmd.ring.merge import merge


class HeadSplit(NamedTuple):
    """How N query heads and K KV heads are shared among C devices.

    q_heads: query heads per device, N/C (consecutive: device c has c*N/C ...).
    kv_heads: KV heads per device; local query head i reads local KV head
      i // (q_heads // kv_heads).
    kv_index: [C * kv_heads] the global KV head in each device's local slots, device 0
      first: what is gathered from [.., K, H] before the all-to-all.
    """

    q_heads: int
    kv_heads: int
    kv_index: tuple[int, ...]

    @property
    def kv_sent(self) -> int:
        """KV heads that travel (C * kv_heads); K when nothing is repeated."""
        return len(self.kv_index)

    @property
    def repeats(self) -> bool:
        """Whether some KV head travels to more than one device. (kv_index never
        decreases and names every KV head, so without repeats it is 0 .. K-1.)"""
        return len(set(self.kv_index)) != len(self.kv_index)


def head_split(n_heads: int, kv_heads: int, c: int) -> HeadSplit:
    """The Ulysses head split of N = n_heads query heads over K = kv_heads KV heads on
    C = c devices; a ValueError naming the numbers when no split serves them (C must
    divide N, and K must divide N)."""
    if c < 1 or kv_heads < 1 or n_heads % kv_heads:
        raise ValueError(
            f"ulysses: {n_heads} query heads over {kv_heads} KV heads on {c} "
            f"devices: need K >= 1 dividing N and C >= 1"
        )
    if n_heads % c:
        fits = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
        raise ValueError(
            f"ulysses: {n_heads} query heads cannot be shared equally by {c} seq devices; "
            f"use ring attention, or a seq size that divides {n_heads} "
            f"({', '.join(map(str, fits))})"
        )
    g, n_loc = n_heads // kv_heads, n_heads // c
    per_kv = math.gcd(g, n_loc)  # local query heads per local KV head
    kv_loc = n_loc // per_kv
    index = tuple((dev * n_loc + j * per_kv) // g for dev in range(c) for j in range(kv_loc))
    return HeadSplit(n_loc, kv_loc, index)


def _causal_blocks(q, k, v, q_pos, k_pos, scale, n_blocks: int, axes: frozenset):
    """Position-masked attention of q [B, P, n, H] over heads-major k, v [B, kv, P, H],
    cut into n_blocks query blocks and n_blocks key blocks; a (query block, key block)
    pair in which no query sees any key is skipped (`lax.cond`).

    Returns o [B, P, n, H] float32 and lse [B, P, n] float32 (-inf: no visible key)."""
    b, p, n, h = q.shape
    t = p // n_blocks

    def blocks(x, axis):  # [.., P, ..] -> [n_blocks, .., P / n_blocks, ..]
        shape = (*x.shape[:axis], n_blocks, t, *x.shape[axis + 1 :])
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    def join(x):  # [n_blocks, B, t, ..] -> [B, P, ..]
        return jnp.moveaxis(x, 0, 1).reshape(b, p, *x.shape[3:])

    kb, vb, kpb = blocks(k, 2), blocks(v, 2), blocks(k_pos, 1)

    def query_block(args):
        qi, qpi = args

        def step(carry, key_block):
            kk, vv, kp = key_block

            def compute(o, lse):
                return merge(o, lse, *partial_attention(qi, kk, vv, qpi, kp, scale))

            return lax.cond(_any_visible(qpi, kp), compute, lambda o, lse: (o, lse), *carry), None

        init = (
            make_varying(jnp.zeros((b, t, n, h), jnp.float32), axes),
            make_varying(jnp.full((b, t, n), -jnp.inf, jnp.float32), axes),
        )
        (o, lse), _ = lax.scan(step, init, (kb, vb, kpb))
        return o, lse

    o, lse = lax.map(query_block, (blocks(q, 1), blocks(q_pos, 1)))
    return join(o), join(lse)


def ulysses_attention(
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    axis_name: str = "seq",
    scale: float,
    with_lse: bool = False,
    fused_order: np.ndarray | None = None,
    implementation: str = "cudnn",
):
    """Causal attention over a sequence sharded along `axis_name`; call inside shard_map.

    Same contract as `ring.ring_attention`: every argument is the local shard of a
    sequence in partition order (`ring.partition.to_device_order`, sharded
    `P(None, axis_name)`), visibility comes from the positions alone, and inputs may
    also vary along other mesh axes. Only `axis_name` is communicated along.

    Args:
      q: [B, T, N, H] local queries, T even, C dividing N (`head_split`).
      k, v: [B, T, K, H] local keys and values (the same tokens as q).
      q_pos, k_pos: [B, T] int32 positions of the local queries and keys (-1: padding).
      axis_name: the mesh axis of the sequence split (C devices).
      scale: multiplier of the scores, usually H ** -0.5.
      with_lse: also return the log-sum-exp (one more all-to-all).
      fused_order: [C*T] the position each slot of the gathered sequence holds in
        partition order (`ring.partition.device_positions` of a partition without
        padding): attend with `prompt_attention` (`implementation`: "cudnn" or "xla")
        in that order. The caller guarantees that, in it, each request's tokens come
        first at positions 0, 1, ... and its padding after (rows of padding get some
        finite output); no lse then.

    Returns:
      o: [B, T, N, H] in q's dtype (0 on rows with no visible key); with with_lse also
      lse: [B, T, N] float32 (-inf on those rows).
    """
    check_attention_shapes("ulysses_attention", q, k, v, q_pos, k_pos)
    b, t, n, h = q.shape
    if k.shape[1] != t or t % 2:
        raise ValueError(
            f"ulysses_attention: local queries and keys must be the same even number of "
            f"tokens, got T={t} and S={k.shape[1]}; pad the sequence to a multiple of 2*C "
            f"with ring.partition.padded_length"
        )
    c = check_axis("ulysses_attention", axis_name)
    split = head_split(n, k.shape[2], c)
    axes = frozenset({axis_name}).union(*(varying_axes(x) for x in (q, k, v, q_pos, k_pos)))

    def to_heads(x):  # [B, T, C*m, ..] -> [B, C*T, m, ..]: the whole sequence, my heads
        return lax.all_to_all(x, axis_name, 2, 1, tiled=True) if c > 1 else x

    if split.repeats:
        index = jnp.asarray(split.kv_index, jnp.int32)
        k, v = jnp.take(k, index, axis=2), jnp.take(v, index, axis=2)
    q, k, v = (make_varying(to_heads(x), axes) for x in (q, k, v))
    if fused_order is not None:
        if with_lse or sorted(fused_order) != list(range(q.shape[1])):
            raise ValueError(
                f"ulysses_attention: fused_order must order all {q.shape[1]} gathered slots "
                f"(a partition without padding) and gives no lse"
            )
        natural = np.argsort(fused_order)  # natural[p]: the slot holding position p
        o = prompt_attention(
            *(jnp.take(x, natural, axis=1) for x in (q, k, v)),
            scale=scale,
            implementation=implementation,
        )
        return _swap_back(jnp.take(o, np.asarray(fused_order), axis=1), axis_name, c)
    pos = jnp.stack([q_pos, k_pos])
    if c > 1:
        pos = lax.all_gather(pos, axis_name, axis=2, tiled=True)  # [2, B, C*T]
    pos = make_varying(pos, axes)
    o, lse = _causal_blocks(q, heads_major(k), heads_major(v), pos[0], pos[1], scale, 2 * c, axes)
    o = _swap_back(o.astype(q.dtype), axis_name, c)
    return (o, _swap_back(lse, axis_name, c)) if with_lse else o


def _swap_back(x, axis_name: str, c: int):
    """[B, C*T, N/C, ..] -> [B, T, N, ..]: this device's tokens, every head."""
    return lax.all_to_all(x, axis_name, 1, 2, tiled=True) if c > 1 else x
