"""The KV cache: an immutable pytree passed from program to program.

    k, v:  [L_pad, pages, K, C bs, H]  each device's pool of pages (`ring.pages`): a
                                       page is bs cache slots on each `seq` device, of
                                       every layer slot and KV head, heads-major inside
    pos:   [B, S_cap] int32            the position each of a row's slots holds,
                                       -1 = empty (S_cap = C n bs)
    table: [B, n] int32                each row's pages: its local slot s lives in
                                       page table[row, s // bs] at s % bs

The rows are the program's (a prefill's batch, the decode rows); the pool is the
server's, one for all of them. Attention masks come from `pos` alone (a key is visible
when 0 <= pos <= the query's position), so the order slots are filled in (zigzag prompt
shares, round-robin decode slots) needs no special case. The programs take k and v as
donated arguments and return them, so XLA updates them in place; `pos` and `table` are
written by the host (the row book) and only read by the programs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class KVCache(NamedTuple):
    k: jax.Array
    v: jax.Array
    pos: jax.Array
    table: jax.Array
