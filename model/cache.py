"""The KV cache: an immutable pytree passed from program to program.

    k, v: [L_pad, B, K, S_cap, H]   keys and values of every layer slot and cache slot,
                                    heads-major (ring.attention.heads_major: the layout
                                    attention reads without a copy)
    pos:  [B, S_cap] int32          the token position each slot holds, -1 = empty

Attention masks come from `pos` alone (a key is visible when 0 <= pos <= the query's
position), so the order slots are filled in (zigzag prompt shares, round-robin decode
slots) needs no special case. The prefill and decode programs take k and v as donated
arguments and return them, so XLA updates them in place; `pos` is written by the
engine (it is the same on every stage) and read by the decode program.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class KVCache(NamedTuple):
    k: jax.Array
    v: jax.Array
    pos: jax.Array
