"""The page book: which pages of the KV pool are free.

The pool is `pages` pages on every device (`ring.pages`); a row's block table names
the ones it holds. Pages are handed out lowest first and taken back in any order, so
every process of a job that applies the same takes and gives holds the same table.
"""

from __future__ import annotations

import heapq


class PageBook:
    """`pages` pages, all free at first."""

    def __init__(self, pages: int):
        self.pages = pages
        self._free = list(range(pages))  # a heap

    @property
    def free(self) -> int:
        """Pages no row holds."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.pages - len(self._free)

    def take(self, n: int) -> list[int]:
        """n free pages, lowest first; a ValueError if fewer are free (the planner
        admits by free pages, so it never asks for more)."""
        if n > len(self._free):
            raise ValueError(f"{n} pages asked for, {len(self._free)} of {self.pages} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def give(self, pages) -> None:
        """Pages a row held, free again."""
        for p in pages:
            if not 0 <= p < self.pages:
                raise ValueError(f"page {p} is not one of the pool's {self.pages}")
            heapq.heappush(self._free, int(p))
