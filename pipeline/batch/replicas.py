"""Which `data` replica holds each row of the row book, and where a row sits in a program.

The book numbers its B rows interleaved: row b is replica b mod D's local row b // D.
A program's batch of n rows splits over `data` in equal blocks instead
(`sharding.specs.replica_of`): replica d's rows are d n/D .. (d + 1) n/D - 1, and a
program over fewer rows than the cache's reads, on each replica, the cache's first
local rows. So the book's first n rows (n a multiple of D) are every replica's first
n/D: the planner's "rows up to the highest busy one", its lowest-free-row admission
and its compaction work on every replica at once, and a decode chunk over n rows is
the book's first n in `program_order`. With D = 1 both orders are one.

    book row     b = i D + d          (replica d, local row i)
    program row  p = d n/D + i        (a batch of n rows, n/D a replica)
"""

from __future__ import annotations

import numpy as np


def replica(b, D: int):
    """The replica that holds book row b (an int or an array of them)."""
    return b % D


def program_order(n: int, D: int) -> np.ndarray:
    """[n] the book row at each row of a program over the book's first n rows."""
    p = np.arange(n)
    per = n // D
    return (p % per) * D + p // per


def to_program(x: np.ndarray, D: int) -> np.ndarray:
    """x [n, ...] in the book's order, in the program's."""
    return x if D == 1 else x[program_order(len(x), D)]


def to_book(x: np.ndarray, D: int) -> np.ndarray:
    """x [n, ...] in a program's order, in the book's."""
    if D == 1:
        return x
    out = np.empty_like(x)
    out[program_order(len(x), D)] = x
    return out


def positions(rows, D: int, B: int) -> list[int]:
    """Where each of the book's `rows` sits in a program batch of B rows (a prefill of
    those rows and padding): each replica's rows, in the order given, at the start of
    its block of B/D."""
    per, seen = B // D, [0] * D
    at = []
    for b in rows:
        d = replica(b, D)
        if seen[d] == per:
            raise ValueError(f"replica {d} takes more than its {per} rows of a batch of {B}")
        at.append(d * per + seen[d])
        seen[d] += 1
    return at
