"""Compiled programs, each compiled once per shape.

A program is a jitted function of (weights, cache, inputs); its key is a name that says
every static choice that shapes it (sampling, groups, chunk length) plus the shapes of
its cache and inputs. A compile can start ahead on a background thread (XLA compiles
outside the GIL), overlapping another program's compile and run; the first call with
the same key collects it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager

import jax
import jax.numpy as jnp

# on_compile(name) -> a context manager entered while that program compiles (a progress
# bar's spinner, say); called only when the caller has to wait for a compile.
OnCompile = Callable[[str], AbstractContextManager]


@dataclasses.dataclass
class Clock:
    """Seconds spent waiting for compiles and running programs (one generate call, or a
    scheduler's life)."""

    compile_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Programs:
    def __init__(self, dtype, on_compile: OnCompile | None = None):
        self.dtype = jnp.dtype(dtype)
        self.on_compile = on_compile or (lambda name: contextlib.nullcontext())
        self.compiled: dict[str, Callable] = {}  # readable name -> compiled program
        self._by_key: dict[tuple, Callable] = {}
        self._ahead: dict[tuple, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")

    @staticmethod
    def _key(name: tuple, weights, cache, inputs) -> tuple:
        return (*name, *((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves((cache, inputs))))

    def _build(self, fn, args):
        # float32 means float32: XLA may otherwise run its matmuls in TF32 on GPUs.
        precision = "highest" if self.dtype == jnp.float32 else "default"
        with jax.default_matmul_precision(precision):
            return fn.lower(*args).compile()

    def get(self, name: tuple, fn, weights, cache, inputs) -> tuple[Callable, float]:
        """(fn compiled for these arguments' shapes, seconds the caller waited for it)."""
        key = self._key(name, weights, cache, inputs)
        if key in self._by_key:
            return self._by_key[key], 0.0
        shown = (cache.k.shape, inputs.tokens.shape)  # [L_pad, B, K, S_cap, H]; [B, P_pad] or [B]
        readable = f"{' '.join(map(str, name))} [{'; '.join('x'.join(map(str, s)) for s in shown)}]"
        t0 = time.perf_counter()
        with self.on_compile(readable):
            ahead = self._ahead.pop(key, None)
            # result() re-raises whatever the background compile raised.
            compiled = (
                ahead.result() if ahead is not None else self._build(fn, (weights, cache, inputs))
            )
        self._by_key[key] = self.compiled[readable] = compiled
        return compiled, time.perf_counter() - t0

    def ahead(self, name: tuple, fn, weights, cache, inputs) -> None:
        """Starts compiling fn for these arguments (arrays, or ShapeDtypeStructs with
        shardings) in the background, unless it is compiled or compiling already."""
        key = self._key(name, weights, cache, inputs)
        if key not in self._by_key and key not in self._ahead:
            self._ahead[key] = self._pool.submit(self._build, fn, (weights, cache, inputs))

    @property
    def pending(self) -> int:
        """Compiles started ahead and not yet collected."""
        return len(self._ahead)
