"""Continuous batching: requests join and leave the decode rows while the mesh runs.

A `Scheduler` owns `max_batch` decode rows (a multiple of the decode groups G, cut into
G round-robin groups as in `static_batch.generate`) and runs rounds over them. Each round has
three parts with one job each (vLLM v1's schedule / execute / update):

    plan     `pipeline.scheduling.planner.Planner.plan`: from the row book, the waiting requests
             and the cancellations to a `Round` (what to cancel, chunk, admit, move and
             decode, with every program's padded shape from `pipeline.runtime.shapes`);
    execute  `pipeline.scheduling.executor.Executor`: the round's programs on the engine (the
             prefills and their in-place K/V inserts, the decode chunk);
    update   the row book's methods (`pipeline.batch.rowbook`), the only writers of rows,
             slots and positions, retire what ended.

This module is the front: it takes requests and cancellations from callers' threads,
drives the rounds, and hands each request its tokens through its `Handle`. First tokens
go out before the round's decode chunk runs, so time to first token is the prefill's.

A round that raises ends the background loop: every request still open finishes with
"error", and later submits are refused with the error's message.

A request's tokens depend only on its prompt, its sampling parameters and its seed:
its sampling key is (seed, 0, step), as for a request alone in `static_batch.generate`, and
an empty or finished row writes nothing any other row reads.

Rounds run when a caller asks: `step()`, `run()`, or a blocking read of a handle. With
`start()` a background thread runs them whenever a request is in (what a server needs,
and what a handle's async stream needs); the state is guarded by one lock.

Several processes (`decisions=SharedDecisions()`): process 0 takes the requests, plans
each round and publishes the `Round` itself (`pipeline.scheduling.decisions`); every other process
calls `follow()`, which executes process 0's rounds until it closes. Followers never
plan.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable

from qwen3_spmd.pipeline.batch.handles import Handle, Params, Request
from qwen3_spmd.pipeline.batch.prefix import prefix_block
from qwen3_spmd.pipeline.batch.rowbook import RowBook, Update
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.runtime.registry import Clock
from qwen3_spmd.pipeline.runtime.shapes import RoundSettings, Shape, ShapeRules
from qwen3_spmd.pipeline.scheduling.decisions import SharedDecisions
from qwen3_spmd.pipeline.scheduling.executor import Executor
from qwen3_spmd.pipeline.scheduling.planner import Accounting, Planner, Round
from qwen3_spmd.pipeline.speculative.speculator import Speculator
from qwen3_spmd.pipeline.structured.constraints import Constraint, Grammars
from qwen3_spmd.sharding.mesh import MeshError

__all__ = ["QueueFull", "Scheduler", "Update"]


class QueueFull(RequestError):
    """The waiting queue holds max_queue requests: try again later."""


class Scheduler:
    """Admits, decodes and retires requests continuously over an Engine's mesh.

    Args:
      engine: the Engine (weights placed, programs compiled on first use). Its
        max_seq_len bounds every request's prompt + new tokens; its chunk is the long
        decode chunk.
      max_batch: decode rows of each `data` replica (vLLM's --max-num-seqs, per
        data-parallel rank; rounded up to a multiple of the decode groups): the book
        has D max_batch rows, dealt to the replicas in turn (`pipeline.batch.replicas`).
      prefill_tokens: prompt tokens prefilled per round at most, so a burst of prompts
        does not stall decoding; a longer prompt is prefilled in chunks of this many
        tokens (rounded down to a multiple of 2C), one a round.
      short_chunk: decode steps a round runs while requests wait for a row.
      max_queue: requests waiting for a row at most (beyond the rows free as of the
        last round); `submit` refuses more (QueueFull), and `submit_all` a group
        that does not fit whole.
      decisions: with several processes, how they share each round
        (`pipeline.scheduling.decisions.SharedDecisions`); None in a single process.
      prefix_caching: whether the K/V pages of requests' whole blocks stay named for
        later prompts that begin with the same tokens (`pipeline.batch.prefix`; its
        block is a page's tokens, and the chunk is rounded down to a multiple of it);
        never where no request could hit (max_seq_len under a block and two tokens).
      grammars: the grammar engine over the model's tokenizer
        (`pipeline.structured.constraints.Grammars`) for requests with a constraint (structured
        outputs); None: such requests are refused. Every process needs its own.
      speculator: speculative decoding (`pipeline.speculative.speculator.Speculator`):
        process 0's planner decides each round with its policy, every process's executor
        runs it; None: plain decoding.
      kv_cache_memory_bytes: each device's bytes for the pool of KV pages (vLLM's
        --kv-cache-memory-bytes), rounded down to whole pages; None: every row's most
        (max_seq_len a row, so no request ever waits for pages). kv_sizing: how those
        bytes were found, in words (`pipeline.scheduling.build.pool_size`), for
        `pool_line`. With D replicas the pool is D times a device's pages, P/D each.
    """

    def __init__(
        self,
        engine: Engine,
        max_batch: int,
        prefill_tokens: int = 4096,
        short_chunk: int | None = None,
        max_queue: int = 256,
        decisions: SharedDecisions | None = None,
        prefix_caching: bool = False,
        grammars: Grammars | None = None,
        speculator: Speculator | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_sizing: str = "",
    ):
        if max_batch < 1:
            raise RequestError(f"$max_batch {max_batch} must be at least 1", "max_batch")
        D = engine.D
        if D > 1 and speculator is not None:
            raise MeshError(
                f"speculative decoding runs one replica, and the mesh has {D} (`data`): "
                "leave --speculative-config out, or use D = 1"
            )
        self.engine = engine
        self.groups = engine.groups_for(engine.stages)
        self.B = D * -(-max_batch // self.groups) * self.groups
        two_c = 2 * engine.C
        chunk_tokens = max(two_c, prefill_tokens // two_c * two_c)
        block = prefix_block(engine.C, engine.block_size)
        # A hit needs a whole block before a prompt's last token and a token after it.
        # A pooling runner's prompts are prefilled whole, each once: no prefix cache.
        cached = prefix_caching and engine.max_seq_len >= block + 2 and not engine.pooling
        if cached:
            chunk_tokens = max(block, chunk_tokens // block * block)
        self.rules = ShapeRules(
            rows=self.B,
            groups=self.groups,
            microbatches=engine.M,
            C=engine.C,
            slots=engine.slots_per_device,
            max_seq_len=engine.max_seq_len,
            prefill_tokens=prefill_tokens,
            chunk_tokens=chunk_tokens,
            block=block if cached else None,
            decodes=not engine.pooling,
            replicas=D,
        )
        page_bytes = engine.copies.page_bytes_per_device()
        self.pages = self.B * engine.pages_per_row
        if kv_cache_memory_bytes is not None:  # (a replica's pages on each of its devices)
            self.pages = D * (kv_cache_memory_bytes // page_bytes)
            if self.pages < 1:
                raise RequestError(
                    f"$kv_cache_memory_bytes {kv_cache_memory_bytes} holds no page of KV "
                    f"cache ({page_bytes} bytes a device for {engine.block_size * engine.C} "
                    "tokens): raise it",
                    "kv_cache_memory_bytes",
                )
        self.book = RowBook(
            self.B,
            self.groups,
            engine.C,
            engine.slots_per_device,
            block_size=engine.block_size,
            pages=self.pages,
            prefix_block=block if cached else None,
            replicas=D,
        )
        self.prefix = self.book.prefix
        self.planner = Planner(
            self.rules,
            stages=engine.stages,
            short_chunk=short_chunk or max(1, engine.chunk // 4),
            long_chunk=engine.chunk,
            prefix=self.prefix,
            cp=lambda shape: engine.cp_plan(shape.B, shape.P_pad)[0],
            speculate=speculator.policy if speculator is not None else None,
        )
        self.accounting = Accounting()
        self.clock = Clock()
        self.executor = Executor(
            engine,
            self.book,
            self.accounting,
            self.clock,
            cache=engine.copies.empty_cache(self.B, self.pages),
            block_layout=self.rules.layout_block,
            grammars=grammars,
            speculator=speculator,
        )
        self.grammars = grammars
        self.kv_sizing = kv_sizing
        self.max_queue = max_queue
        self.rounds = 0
        self.most_running = 0  # the most requests a round has decoded at once
        # requests each `data` replica started (a preempted one again when it resumes)
        self.replica_starts = [0] * D
        self._ids = itertools.count()
        self._waiting: collections.deque[Request] = collections.deque()
        self._gone: set[int] = set()  # waiting requests the round being run cancels
        # Callers' threads and the rounds meet under _lock, held only for moments:
        # submits and cancels land in inboxes that the next round takes in. _round runs
        # one round at a time (on the background thread, or a caller's).
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Handle] = []
        self._cancels: set[Handle] = set()
        self._handles: dict[int, Handle] = {}  # every request not yet finished
        self._queued = 0  # waiting requests as of the last round, plus the inbox
        self._free_count = self.B  # free rows as of the last round: the inbox's first go there
        self._round = threading.Lock()
        self._loop: threading.Thread | None = None
        self._closing = False
        self.decisions = decisions
        self.follower = decisions is not None and not decisions.leader
        self.closed = False  # a follower saw process 0 close
        self.failure: Exception | None = None  # what ended the background loop
        self._compiler: threading.Thread | None = None  # compile_later's
        self.compiles_left = 0  # shapes compile_later has still to compile
        self._stop_compiling = threading.Event()
        self._compiled: set[Shape] = set()  # shapes compiled, or run by a round

    @property
    def speculator(self) -> Speculator | None:
        """Speculative decoding, None when off. Set between rounds (a benchmark trying
        drafters): the planner's policy and the executor change together."""
        return self.executor.speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        with self._round:
            self.executor.speculator = speculator
            self.planner.speculate = speculator.policy if speculator is not None else None

    @property
    def prefill_tokens(self) -> int:
        return self.rules.prefill_tokens

    @property
    def chunk_tokens(self) -> int:
        return self.rules.chunk_tokens

    @property
    def early_ends(self) -> int:
        return self.accounting.early_ends

    def decode_counts(self) -> tuple[int, int, int]:
        """(row-steps run, row-steps that gave a request a token, pipeline ticks)."""
        a = self.accounting
        return a.row_steps, a.busy_row_steps, a.decode_ticks

    def decode_use(self, since: tuple[int, int, int] = (0, 0, 0)) -> dict:
        """How well the decode rounds since `since` (decode_counts() then) used the
        mesh: row_occupancy, the share of row-steps that gave a request a token, and
        stage_idle_fraction, the share of the stages' work that gave none (pipeline
        bubbles, empty rows, steps past a row's end)."""
        rows, busy, ticks = (a - b for a, b in zip(self.decode_counts(), since))
        return {
            "row_occupancy": busy / rows if rows else 0.0,
            "stage_idle_fraction": 1 - self.groups * busy / (self.B * ticks) if ticks else 0.0,
        }

    @property
    def kv_bytes_per_device(self) -> int:
        """Bytes of the pool of KV pages each device holds (allocated once): its
        replica's pages."""
        return self.pages // self.engine.D * self.engine.copies.page_bytes_per_device()

    @property
    def kv_usage(self) -> float:
        """The share of the pool's pages the requests hold."""
        return self.book.pages.used / self.pages

    @property
    def preemptions(self) -> int:
        """Requests preempted when pages ran out (each prefilled again later)."""
        return self.executor.preemptions

    @property
    def kv_tokens(self) -> int:
        """Tokens the pool's pages hold (on all `seq` devices together)."""
        return self.pages * self.engine.block_size * self.engine.C

    def pool_line(self) -> str:
        """The pool at start-up, as vLLM says it: its pages, the tokens they hold, and
        how many requests of max_seq_len tokens fit at once."""
        eng = self.engine
        return (
            f"KV cache: {self.pages} pages of {eng.block_size * eng.C} tokens, "
            f"{self.kv_tokens:,} tokens ({self.kv_bytes_per_device / 2**30:.2f} GiB a device); "
            f"maximum concurrency for {eng.max_seq_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x ({self.B} rows)"
            + (f"; sized by {self.kv_sizing}" if self.kv_sizing else "")
        )

    @property
    def max_concurrency(self) -> float:
        """Requests of max_seq_len tokens the pool holds at once (vLLM's "Maximum
        concurrency"; the rows may allow fewer)."""
        return self.pages / self.engine.pages_per_row

    def precompile(
        self,
        shapes: list[Shape] | None = None,
        workers: int = 2,
        on_compiled: Callable[[], None] | None = None,
        announce: bool = True,
    ) -> int:
        """Compiles every program a round can run (`ShapeRules.programs`: each prefill
        batch and chunk, the decode chunk over each row count, with log-probabilities or
        without, the row moves), or those of `shapes`, so
        that no request waits for a compile while the running ones stall (what a server does
        at start-up). `workers` compiles run at once; on_compiled() after each shape;
        announce=False: the engine's on_compile is not called. Returns the number of
        shapes compiled (each with its helpers)."""
        if shapes is None:
            shapes = self.rules.declared().shapes()
        # XLA compiles outside the GIL: several at once use the host's cores.
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for done in [pool.submit(self._compile, s, announce) for s in shapes]:
                done.result()
                if on_compiled is not None:
                    on_compiled()
        return len(shapes)

    def compile_later(
        self,
        shapes: list[Shape],
        on_done: Callable[[int, float, list[str]], None] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """Compiles `shapes` on a background thread, one at a time in their order, while
        rounds run; then on_done(shapes compiled, seconds, errors). Meanwhile a round
        runs a compiled shape that does the same work where one is (`Planner.ready`);
        one that meets a shape no other can stand in for compiles it itself, or waits
        for the compile under way (`pipeline.runtime.registry`): never twice. Compiling runs no
        program and no collective, so each process of a multi-process job compiles its
        own. close() stops it after the shape it is at. on_start() runs first, on the
        compiling thread (serve lowers the compiles' CPU priority there)."""

        def work():
            if on_start is not None:
                on_start()
            t0, errors, n = time.perf_counter(), [], 0
            for shape in shapes:
                if self._stop_compiling.is_set():
                    break
                try:
                    self._compile(shape, announce=False)
                except Exception as e:  # the round that meets it raises it again
                    errors.append(f"{shape}: {e}")
                n += 1
                self.compiles_left -= 1
            self.compiles_left = 0
            self.planner.ready = lambda shape: True
            if on_done is not None:
                on_done(n, time.perf_counter() - t0, errors)

        # Meanwhile rounds take compiled shapes that do the same work where they can.
        self.planner.ready = self._compiled.__contains__
        self.compiles_left = len(shapes)
        self._stop_compiling.clear()
        self._compiler = threading.Thread(target=work, name="compile-later", daemon=True)
        self._compiler.start()

    def _compile(self, shape: Shape, announce: bool) -> None:
        """Compiles `shape`'s programs as the rounds run them (each shape says how)."""
        settings = RoundSettings(
            self.B,
            self.groups,
            self.pages,
            self.rules.layout_block,
            self.planner.cp,
            self.speculator,
        )
        shape.compile(self.engine, settings, announce)
        self._compiled.add(shape)

    # ---- the caller's side -----------------------------------------------------------

    def _check_pages(self, prompt_len: int, max_new_tokens: int) -> None:
        """A RequestError, in words, for a request the whole pool of pages could not hold."""
        if self.engine.pooling and prompt_len <= self.rules.chunk_tokens:
            return  # prefilled whole into a cache of its own
        slots = self.rules.slots_taken(prompt_len, max_new_tokens)
        eng = self.engine
        pages = self.pages // eng.D  # a request's pages are its replica's
        if self.book.pages_for(slots) > pages:
            pool = "the pool" if eng.D == 1 else "a replica's pool"
            raise RequestError(
                f"a prompt of {prompt_len} tokens and $max_new_tokens {max_new_tokens} "
                f"need {slots * eng.C} tokens of KV cache; {pool} holds "
                f"{self.kv_tokens // eng.D} ({pages} pages of {eng.block_size * eng.C}): raise "
                "$kv_cache_memory_bytes, or ask for fewer tokens",
                "max_new_tokens",
                "kv_cache_memory_bytes",
            )

    def submit(self, prompt_ids, params: Params = Params(), sample_index: int = 0) -> Handle:
        """Queues a request (checked now, in words: RequestError; QueueFull when
        max_queue requests wait already) and returns its handle. Never waits for a
        round: a server's event loop may call it. sample_index: its sampling key is
        (seed, sample_index, step); the i-th prompt of a batch passes i to sample as
        `static_batch.generate` does."""
        return self.submit_all([(prompt_ids, params, sample_index)])[0]

    def submit_all(self, requests: list[tuple]) -> list[Handle]:
        """Queues every (prompt_ids, params, sample_index) of `requests`, or none: a
        RequestError for any of them, or QueueFull when they do not all fit, leaves the
        queue as it was (a refused n=3 request holds no place, not even for a round)."""
        if self.follower:
            raise RequestError("this process follows process 0: submit requests there")
        if self.failure is not None:
            raise RequestError(f"the scheduler stopped after an error: {self.failure}")
        checked = []
        for prompt_ids, params, sample_index in requests:
            prompt = tuple(int(t) for t in prompt_ids)
            self.engine.check(
                [list(prompt)], params.max_new_tokens, params.min_tokens, params.eos_ids
            )
            self._check_pages(len(prompt), params.max_new_tokens)
            if params.constraint is not None:
                self.compile_constraint(params.constraint)
            checked.append((prompt, params, sample_index))
        with self._lock:
            if self._queued + len(checked) > self.max_queue + self._free_count:
                more = f" and these {len(checked)} do not fit" if len(checked) > 1 else ""
                raise QueueFull(
                    f"{self._queued} requests are waiting ($max_queue {self.max_queue})"
                    f"{more}: retry later, or raise $max_queue",
                    "max_queue",
                )
            handles = []
            for prompt, params, sample_index in checked:
                request = Request(next(self._ids), prompt, params, sample_index)
                handle = Handle(request, self._drive)
                self._handles[handle.id] = handle
                self._inbox.append(handle)
                handles.append(handle)
            self._queued += len(handles)
            self._wake.notify_all()
        return handles

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compiles a request's constraint (cached by its text; ConstraintError, a
        RequestError, when the grammar engine refuses it or takes too long). A caller
        on an event loop runs it on a thread before `submit`, which then finds it."""
        if self.grammars is None:
            raise RequestError(
                "structured outputs need the model's tokenizer (tokenizer.json), and this "
                "model has none",
                "constraint",
            )
        self.grammars.compile(constraint)

    def cancel(self, handle: Handle) -> None:
        """Ends a request at the next round (its row is freed then). A handle this
        scheduler did not give, or one already finished or cancelled, is refused."""
        with self._lock:
            if self._handles.get(handle.id) is not handle:
                raise RequestError(
                    f"request {handle.id} is not running here (finished, or from another "
                    f"scheduler): nothing to cancel"
                )
            if handle in self._cancels:
                raise RequestError(f"request {handle.id} is cancelled already")
            self._cancels.add(handle)
            self._wake.notify_all()

    @property
    def prefilling(self) -> int:
        """Long prompts between their first and last chunk (0 or 1)."""
        return int(self.book.chunking is not None)

    def handles(self) -> list[Handle]:
        """Every request not yet finished (waiting or running)."""
        with self._lock:
            return list(self._handles.values())

    @property
    def idle(self) -> bool:
        """No request is waiting or running."""
        with self._lock:
            return not self._handles

    @property
    def running(self) -> int:
        return len(self.book.live())

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._queued

    @property
    def rows_busy(self) -> int:
        """Rows holding a request or a long prompt being prefilled, as of the last round."""
        with self._lock:
            return self.B - self._free_count

    # ---- the rounds' driver: the caller, or a background thread ----------------------

    def start(self) -> None:
        """Runs rounds on a background thread whenever a request is in, until close()."""
        with self._lock:
            if self._loop is None:
                self._closing = False
                self._loop = threading.Thread(target=self._serve, name="scheduler", daemon=True)
                self._loop.start()

    def close(self) -> None:
        """Stops the background thread (after its current round) and compile_later's
        (after its current compile: none is left running while the process exits);
        with several processes, process 0 also tells the followers to stop."""
        self._stop_compiling.set()
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.join()
        if self._compiler is not None:
            self._compiler.join()
        if self.decisions is not None and not self.follower and not self.closed:
            with self._round:
                self.decisions.publish(self.rounds, Round(close=True))
                self.closed = True

    def follow(self) -> None:
        """A follower's life: process 0's rounds, until it closes."""
        while not self.closed:
            self.step()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._handles and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
            try:
                self.step()
            except Exception as e:  # no request may wait forever on a dead loop
                self.failure = e
                with self._lock:
                    ended, self._handles = list(self._handles.values()), {}
                for handle in ended:
                    handle._deliver([], "error")
                return

    def _drive(self) -> bool:
        """A blocking reader's turn: one round, unless the background thread runs them."""
        if self._loop is not None:
            return False
        self.step()
        return True

    def step(self) -> list[Update]:
        """One round: plan (process 0) or receive the plan (a follower), then execute
        it. Returns every request's news (also delivered to its handle)."""
        with self._round:
            round = self._next_round()
            if round is None:
                return []
            for b in round.started():
                self.replica_starts[self.book.replica_of(b)] += 1
            # First tokens go out before the decode chunk runs: time to first token is
            # the prefill's, not the prefill's and a chunk's.
            waiting = [Update(id, [], "cancelled") for id in round.cancels if id in self._gone]
            updates = self._deliver(waiting + self.executor.admit(round))
            resumed, self.executor.resumed = self.executor.resumed, []
            if not self.follower:  # (a follower plans nothing: process 0 queues them)
                # first in line, oldest first (extendleft puts the last it takes first)
                self._waiting.extendleft(sorted(resumed, key=lambda r: r.id, reverse=True))
            updates += self._deliver(self.executor.decode(round))
            self.most_running = max(self.most_running, len(self.book.live()))
            self._compiled |= round.shapes(self.rules)
            self.rounds += 1
            return updates

    def _next_round(self) -> Round | None:
        """The round to run: process 0's plan (published when it leads others), or, on a
        follower, the plan process 0 published. None: process 0 has closed."""
        self._gone = set()
        if self.follower:
            round = self.decisions.receive(self.rounds)
            if round.close:
                self.closed = True
                return None
            return round
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        self._waiting.extend(h.request for h in new)
        round = self.planner.plan(
            self.book, self._waiting, {h.id for h in cancels}, self.accounting
        )
        if self.decisions is not None:
            self.decisions.publish(self.rounds, round)
        taken = round.taken()
        self._gone = {r.id for r in self._waiting if r.id in set(round.cancels)}
        self._waiting = collections.deque(r for r in self._waiting if r.id not in taken)
        return round

    def _deliver(self, updates: list[Update]) -> list[Update]:
        free = len(self.book.free_rows())
        with self._lock:
            self._queued = len(self._waiting) + len(self._inbox)
            self._free_count = free
            handles = [self._handles.get(u.id) for u in updates]
            for u in updates:
                if u.finish_reason:
                    self._handles.pop(u.id, None)
        for u, handle in zip(updates, handles):
            if handle is not None:  # a follower's rounds have no handles
                handle.cached_tokens = max(handle.cached_tokens, u.cached_tokens)
                handle._deliver(u.tokens, u.finish_reason, u.logprobs, u.prompt_logprobs, u.pooled)
        return updates

    def run(self) -> None:
        """Rounds until no request is left (without a background thread)."""
        while not self.idle:
            self.step()
