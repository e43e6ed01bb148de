"""The KV cache's device programs besides prefill and decode: zeroed pools, and slots
copied between a row's pages and the prefix cache's pool.

Each is jitted once per shape with its destination donated, so XLA writes the slots it
changes into the destination's own buffers. What to copy where is decided on the host,
by the books (`pipeline.batch.rowbook` for rows and their pages, `pipeline.batch.prefix`
for blocks); this module only carries it out.

    cache   k and v [L_pad, pages, K', C bs, H] (`Engine.pool_shape`), with the rows'
            pos [B, S_cap] and table [B, n] (`model.cache`), sharded as
            `stage.CACHE_SPECS`
    pool    k and v [L_pad, slots, K', C*m, H], sharded as the cache's k and v: each
            `seq` device holds the same m local slots of a block in a row's pages and in
            the pool, so no copy moves a byte between devices
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.programs.layout import bucket
from qwen3_spmd.pipeline.programs.stage import CACHE_SPECS
from qwen3_spmd.pipeline.runtime.registry import JitTable
from qwen3_spmd.ring.pages import identity_table
from qwen3_spmd.sharding.specs import SPECS


class BlockPool(NamedTuple):
    """The prefix cache's pool: k and v, [L_pad, slots, K', C*m, H] each, sharded as the
    cache."""

    k: jax.Array
    v: jax.Array


def copy_slots(dst, src, dst_at, src_at):
    """dst with local slots of src copied in, inside the shard_map (local arrays
    [L_s, pages or pool slots, K_l, slots a page, H]): slot src_at[i] = (page, offset)
    into dst_at[i]; a dst page past dst's is dropped (padding). dst_at, src_at: [m, 2]
    int32."""
    piece = src[:, src_at[:, 0], :, src_at[:, 1], :]  # [m, L_s, K_l, H]
    return dst.at[:, dst_at[:, 0], :, dst_at[:, 1], :].set(piece, mode="drop")


class Copies:
    """The pools' programs on one mesh.

    Args:
      mesh: the engine's ('stage', 'seq', 'tensor') mesh.
      dtype: the cache's dtype.
      pool_shape: pages -> the shape of a pool of that many pages' k (and v),
        [L_pad, pages, K', C bs, H].
      n: table entries a row (its most pages: S_loc / bs).
    """

    def __init__(self, mesh: Mesh, dtype, pool_shape: Callable[[int], tuple[int, ...]], n: int):
        self.mesh, self.dtype, self.pool_shape = mesh, jnp.dtype(dtype), pool_shape
        self.C = mesh.shape["seq"]
        self.n = n
        self.block_size = pool_shape(1)[3] // self.C
        self.slots_per_device = n * self.block_size
        self.jitted = JitTable()  # ("zeros", shape), ("slots", dst, src, m)

    # ---- sizes ------------------------------------------------------------------------

    def page_bytes_per_device(self) -> int:
        """Bytes of one page (k and v, every layer) on each device."""
        return 2 * math.prod(self.pool_shape(1)) * self.dtype.itemsize // self.mesh.devices.size

    def cache_bytes_per_device(self, B: int) -> int:
        """Bytes on each device of a pool that gives B rows their most pages."""
        return B * self.n * self.page_bytes_per_device()

    def pool_bytes_per_block(self, block: int) -> int:
        """Bytes of one prefix-pool block of `block` tokens (k and v) on each device."""
        L, _, K, _, H = self.pool_shape(1)
        return 2 * L * K * block * H * self.dtype.itemsize // self.mesh.devices.size

    # ---- made -------------------------------------------------------------------------

    def placed(self, x: np.ndarray, spec) -> jax.Array:
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def empty_cache(self, B: int, pages: int | None = None) -> KVCache:
        """A zeroed pool of `pages` pages for B rows that hold nothing (every slot
        position -1). pages None: B n, each row its own n pages (an identity table: a
        prefill's or a draft model's own cache); else every table entry past the pool,
        for the row book to fill."""
        table = identity_table(B, self.n) if pages is None else np.full((B, self.n), pages)
        zeros = self._zeros(self.pool_shape(B * self.n if pages is None else pages))
        empty = np.full((B, self.C, self.slots_per_device), -1, np.int32)
        return KVCache(zeros(), zeros(), self._slot_pos(empty), self._table(table))

    def with_rows(self, cache: KVCache, slot_pos: np.ndarray, table=None) -> KVCache:
        """cache with its rows' slot positions replaced by the host's slot_pos
        [B, C, S_loc], and their block tables by `table` [B, n] (None: kept)."""
        cache = cache._replace(pos=self._slot_pos(slot_pos))
        return cache if table is None else cache._replace(table=self._table(table))

    def _slot_pos(self, slot_pos: np.ndarray) -> jax.Array:
        return self.placed(slot_pos.reshape(slot_pos.shape[0], -1), SPECS.slots_bs)

    def _table(self, table: np.ndarray) -> jax.Array:
        return self.placed(np.asarray(table, np.int32), SPECS.replicated)

    def empty_pool(self, slots: int, block: int) -> BlockPool:
        """A pool of `slots` prompt blocks of `block` tokens, zeroed, sharded as the
        cache: k and v [L_pad, slots, K', block, H] (each `seq` device its block / C
        slots of every block)."""
        L, _, K, _, H = self.pool_shape(1)
        zeros = self._zeros((L, slots, K, block, H))
        return BlockPool(zeros(), zeros())

    def _zeros(self, shape: tuple):
        """The jitted maker of zeros of `shape`, sharded as the cache's k."""
        return self.jitted.get(
            ("zeros", shape),
            lambda: jax.jit(
                lambda: jnp.zeros(shape, self.dtype),
                out_shardings=NamedSharding(self.mesh, SPECS.cache_lbksh),
            ),
        )

    # ---- blocks -----------------------------------------------------------------------

    def save_blocks(self, pool: BlockPool, cache: KVCache, saves, rows: list) -> BlockPool:
        """pool (donated, updated in place) with, for each `pipeline.batch.prefix.Save`,
        the cache's local slots rows[i] = (pages [m], offsets [m]) (the same on every
        device: a block's m local slots in order, `RowBook.slot_pages`) written into pool
        slot saves[i].slot."""
        m = pool.k.shape[3] // self.C
        dst = [np.stack([np.full(m, s.slot), np.arange(m)], 1) for s in saves]
        src = [np.stack(at, 1) for at in rows]
        k, v = self._copy((pool.k, pool.v), (cache.k, cache.v), dst, src)
        return BlockPool(k, v)

    def load_blocks(self, cache: KVCache, pool: BlockPool, slots, rows: list) -> KVCache:
        """cache (donated, updated in place) with pool slot slots[j] written into the local
        slots rows[j] = (pages [m], offsets [m]) of a row's pages (its slot positions are
        the caller's to set)."""
        m = pool.k.shape[3] // self.C
        src = [np.stack([np.full(m, s), np.arange(m)], 1) for s in slots]
        dst = [np.stack(at, 1) for at in rows]
        k, v = self._copy((cache.k, cache.v), (pool.k, pool.v), dst, src)
        return cache._replace(k=k, v=v)

    def _copy(self, dst, src, dst_at: list, src_at: list):
        """(k, v) of dst (donated) with src's slots src_at (a list of [m, 2] (page,
        offset) arrays) copied to dst_at, as one program over a power of two of slots
        (padding copies go past dst's pages: dropped)."""
        dst_at, src_at = np.concatenate(dst_at), np.concatenate(src_at)
        m = bucket(len(dst_at), 1)
        pad = ((0, m - len(dst_at)), (0, 0))
        dst_at = np.pad(dst_at, pad, constant_values=dst[0].shape[1]).astype(np.int32)
        src_at = np.pad(src_at, pad).astype(np.int32)
        return self._copy_fn(dst[0].shape, src[0].shape, m)(*dst, *src, dst_at, src_at)

    def _copy_fn(self, dst_shape: tuple, src_shape: tuple, m: int):
        """The jitted copy of m slots between arrays of these shapes."""
        return self.jitted.get(("slots", dst_shape, src_shape, m), self._copy_program)

    def _copy_program(self):
        spec, one = SPECS.cache_lbksh, P()

        def local(dst_k, dst_v, src_k, src_v, dst_at, src_at):
            return copy_slots(dst_k, src_k, dst_at, src_at), copy_slots(
                dst_v, src_v, dst_at, src_at
            )

        mapped = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(spec, spec, spec, spec, one, one),
            out_specs=(spec, spec),
        )
        return jax.jit(mapped, donate_argnums=(0, 1))

    # ---- compiling ahead (nothing runs) -----------------------------------------------

    def abstract(self, tree, specs):
        """Arrays' shapes, dtypes and shardings on the mesh, for lowering ahead."""
        return jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)
            ),
            tree,
            specs,
        )

    def abstract_cache(self, B: int, pages: int | None = None) -> KVCache:
        """A cache of B rows on a pool of `pages` pages (None: B n), abstract."""
        kv = jax.ShapeDtypeStruct(
            self.pool_shape(B * self.n if pages is None else pages), self.dtype
        )
        pos = jax.ShapeDtypeStruct((B, self.slots_per_device * self.C), jnp.int32)
        table = jax.ShapeDtypeStruct((B, self.n), jnp.int32)
        return self.abstract(KVCache(kv, kv, pos, table), CACHE_SPECS)

    def compile_zeros(self, pages: int) -> None:
        """Compiles the zeros of a pool of `pages` pages."""
        self._zeros(self.pool_shape(pages)).lower().compile()

    def compile_copy(self, pool: BlockPool, pages: int, blocks: int, into_pool: bool) -> None:
        """Compiles, unless compiled, the copy of up to `blocks` blocks between `pool` and
        a cache pool of `pages` pages: into the pool (`save_blocks`) or out of it
        (`load_blocks`)."""
        cache = jax.ShapeDtypeStruct(self.pool_shape(pages), self.dtype)
        spec = NamedSharding(self.mesh, SPECS.cache_lbksh)
        cache = jax.ShapeDtypeStruct(cache.shape, cache.dtype, sharding=spec)
        pool = self.abstract(tuple(pool), (SPECS.cache_lbksh,) * 2)
        dst, src = (pool, (cache, cache)) if into_pool else ((cache, cache), pool)
        m = bucket(blocks * (pool[0].shape[3] // self.C), 1)
        at = jax.ShapeDtypeStruct((m, 2), jnp.int32)
        self._copy_fn(dst[0].shape, src[0].shape, m).lower(*dst, *src, at, at).compile()
