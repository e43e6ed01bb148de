"""The page book: which pages of the KV pool are free, and how many rows hold each.

The pool is `pages` pages on every device (`ring.pages`); a row's block table names
the ones it holds. A page is held by one row, or (a prefix cache's block,
`pipeline.batch.prefix`) by several that read it; when no row holds it any more it is
free, unless the prefix cache keeps it, in which case it stays as it is until a row
needs a page and none is free (then the cache gives up its least recently used block).
Pages are handed out lowest first and taken back in any order, so every process of a
job that applies the same takes and gives holds the same tables. With `data` replicas
the pool is theirs in equal ranges (replica d the pages d P/D .. (d+1) P/D - 1, its own
devices' pages), and a row takes pages of its replica's range only (and the prefix
cache gives up that replica's blocks for it).
"""

from __future__ import annotations

import heapq

import numpy as np

from qwen3_spmd.sharding.specs import replica_of


class PageBook:
    """`pages` pages, all free at first, in `replicas` equal ranges. cache: the prefix
    cache that keeps pages no row holds (`PrefixBook` sets it), None without one."""

    def __init__(self, pages: int, replicas: int = 1):
        if pages % replicas:
            raise ValueError(f"{pages} pages do not split equally over {replicas} replicas")
        self.pages, self.replicas = pages, replicas
        self.refs = np.zeros(pages, np.int32)  # [pages] rows that hold each page
        per = pages // replicas
        # one heap a replica: its pages no row holds nor the cache keeps
        self._heaps = [list(range(d * per, (d + 1) * per)) for d in range(replicas)]
        self.cache = None  # the prefix cache (`pipeline.batch.prefix.PrefixBook`)

    @property
    def free(self) -> int:
        """Pages a row can take: free ones, and those the prefix cache keeps for no row
        (it gives them up when asked)."""
        return sum(self.free_in(d) for d in range(self.replicas))

    def free_in(self, replica: int) -> int:
        """Pages a row of `replica` can take."""
        kept = self.cache.idle_in(replica) if self.cache is not None else 0
        return len(self._heaps[replica]) + kept

    def replica(self, page: int) -> int:
        """The replica whose devices hold `page`."""
        return replica_of(page, self.pages, self.replicas)

    @property
    def used(self) -> int:
        """Pages some row holds."""
        return self.pages - self.free

    def take(self, n: int, replica: int = 0) -> list[int]:
        """n pages for one row of `replica`, lowest free first, then the prefix cache's
        least recently used; a ValueError if fewer are there (the planner admits by free
        pages, so it never asks for more)."""
        if n > self.free_in(replica):
            raise ValueError(f"{n} pages asked for, {self.free_in(replica)} of {self.pages} free")
        heap = self._heaps[replica]
        while len(heap) < n:
            for p in self.cache.evict(replica):
                heapq.heappush(heap, p)
        taken = [heapq.heappop(heap) for _ in range(n)]
        self.refs[taken] = 1
        return taken

    def share(self, pages) -> None:
        """A row holds `pages` too (the prefix cache's, which keeps them)."""
        for p in pages:
            if self.refs[p] == 0:
                self.cache.busy(int(p))
            self.refs[p] += 1

    def give(self, pages) -> None:
        """A row lets `pages` go (in its table's order): a page no row holds any more is
        free, or kept by the prefix cache, the later pages first in its eviction order."""
        for p in reversed(list(pages)):
            if not 0 <= p < self.pages or self.refs[p] < 1:
                raise ValueError(f"page {p} is not one of the pool's {self.pages} held")
            self.refs[p] -= 1
            if self.refs[p]:
                continue
            if self.cache is not None and self.cache.keeps(int(p)):
                self.cache.idle(int(p))
            else:
                heapq.heappush(self._heaps[self.replica(p)], int(p))
