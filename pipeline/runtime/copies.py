"""The KV cache's device programs besides prefill and decode: zeroed caches and pools,
rows written in and moved, and the prefix cache's blocks copied between a row and the
pool.

Each is jitted once per shape with its destination donated, so XLA writes the rows or
blocks it changes into the destination's own buffers. What to copy where is decided on
the host, by the books (`pipeline.batch.rowbook` for rows, `pipeline.batch.prefix` for blocks);
this module only carries it out.

    cache   k and v [L_pad, B, K', S_cap, H] (`Engine.cache_shape`), pos [B, S_cap],
            sharded as `stage.CACHE_SPECS`
    pool    k and v [L_pad, slots, K', C*n, H], sharded as the cache's k and v: each
            `seq` device holds the same n local slots of a block in a row and in the
            pool, so no copy moves a byte between devices
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.programs.layout import bucket
from qwen3_spmd.pipeline.programs.stage import CACHE_SPECS
from qwen3_spmd.pipeline.runtime.registry import JitTable
from qwen3_spmd.sharding.specs import SPECS


class BlockPool(NamedTuple):
    """The prefix cache's pool: k and v, [L_pad, slots, K', C*n, H] each, sharded as the
    cache."""

    k: jax.Array
    v: jax.Array


def put_rows(cache: KVCache, new: KVCache, rows) -> KVCache:
    """Row r of `new` into row rows[r] of `cache` (past the rows: dropped)."""
    k = cache.k.at[:, rows].set(new.k, mode="drop")
    v = cache.v.at[:, rows].set(new.v, mode="drop")
    return KVCache(k, v, cache.pos)


def move_rows(cache: KVCache, src, dst) -> KVCache:
    """Row src[i] of `cache` into row dst[i] (past the rows: dropped)."""
    k = cache.k.at[:, dst].set(cache.k[:, src], mode="drop")
    v = cache.v.at[:, dst].set(cache.v[:, src], mode="drop")
    return KVCache(k, v, cache.pos)


def copy_blocks(dst, src, count, dst_at, src_at, src_slots):
    """dst with `count` blocks of src copied in, inside the shard_map (local arrays
    [L_s, rows or slots, K_l, local slots, H]): block i is src[:, src_at[i], :,
    src_slots[i], :] (its n local slots, in order) into dst[:, dst_at[i, 0], :,
    dst_at[i, 1] : +n]. dst_at: [most, 2], src_at: [most], src_slots: [most, n] int32;
    count <= most."""

    def one(i, d):
        L, _, K, S, H = src.shape
        rows = lax.dynamic_slice(src, (0, src_at[i], 0, 0, 0), (L, 1, K, S, H))
        piece = jnp.take(rows, src_slots[i], axis=3)
        return lax.dynamic_update_slice(d, piece, (0, dst_at[i, 0], 0, dst_at[i, 1], 0))

    return lax.fori_loop(0, count, one, dst)


class Copies:
    """The cache's and the pool's programs on one mesh.

    Args:
      mesh: the engine's ('stage', 'seq', 'tensor') mesh.
      dtype: the cache's dtype.
      cache_shape: B -> the shape of a cache of B rows' k (and v),
        [L_pad, B, K', S_cap, H].
    """

    def __init__(self, mesh: Mesh, dtype, cache_shape: Callable[[int], tuple[int, ...]]):
        self.mesh, self.dtype, self.cache_shape = mesh, jnp.dtype(dtype), cache_shape
        self.C = mesh.shape["seq"]
        self.slots_per_device = cache_shape(1)[3] // self.C
        self.jitted = JitTable()  # ("zeros", shape), ("insert", B), ("move", n), ...

    # ---- sizes ------------------------------------------------------------------------

    def cache_bytes_per_device(self, B: int) -> int:
        """Bytes of a KV cache of B rows (k and v) on each device."""
        return 2 * math.prod(self.cache_shape(B)) * self.dtype.itemsize // self.mesh.devices.size

    def pool_bytes_per_block(self, block: int) -> int:
        """Bytes of one pool block of `block` tokens (k and v) on each device."""
        L, _, K, _, H = self.cache_shape(1)
        return 2 * L * K * block * H * self.dtype.itemsize // self.mesh.devices.size

    # ---- made -------------------------------------------------------------------------

    def placed(self, x: np.ndarray, spec) -> jax.Array:
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def new_cache(self, B: int, slot_pos: np.ndarray) -> KVCache:
        """Zeroed k and v of B rows, with slot positions slot_pos [B, C, S_loc]."""
        zeros = self._zeros(self.cache_shape(B))
        return KVCache(zeros(), zeros(), self._slot_pos(slot_pos))

    def empty_cache(self, B: int) -> KVCache:
        """A cache of B rows that holds nothing (every slot position -1)."""
        return self.new_cache(B, np.full((B, self.C, self.slots_per_device), -1, np.int32))

    def with_slot_pos(self, cache: KVCache, slot_pos: np.ndarray) -> KVCache:
        """cache with its slot positions replaced by the host's slot_pos [B, C, S_loc]."""
        return cache._replace(pos=self._slot_pos(slot_pos))

    def _slot_pos(self, slot_pos: np.ndarray) -> jax.Array:
        return self.placed(slot_pos.reshape(slot_pos.shape[0], -1), SPECS.slots_bs)

    def empty_pool(self, slots: int, block: int) -> BlockPool:
        """A pool of `slots` prompt blocks of `block` tokens, zeroed, sharded as the
        cache: k and v [L_pad, slots, K', block, H] (each `seq` device its block / C
        slots of every block)."""
        L, _, K, _, H = self.cache_shape(1)
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

    # ---- rows -------------------------------------------------------------------------

    def insert(self, cache: KVCache, new: KVCache, rows: np.ndarray) -> KVCache:
        """cache (donated, updated in place) with k and v row r of `new` written into row
        rows[r] (rows[r] >= cache's B: row r is left out). Both caches have the same
        slots; the caller keeps the slot positions."""
        return self._insert_fn(new.k.shape[1])(cache, new, np.asarray(rows, np.int32))

    def _insert_fn(self, B: int):
        return self._in_place(("insert", B), put_rows)

    def move_rows(self, cache: KVCache, src: np.ndarray, dst: np.ndarray) -> KVCache:
        """cache (donated, updated in place) with the k and v of row src[i] copied into
        row dst[i], for src, dst [n] (padded to a power of two: few programs). The
        caller moves the slot positions."""
        n = bucket(len(src), 1)
        src = np.pad(np.asarray(src, np.int32), (0, n - len(src)))
        past = cache.k.shape[1]  # padding moves to past the rows: dropped
        dst = np.pad(np.asarray(dst, np.int32), (0, n - len(dst)), constant_values=past)
        return self._move_fn(n)(cache, src, dst)

    def _move_fn(self, n: int):
        return self._in_place(("move", n), move_rows)

    def _in_place(self, key: tuple, update):
        """update(cache, ...) -> KVCache, jitted once per key with the cache donated."""

        def make():
            spec = NamedSharding(self.mesh, SPECS.cache_lbksh)
            pos = NamedSharding(self.mesh, SPECS.slots_bs)
            return jax.jit(update, donate_argnums=0, out_shardings=KVCache(spec, spec, pos))

        return self.jitted.get(key, make)

    # ---- blocks -----------------------------------------------------------------------

    def save_blocks(self, pool: BlockPool, cache: KVCache, saves, slots=None) -> BlockPool:
        """pool (donated, updated in place) with, for each `pipeline.batch.prefix.Save`, block
        `block` of cache row `row` written into pool slot `slot`. slots: [len(saves), n]
        the local row slots each block's n pool slots take, in order (the same on every
        device); None: a prompt's block layout, block j at [j n, (j + 1) n)."""
        n = pool.k.shape[3] // self.C  # a block's local slots
        if slots is None:
            slots = [s.block * n + np.arange(n) for s in saves]
        at_pool = [(s.slot, 0) for s in saves]
        k, v = self._copy_blocks(pool, (cache.k, cache.v), at_pool, [s.row for s in saves], slots)
        return BlockPool(k, v)

    def load_blocks(self, cache: KVCache, pool: BlockPool, row: int, slots) -> KVCache:
        """cache (donated, updated in place) with pool slots[j] written into block j of
        row `row` (its slot positions are the caller's to set)."""
        n = pool.k.shape[3] // self.C
        at_row = [(row, j * n) for j in range(len(slots))]
        whole = [np.arange(n)] * len(slots)
        k, v = self._copy_blocks((cache.k, cache.v), pool, at_row, list(slots), whole)
        return cache._replace(k=k, v=v)

    def _copy_blocks(self, dst, src, dst_at, src_at, src_slots):
        """(k, v) of dst (donated) with blocks of src copied in (`copy_blocks`); the index
        lists are padded to the most blocks a row holds, so one program serves every
        count."""
        fn, most, n = self._copy_fn(dst[0].shape, src[0].shape)
        for i in range(0, len(dst_at), most):  # a round's saves may span several rows
            count = len(dst_at[i : i + most])
            pad = most - count
            at = np.array(list(dst_at[i : i + most]) + [(0, 0)] * pad, np.int32)
            rows = np.array(list(src_at[i : i + most]) + [0] * pad, np.int32)
            slots = np.zeros((most, n), np.int32)
            slots[:count] = np.asarray(src_slots[i : i + most], np.int32).reshape(count, n)
            dst = fn(*dst, *src, np.int32(count), at, rows, slots)
        return dst

    def _copy_fn(self, dst_shape: tuple, src_shape: tuple):
        """(the jitted copy between arrays of these shapes, the most blocks it copies at
        once: a row's, a block's local slots)."""
        n = min(src_shape[3], dst_shape[3]) // self.C  # a block's local slots: the pool's
        fn = self.jitted.get(("blocks", dst_shape, src_shape), self._copy_program)
        return fn, self.slots_per_device // n, n

    def _copy_program(self):
        spec, one = SPECS.cache_lbksh, P()

        def local(dst_k, dst_v, src_k, src_v, count, dst_at, src_at, src_slots):
            return (
                copy_blocks(dst_k, src_k, count, dst_at, src_at, src_slots),
                copy_blocks(dst_v, src_v, count, dst_at, src_at, src_slots),
            )

        mapped = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(spec, spec, spec, spec, one, one, one, one),
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

    def abstract_cache(self, B: int) -> KVCache:
        kv = jax.ShapeDtypeStruct(self.cache_shape(B), self.dtype)
        pos = jax.ShapeDtypeStruct((B, self.slots_per_device * self.C), jnp.int32)
        return self.abstract(KVCache(kv, kv, pos), CACHE_SPECS)

    def compile_new(self, B: int, new: KVCache, cache_rows: int) -> None:
        """Compiles the zeros of a new cache of B rows and the insert of such a cache
        (`new`, abstract) into a cache of `cache_rows` rows."""
        self._zeros(self.cache_shape(B)).lower().compile()
        self.compile_insert(new, cache_rows)

    def compile_insert(self, new: KVCache, cache_rows: int) -> None:
        """Compiles the insert of `new` (abstract) into a cache of `cache_rows` rows."""
        rows = jax.ShapeDtypeStruct((new.k.shape[1],), jnp.int32)
        self._insert_fn(new.k.shape[1]).lower(self.abstract_cache(cache_rows), new, rows).compile()

    def compile_copy(self, pool: BlockPool, cache_rows: int, into_pool: bool) -> None:
        """Compiles, unless compiled, the block copy between `pool` and a cache of
        `cache_rows` rows: into the pool (`save_blocks`) or out of it (`load_blocks`)."""
        cache = self.abstract_cache(cache_rows)
        pool = self.abstract(tuple(pool), (SPECS.cache_lbksh,) * 2)
        dst, src = (pool, (cache.k, cache.v)) if into_pool else ((cache.k, cache.v), pool)
        fn, most, n = self._copy_fn(dst[0].shape, src[0].shape)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        fn.lower(*dst, *src, i32(), i32(most, 2), i32(most), i32(most, n)).compile()

    def compile_move(self, n: int, cache_rows: int) -> None:
        """Compiles, unless compiled, `move_rows` of n (a power of two) rows."""
        rows = jax.ShapeDtypeStruct((n,), jnp.int32)
        self._move_fn(n).lower(self.abstract_cache(cache_rows), rows, rows).compile()
