"""The KV cache's pool beside the prefill and decode programs: its sizes, zeroed pools,
the rows' slot positions and block tables placed on the mesh, abstract shapes for
compiling ahead.

    cache   k and v [L_pad, pages, K', C bs, H] (`Engine.pool_shape`), with the rows'
            pos [B, S_cap] and table [B, n] (`model.cache`), sharded as
            `stage.CACHE_SPECS`

Which pages a row holds is decided on the host, by the books (`pipeline.batch.rowbook`,
`pipeline.batch.pages`, the prefix cache's `pipeline.batch.prefix`); no K/V is ever
copied between pages: a row move is a table move, a prefix-cache hit a shared page.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.programs.stage import CACHE_SPECS
from qwen3_spmd.pipeline.runtime.registry import JitTable
from qwen3_spmd.ring.pages import identity_table
from qwen3_spmd.sharding.specs import SPECS, replica_of


class Copies:
    """The pool's sizes and programs on one mesh.

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
        self.jitted = JitTable()  # ("zeros", shape)

    # ---- sizes ------------------------------------------------------------------------

    def page_bytes_per_device(self) -> int:
        """Bytes of one page (k and v, every layer) on each device of its replica."""
        replica = self.mesh.devices.size // self.mesh.shape["data"]
        return 2 * math.prod(self.pool_shape(1)) * self.dtype.itemsize // replica

    def cache_bytes_per_device(self, B: int) -> int:
        """Bytes on each device of a pool that gives B rows their most pages (B/D rows
        on each replica)."""
        return B * self.n // self.mesh.shape["data"] * self.page_bytes_per_device()

    # ---- made -------------------------------------------------------------------------

    def placed(self, x: np.ndarray, spec) -> jax.Array:
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def empty_cache(self, B: int, pages: int | None = None) -> KVCache:
        """A zeroed pool of `pages` pages for B rows that hold nothing (every slot
        position -1). pages None: B n, each row its own n pages (an identity table: a
        prefill's or a draft model's own cache); else every table entry past the pool,
        for the row book to fill."""
        table = identity_table(B, self.n) if pages is None else np.full((B, self.n), pages)
        pages = B * self.n if pages is None else pages
        zeros = self._zeros(self.pool_shape(pages))
        empty = np.full((B, self.C, self.slots_per_device), -1, np.int32)
        return KVCache(zeros(), zeros(), self._slot_pos(empty), self._table(table, pages))

    def with_rows(self, cache: KVCache, slot_pos: np.ndarray, table=None) -> KVCache:
        """cache with its rows' slot positions replaced by the host's slot_pos
        [B, C, S_loc], and their block tables by `table` [B, n] (None: kept)."""
        cache = cache._replace(pos=self._slot_pos(slot_pos))
        if table is None:
            return cache
        return cache._replace(table=self._table(table, cache.k.shape[1]))

    def _slot_pos(self, slot_pos: np.ndarray) -> jax.Array:
        return self.placed(slot_pos.reshape(slot_pos.shape[0], -1), SPECS.slots_bs)

    def _table(self, table: np.ndarray, pages: int) -> jax.Array:
        """Rows' tables [B, n] of the pool's page numbers (`pages` past the pool: none),
        placed with the rows: on replica d (rows d B/D ..) less its first page d P/D, as
        its devices hold its pages, and P/D where none."""
        D = self.mesh.shape["data"]
        table = np.asarray(table, np.int32)
        first = (replica_of(np.arange(len(table)), len(table), D) * (pages // D))[:, None]
        local = np.where(table < pages, table - first, pages // D).astype(np.int32)
        return self.placed(local, SPECS.rows)

    def _zeros(self, shape: tuple):
        """The jitted maker of zeros of `shape`, sharded as the cache's k."""
        return self.jitted.get(
            ("zeros", shape),
            lambda: jax.jit(
                lambda: jnp.zeros(shape, self.dtype),
                out_shardings=NamedSharding(self.mesh, SPECS.cache_lbksh),
            ),
        )

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
