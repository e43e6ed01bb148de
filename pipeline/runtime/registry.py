"""Compiled programs, each compiled once per shape.

A program is a jitted function of (weights, cache, inputs); its key is its shape record
(`Program`: `pipeline.runtime.shapes.PrefillShape`, `DecodeShape`, a speculative pass's
`VerifyShape` or `LoopShape`, each holding every static choice that shapes the program)
plus the shapes of its cache and inputs. The record names itself and builds its
function; the registry jits it only to compile it. A compile can start ahead on a background thread (XLA compiles
outside the GIL), overlapping another program's compile and run; the first call with
the same key collects it. Threads may ask for the same key at once (a server's rounds and
its background compiles): one compiles, the others wait for that compile, so no key is
ever compiled twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol

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
    mask_s: float = 0.0  # the host filling constrained rows' allowed tokens (and advancing them)


class Stopwatch:
    """Seconds since it started, less what `clock` counted as compiling meanwhile: a
    program's running time when its call may have compiled it first."""

    def __init__(self, clock: Clock):
        self.clock, self.t0, self.compiled = clock, time.perf_counter(), clock.compile_s

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 - (self.clock.compile_s - self.compiled)


class JitTable:
    """Jitted functions by key, each made the first time it is asked for: once, though
    threads ask at once (a server's rounds and its background compiles), since a second
    jitted function of the same key would compile again."""

    def __init__(self):
        self._fns: dict = {}
        self._lock = threading.Lock()

    def get(self, key, make: Callable) -> Callable:
        if key not in self._fns:
            with self._lock:
                if key not in self._fns:
                    self._fns[key] = make()
        return self._fns[key]

    def __getitem__(self, key) -> Callable:
        return self._fns[key]


class Program(Hashable, Protocol):
    """A program's shape record: frozen, hashable, holding every static choice that shapes
    the program, so equal records are one program (for arrays of equal shapes)."""

    def name(self) -> tuple:
        """Its static choices, readably (a progress bar's, a report's)."""

    def build(self, engine) -> Callable:
        """f(weights, cache, inputs) on `engine`'s model and mesh, not yet jitted."""


class Programs:
    """Compiled programs of one engine by (record, arrays' shapes); jit(record) -> its
    jitted function (`Engine.jitted`), made only to compile it."""

    def __init__(
        self, dtype, jit: Callable[[Program], Callable], on_compile: OnCompile | None = None
    ):
        self.dtype = jnp.dtype(dtype)
        self.jit = jit
        self.on_compile = on_compile or (lambda name: contextlib.nullcontext())
        self.compiled: dict[str, Callable] = {}  # readable name -> compiled program
        self._by_key: dict[tuple, Callable] = {}
        self._ahead: dict[tuple, Future] = {}  # compiling, or compiled ahead and not collected
        self._lock = threading.Lock()  # guards the two dicts above
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")

    @staticmethod
    def _key(program: Program, cache, inputs) -> tuple:
        shapes = ((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves((cache, inputs)))
        return (program, *shapes)

    def _build(self, program: Program, args):
        # float32 means float32: XLA may otherwise run its matmuls in TF32 on GPUs.
        precision = "highest" if self.dtype == jnp.float32 else "default"
        with jax.default_matmul_precision(precision):
            return self.jit(program).lower(*args).compile()

    def get(
        self, program: Program, weights, cache, inputs, announce: bool = True
    ) -> tuple[Callable, float]:
        """(`program` compiled for these arguments' shapes, seconds the caller waited for
        it). Compiles here unless compiled, or compiling on another thread (then waits
        for that compile). announce=False: no on_compile (a compile no request waits for)."""
        key = self._key(program, cache, inputs)
        with self._lock:
            if key in self._by_key:
                return self._by_key[key], 0.0
            pending = self._ahead.get(key)
            mine = pending is None
            if mine:  # this thread compiles it; others asking meanwhile wait on `pending`
                pending = self._ahead[key] = Future()
        shown = (cache.k.shape, inputs.tokens.shape)  # [L_pad, B, K, S_cap, H]; [B, P_pad] or [B]
        name = program.name()
        readable = f"{' '.join(map(str, name))} [{'; '.join('x'.join(map(str, s)) for s in shown)}]"
        t0 = time.perf_counter()
        with self.on_compile(readable) if announce else contextlib.nullcontext():
            if mine:
                try:
                    pending.set_result(self._build(program, (weights, cache, inputs)))
                except BaseException as e:
                    pending.set_exception(e)
            try:
                compiled = pending.result()  # re-raises what the compile raised
            except BaseException:
                with self._lock:  # a later call tries again
                    if self._ahead.get(key) is pending:
                        del self._ahead[key]
                raise
        with self._lock:
            self._by_key[key] = self.compiled[readable] = compiled
            self._ahead.pop(key, None)
        return compiled, time.perf_counter() - t0

    def ahead(self, program: Program, weights, cache, inputs) -> None:
        """Starts compiling `program` for these arguments (arrays, or ShapeDtypeStructs
        with shardings) in the background, unless it is compiled or compiling already."""
        key = self._key(program, cache, inputs)
        with self._lock:
            if key not in self._by_key and key not in self._ahead:
                self._ahead[key] = self._pool.submit(self._build, program, (weights, cache, inputs))

    @property
    def pending(self) -> int:
        """Compiles under way, or started ahead and not yet collected."""
        return len(self._ahead)
