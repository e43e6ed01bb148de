"""The KV cache's pages: where a row's local cache slots live in a device's pool.

Each device holds a pool of pages, k and v [*A, pages, K, bs, H]: a page is bs cache
slots of every KV head (heads-major inside a page), *A the leading axes a caller indexes
(a stage's layer slots). A row (a request's place in a batch) names its pages in a block
table, table [B, n] int32: the row's local slot s lives in page table[row, s // bs] at
offset s % bs. The table is the same on every `seq` device: each device holds its share
of a request's slots (`ring.decode_slot`) in the same page numbers of its own pool, so a
page on a mesh is bs slots on each of the C devices.

A table entry past the pool (>= pages) names no page: writes to it are dropped, and
reads clip to the last page (what they read is masked by the slot positions, -1 for a
slot that holds nothing).

Dimension letters: B rows, T tokens, n table entries a row, bs slots a page, K KV
heads, H head dim.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def page_size(pool: jax.Array) -> int:
    """bs: the slots a page of `pool` [*A, pages, K, bs, H] holds."""
    return pool.shape[-2]


def read_slots(pool: jax.Array, table, at: tuple = (), first=0, count: int | None = None):
    """Rows' slots from page first .. first + count - 1 of each row's table, as
    [B, K, count * bs, H] (the heads-major rows attention reads).

    Args:
      pool: [*A, pages, K, bs, H], read at leading indices `at` (len(A) of them, traced
        or not).
      table: [B, n] int32 page numbers.
      first: the first table entry read (traced or not); count: how many (default: all
        n from `first` = 0).
    """
    n = table.shape[1] if count is None else count
    ids = table if count is None else lax.dynamic_slice_in_dim(table, first, n, axis=1)
    ids = jnp.clip(ids, 0, pool.shape[-4] - 1)
    blocks = pool[(*at, ids)]  # [B, n, K, bs, H]: one gather
    B, _, K, bs, H = blocks.shape
    return blocks.transpose(0, 2, 1, 3, 4).reshape(B, K, n * bs, H)


def write_slots(pool: jax.Array, new: jax.Array, table, slots, ok, at: tuple = ()) -> jax.Array:
    """pool with new [B, T, K, H] written at each row's local slots slots [B, T] (through
    its table [B, n]) where ok [B, T] (broadcastable), at leading indices `at`. A slot
    not ok, or past its row's table, is dropped."""
    bs, n = page_size(pool), table.shape[1]
    blk = slots // bs
    page = jnp.take_along_axis(table, jnp.clip(blk, 0, n - 1), axis=1)
    page = jnp.where(ok & (blk < n), page, pool.shape[-4])  # past the pool: dropped
    index = (*at, page, slice(None), slots % bs)
    return pool.at[index].set(new.astype(pool.dtype), mode="drop")


def identity_table(B: int, n: int) -> np.ndarray:
    """A table giving row b the pages b n .. b n + n - 1: B rows over B n pages, each a
    contiguous row as a rows-layout cache is."""
    return np.arange(B * n, dtype=np.int32).reshape(B, n)


def as_rows(pool: np.ndarray, table: np.ndarray, C: int) -> np.ndarray:
    """A pool's rows as a cache of contiguous rows, on the host (for reading a cache,
    as tests and tools do): pool [L, pages, K, C bs, H] (the mesh's global array, each
    page bs slots on each of the C `seq` devices) through table [B, n] ->
    [L, B, K, C n bs, H], row b's global slot c n bs + s its local slot s on device c
    (zeros where its table names no page)."""
    L, P, K, CB, H = pool.shape
    B, n = table.shape
    bs = CB // C
    rows = np.asarray(pool)[:, np.clip(table, 0, P - 1)]  # [L, B, n, K, C bs, H]
    rows = np.where((table < P)[None, :, :, None, None, None], rows, 0)
    rows = rows.reshape(L, B, n, K, C, bs, H).transpose(0, 1, 3, 4, 2, 5, 6)
    return rows.reshape(L, B, K, C * n * bs, H)
