"""Continuous batching: requests join and leave the decode rows while the mesh runs.

A `Scheduler` owns `max_batch` decode rows (a multiple of the decode groups G, cut into
G round-robin groups as in `Engine.generate`) and one KV cache of that many rows. A row
is a request slot: its cache row and slot positions, its current token, step and
budget, and its sampling parameters, all per-row inputs of the one decode program. Each
`step()` is one round:

    admit   waiting requests into free rows: prefill them with the pipelined,
            microbatched prefill (at most `prefill_tokens` prompt tokens a round; each
            length bucket in batches of its own) and insert their K/V rows into the
            cache in place (donated, no copy of it). A
            prompt longer than a chunk (`prefill_tokens`, a multiple of 2C) holds a
            row and is prefilled one chunk a round, each chunk attending to the earlier
            ones in its cache (`ring.context_attention`), so it never stalls the rows
            that decode meanwhile;
    decode  one chunk over all rows, each at its own step (short while requests wait
            for a row, so finished rows free up soon; long when none wait);
    retire  finished rows (an EOS id, the token budget, or `cancel`), handing each
            request its new tokens on the way.

A round that raises ends the background loop: every request still open finishes with
"error", and later submits are refused with the error's message.

A request's tokens depend only on its prompt, its sampling parameters and its seed:
its sampling key is (seed, 0, step), as for a request alone in `Engine.generate`, and
an empty or finished row writes nothing any other row reads.

Rounds run when a caller asks: `step()`, `run()`, or a blocking read of a handle. With
`start()` a background thread runs them whenever a request is in (what a server needs,
and what a handle's async stream needs); the state is guarded by one lock.

Several processes (`decisions=SharedDecisions()`): process 0 takes the requests and
publishes what it took in before each round (`pipeline.decisions`); every other process
calls `follow()`, which runs the same rounds on the same decisions until process 0
closes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import threading

import numpy as np

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.decisions import Decision, SharedDecisions
from qwen3_spmd.pipeline.decode import DecodeInputs
from qwen3_spmd.pipeline.engine import Clock, Engine
from qwen3_spmd.pipeline.handles import Handle, Logprob, Params
from qwen3_spmd.pipeline.layout import (
    bucket,
    lay_out,
    length_bucket,
    list_decode_slots,
    whole_batch,
)
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.sampling import RowSampling, Sampling, TokenLogprobs
from qwen3_spmd.pipeline.schedule import decode_ticks
from qwen3_spmd.ring import padded_length, slots_per_device


class QueueFull(RequestError):
    """The waiting queue holds --max-queue requests: try again later."""


@dataclasses.dataclass
class Update:
    """What one round gave a request: its new tokens, and why it ended (None: it goes
    on). finish_reason is "stop" (an EOS id, kept as the last token), "length" or
    "cancelled"."""

    id: int
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None  # one per token, when the request asks


@dataclasses.dataclass
class _Chunked:
    """A long prompt being prefilled a chunk a round into a cache of its own (M rows, a
    copy of the request in each), holding decode row `row` for when it is done."""

    handle: Handle
    row: int
    done: int = 0  # prompt tokens prefilled so far
    offset: int = 0  # local cache slots its chunks hold so far (on every device)
    slot_pos: np.ndarray | None = None  # [C, S_loc] positions its chunks' slots hold
    cache: KVCache | None = None


@dataclasses.dataclass
class _Row:
    """A request in a decode row (host side)."""

    handle: Handle
    generated: list[int]  # every token so far (token 0 came from the prefill)
    prompt_slots: int  # local cache slots its prompt took (P_pad / C of its admission)

    @property
    def params(self) -> Params:
        return self.handle.params


class Scheduler:
    """Admits, decodes and retires requests continuously over an Engine's mesh.

    Args:
      engine: the Engine (weights placed, programs compiled on first use). Its
        max_seq_len bounds every request's prompt + new tokens; its chunk is the long
        decode chunk.
      max_batch: decode rows (rounded up to a multiple of the decode groups).
      prefill_tokens: prompt tokens prefilled per round at most, so a burst of prompts
        does not stall decoding; a longer prompt is prefilled in chunks of this many
        tokens (rounded down to a multiple of 2C), one a round.
      short_chunk: decode steps a round runs while requests wait for a row.
      max_queue: requests waiting for a row at most (beyond the rows free as of the
        last round); `submit` refuses more (QueueFull).
      decisions: with several processes, how they share each round's decisions
        (`pipeline.decisions.SharedDecisions`); None in a single process.
    """

    def __init__(
        self,
        engine: Engine,
        max_batch: int,
        prefill_tokens: int = 4096,
        short_chunk: int | None = None,
        max_queue: int = 256,
        decisions: SharedDecisions | None = None,
    ):
        if max_batch < 1:
            raise RequestError(f"--max-batch {max_batch} must be at least 1")
        self.engine = engine
        self.groups = engine.groups_for(engine.stages)
        self.B = -(-max_batch // self.groups) * self.groups
        self.prefill_tokens = prefill_tokens
        two_c = 2 * engine.C
        self.chunk_tokens = max(two_c, prefill_tokens // two_c * two_c)
        self._chunked: _Chunked | None = None
        self.short_chunk = short_chunk or max(1, engine.chunk // 4)
        self.max_queue = max_queue
        self.clock = Clock()
        self.rounds = 0
        # Decode accounting: row-steps the rounds ran (all rows x steps), those that
        # gave a request a token, and pipeline ticks (a stage works on one group a tick).
        self.row_steps = 0
        self.busy_row_steps = 0
        self.decode_ticks = 0
        # Rows freed before their budget (an end id, a cancel): how often a busy row
        # ends unforeseen, which sets the chunk length while requests wait.
        self.early_ends = 0
        self._ids = itertools.count()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._rows: list[_Row | None] = [None] * self.B
        C, S_loc = engine.C, engine.slots_per_device
        self._slot_pos = np.full((self.B, C, S_loc), -1, np.int32)
        self._lengths = np.zeros(self.B, np.int32)
        self._cache: KVCache = engine.empty_cache(self.B)
        self._cancelled: set[Handle] = set()  # taken in by a round
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

    def decode_counts(self) -> tuple[int, int, int]:
        """(row-steps run, row-steps that gave a request a token, pipeline ticks)."""
        return self.row_steps, self.busy_row_steps, self.decode_ticks

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
        """Bytes of the K and V cache each device holds (allocated once, all rows)."""
        k = self._cache.k
        return 2 * k.nbytes // (self.engine.stages * self.engine.C)

    def precompile(self, workers: int = 2) -> int:
        """Compiles every program a round can run, so that no request waits for a
        compile while the running ones stall (what a server does at start-up): the
        prefill of each batch `_admit_short` can form (a `whole_batch` of prompts of one
        length bucket within prefill_tokens), each chunk of a long prompt, the decode
        chunk over each row count it runs, greedy or sampled, with log-probabilities or
        without, and the row moves. Only a prompt whose bucket would leave its new
        tokens no room in the row, padded to its own length instead, still compiles a
        shape when met. `workers` compiles run at once. Returns the number of shapes
        compiled (each with its helpers)."""
        eng, two_c = self.engine, 2 * self.engine.C
        room = eng.C * eng.slots_per_device  # the longest padded prompt a row holds
        short = min(eng.max_seq_len - 1, self.chunk_tokens)  # a short prompt's tokens at most
        fewest = {}  # each length bucket a short prompt can take: its fewest tokens
        for n in range(short, 0, -1):
            fewest[length_bucket(n, two_c)] = n
        lengths = {P for P in fewest if P <= room}
        batches = {bucket(whole_batch(n, eng.M), eng.M) for n in range(1, self.B + 1)}
        prefills = {
            (B, P, False)
            for P in lengths
            for B in batches
            if B <= eng.M or B * fewest[P] <= self.prefill_tokens
        }
        if eng.max_seq_len - 1 > self.chunk_tokens:  # long prompts go in chunks of B = M
            prefills.add((eng.M, self.chunk_tokens, False))
            prefills |= {
                (eng.M, min(length_bucket(n, two_c), self.chunk_tokens), True)
                for n in range(1, self.chunk_tokens + 1)
            }
        tasks = [(eng.compile_prefill, B, P, self.B, ctx) for B, P, ctx in sorted(prefills)]
        rows = {min(self.B, bucket(n, self.groups)) for n in range(1, self.B + 1)}
        tasks += [
            (eng.compile_decode, n, self.B, self.groups, sampled, logprobs)
            for n in sorted(rows)
            for sampled, logprobs in itertools.product((False, True), repeat=2)
        ]
        # `_compact` moves the live rows at or past bucket(n, G) of n: at most that many
        moves = {
            bucket(m, 1)
            for n in range(1, self.B + 1)
            for m in range(1, min(n, self.B - bucket(n, self.groups)) + 1)
        }
        tasks += [(eng.compile_move, n, self.B) for n in sorted(moves)]
        # XLA compiles outside the GIL: several at once use the host's cores.
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for done in [pool.submit(*task) for task in tasks]:
                done.result()
        return len(tasks)

    # ---- the caller's side -----------------------------------------------------------

    def submit(self, prompt_ids, params: Params = Params()) -> Handle:
        """Queues a request (checked now, in words: RequestError; QueueFull when
        max_queue requests wait already) and returns its handle. Never waits for a
        round: a server's event loop may call it."""
        if self.follower:
            raise RequestError("this process follows process 0: submit requests there")
        if self.failure is not None:
            raise RequestError(f"the scheduler stopped after an error: {self.failure}")
        prompt = tuple(int(t) for t in prompt_ids)
        self.engine.check([list(prompt)], params.max_new_tokens)
        RowSampling.stack([_row_sampling(params)])  # min_tokens' end ids fit its ban
        if params.min_tokens < 0:
            raise RequestError(f"min_tokens {params.min_tokens} must be >= 0")
        with self._lock:
            if self._queued >= self.max_queue + self._free_count:
                raise QueueFull(
                    f"{self._queued} requests are waiting (--max-queue {self.max_queue}): "
                    f"retry later, or raise --max-queue"
                )
            handle = Handle(next(self._ids), prompt, params, self._drive)
            self._handles[handle.id] = handle
            self._inbox.append(handle)
            self._queued += 1
            self._wake.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Ends a request at the next round (its row is freed then). A handle this
        scheduler did not give, or one already finished or cancelled, is refused."""
        with self._lock:
            if self._handles.get(handle.id) is not handle:
                raise RequestError(
                    f"request {handle.id} is not running here (finished, or from another "
                    f"scheduler): nothing to cancel"
                )
            if handle in self._cancels or handle in self._cancelled:
                raise RequestError(f"request {handle.id} is cancelled already")
            self._cancels.add(handle)
            self._wake.notify_all()

    @property
    def prefilling(self) -> int:
        """Long prompts between their first and last chunk (0 or 1)."""
        return int(self._chunked is not None)

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
        return sum(r is not None for r in self._rows)

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._queued

    # ---- the rounds' driver: the caller, or a background thread ----------------------

    def start(self) -> None:
        """Runs rounds on a background thread whenever a request is in, until close()."""
        with self._lock:
            if self._loop is None:
                self._closing = False
                self._loop = threading.Thread(target=self._serve, name="scheduler", daemon=True)
                self._loop.start()

    def close(self) -> None:
        """Stops the background thread (after its current round); with several
        processes, process 0 also tells the followers to stop."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.join()
        if self.decisions is not None and not self.follower and not self.closed:
            with self._round:
                self.decisions.publish(self.rounds, Decision([], [], close=True))
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
        """One round: admit, decode one chunk, retire. Returns every request's news (also
        delivered to its handle)."""
        with self._round:
            if not self._take_in():
                return []
            # First tokens go out before the decode chunk runs: time to first token is
            # the prefill's, not the prefill's and a chunk's.
            updates = self._deliver(self._drop_cancelled() + self._admit())
            if self.running:
                updates += self._deliver(self._decode())
            self.rounds += 1
            return updates

    def _deliver(self, updates: list[Update]) -> list[Update]:
        free = len(self._free_rows())
        with self._lock:
            self._queued = len(self._waiting) + len(self._inbox)
            self._free_count = free
            handles = [self._handles[u.id] for u in updates]
            for u in updates:
                if u.finish_reason:
                    del self._handles[u.id]
        for u, handle in zip(updates, handles):
            handle._deliver(u.tokens, u.finish_reason, u.logprobs)
        return updates

    def _take_in(self) -> bool:
        """The round's new requests and cancellations: from the inboxes (process 0,
        which publishes them when it leads others), or from process 0's decision (a
        follower). False: process 0 has closed."""
        if self.follower:
            decision = self.decisions.receive(self.rounds)
            if decision.close:
                self.closed = True
                return False
            with self._lock:
                for id, prompt, params in decision.submits:
                    handle = Handle(id, prompt, params, lambda: True)
                    self._handles[id] = handle
                    self._waiting.append(handle)
                # a request process 0 cancelled may have finished since: nothing to do
                self._cancelled |= {
                    self._handles[i] for i in decision.cancels if i in self._handles
                }
            return True
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        if self.decisions is not None:
            submits = [(h.id, h.prompt, h.params) for h in new]
            cancelled = sorted(h.id for h in cancels)
            self.decisions.publish(self.rounds, Decision(submits, cancelled))
        self._waiting.extend(new)
        self._cancelled |= cancels
        return True

    def run(self) -> None:
        """Rounds until no request is left (without a background thread)."""
        while not self.idle:
            self.step()

    # ---- a round -----------------------------------------------------------------------

    def _drop_cancelled(self) -> list[Update]:
        out = []
        if not self._cancelled:
            return out
        kept = collections.deque()
        for handle in self._waiting:
            if handle in self._cancelled:
                out.append(Update(handle.id, [], "cancelled"))
            else:
                kept.append(handle)
        self._waiting = kept
        for b, row in enumerate(self._rows):
            if row is not None and row.handle in self._cancelled:
                out.append(Update(row.handle.id, [], "cancelled"))
                self._free(b)
                self.early_ends += 1
        if self._chunked is not None and self._chunked.handle in self._cancelled:
            out.append(Update(self._chunked.handle.id, [], "cancelled"))
            self._chunked = None
        self._cancelled.clear()
        return out

    def _free_rows(self) -> list[int]:
        held = self._chunked.row if self._chunked is not None else None
        return [b for b, r in enumerate(self._rows) if r is None and b != held]

    def _long(self, handle: Handle) -> bool:
        return handle.prompt_tokens > self.chunk_tokens

    def _admit(self) -> list[Update]:
        """Prefills waiting requests into free rows: the next chunk of a long prompt,
        then short prompts in the budget left. Returns the first tokens of those done."""
        updates = []
        budget = self.prefill_tokens
        if self._chunked is None and self._waiting and self._long(self._waiting[0]):
            free = self._free_rows()
            if free:
                self._chunked = _Chunked(self._waiting.popleft(), free[0])
        if self._chunked is not None:
            budget -= self.chunk_tokens
            updates += self._prefill_chunk()
        return updates + self._admit_short(max(budget, 0))

    def _prefill_chunk(self) -> list[Update]:
        """The next chunk of the long prompt; after its last, the request decodes."""
        eng, ch = self.engine, self._chunked
        prompt = ch.handle.prompt
        end = min(ch.done + self.chunk_tokens, len(prompt))
        batch = lay_out(
            [list(prompt[ch.done : end])],
            eng.M,
            1,
            eng.C,
            eng.slots_per_device,
            start=ch.done,
            offset=ch.offset,
            P_pad=self._chunk_pad(end - ch.done, ch.offset, ch.handle.params.max_new_tokens),
        )
        if ch.slot_pos is None:
            ch.slot_pos = batch.slot_pos[0].copy()
        else:
            mine = slice(ch.offset, batch.prompt_slots)
            ch.slot_pos[:, mine] = batch.slot_pos[0][:, mine]
        cache = ch.cache
        if cache is not None:  # the chunk's context: the earlier chunks' slots
            cache = eng.with_slot_pos(cache, np.broadcast_to(ch.slot_pos, batch.slot_pos.shape))
        p = ch.handle.params
        params = RowSampling.stack([_row_sampling(p)] * batch.B)
        sampled = p.sampling.temperature > 0
        strategy, _ = eng.cp_plan(batch.B, batch.P_pad)
        first, logits, ch.cache = eng.prefill(batch, strategy, params, sampled, self.clock, cache)
        ch.done, ch.offset = end, batch.prompt_slots
        if end < len(prompt):
            return []
        self._chunked = None
        rows = np.full(batch.B, self.B, np.int32)
        rows[0] = ch.row
        self._cache = eng.insert(self._cache, ch.cache, rows)
        lp = (eng.logprobs(logits, first), 0) if p.logprobs else None
        return [self._start_row(ch.row, ch.handle, int(first[0]), ch.offset, ch.slot_pos, lp)]

    def _chunk_pad(self, tokens: int, offset: int, new_tokens: int) -> int:
        """The padded length of a chunk of `tokens` prompt tokens after `offset` local
        slots: a whole chunk's, or the last chunk's `length_bucket` (one of few compiled
        shapes) where the row has room for it and the new tokens, else its own."""
        C = self.engine.C
        padded = min(length_bucket(tokens, 2 * C), self.chunk_tokens)
        if offset + slots_per_device(padded, new_tokens, C) <= self.engine.slots_per_device:
            return padded
        return padded_length(tokens, C)

    def _start_row(
        self,
        b: int,
        handle: Handle,
        token: int,
        prompt_slots: int,
        slot_pos,
        logprobs: tuple[TokenLogprobs, int] | None = None,
    ):
        """Request `handle`, prefilled, decodes in row b from its first token on
        (`logprobs`: the prefill's, and the request's row in them)."""
        self._rows[b] = _Row(handle, [token], prompt_slots)
        self._slot_pos[b] = slot_pos
        self._lengths[b] = handle.prompt_tokens
        update = Update(handle.id, [token], self._finished(self._rows[b]))
        if logprobs is not None:
            update.logprobs = [_logprob(logprobs[0], logprobs[1])]
        if update.finish_reason:
            self._free(b)
        return update

    def _admit_short(self, budget: int) -> list[Update]:
        """Prefills waiting short prompts, in their order, into the free rows, within
        `budget` tokens (one at least, when no chunk ran this round). Prompts of one
        length bucket go together (padded to one length, a short prompt would cost a
        long one's compute), in whole bucketed batches (padding rows compute for
        nobody): 7 prompts of a bucket are batches of 4, 2 and 1."""
        free = self._free_rows()
        eng = self.engine
        by_bucket: dict[int, list[Handle]] = {}  # in the order of each bucket's first
        n = tokens = 0
        for handle in self._waiting:
            if n == len(free) or self._long(handle):
                break  # a long prompt starts chunking when the one before it is done
            if tokens + handle.prompt_tokens > budget and (n or budget < self.prefill_tokens):
                break
            together = by_bucket.setdefault(length_bucket(handle.prompt_tokens, 2 * eng.C), [])
            if not self._fits(together + [handle]):
                break  # padded with longer prompts it would not fit: next round
            together.append(handle)
            n, tokens = n + 1, tokens + handle.prompt_tokens
        for _ in range(n):
            self._waiting.popleft()
        updates, rows = [], iter(free)
        for together in by_bucket.values():
            while together:
                k = whole_batch(len(together), eng.M)
                updates += self._prefill(together[:k], [next(rows) for _ in range(k)])
                together = together[k:]
        return updates

    def _prefill(self, handles: list[Handle], rows: list[int]) -> list[Update]:
        """Prefills short prompts together into the free `rows`; their first tokens."""
        eng = self.engine
        # Bucketed shapes (few prefill compiles) where the padding leaves room.
        batch = lay_out(
            [list(h.prompt) for h in handles],
            eng.M,
            1,
            eng.C,
            eng.slots_per_device,
            bucketed=self._fits(handles, bucketed=True),
        )
        params = RowSampling.stack(
            [_row_sampling(h.params) for h in handles]
            + [(Sampling(), 0, 0)] * (batch.B - len(handles))
        )
        sampled = any(h.params.sampling.temperature > 0 for h in handles)
        strategy, _ = eng.cp_plan(batch.B, batch.P_pad)
        first, logits, new = eng.prefill(batch, strategy, params, sampled, self.clock)
        into = np.full(batch.B, self.B, np.int32)  # padding rows: past the end, dropped
        into[: len(rows)] = rows
        self._cache = eng.insert(self._cache, new, into)
        lp = eng.logprobs(logits, first) if any(h.params.logprobs for h in handles) else None
        return [
            self._start_row(
                b,
                h,
                int(first[r]),
                batch.prompt_slots,
                batch.slot_pos[r],
                (lp, r) if h.params.logprobs else None,
            )
            for r, (b, h) in enumerate(zip(rows, handles))
        ]

    def _fits(self, handles: list[Handle], bucketed: bool = False) -> bool:
        """Whether each request's prompt, padded as long as the longest of them (and
        to its `layout.length_bucket` if bucketed), leaves its new tokens room in a
        row's cache slots."""
        eng = self.engine
        longest = max(h.prompt_tokens for h in handles)
        if bucketed:
            longest = length_bucket(longest, 2 * eng.C)
        return all(
            slots_per_device(longest, h.params.max_new_tokens, eng.C) <= eng.slots_per_device
            for h in handles
        )

    def _decode(self) -> list[Update]:
        """One decode chunk over every row; hands out the new tokens, retires rows."""
        eng = self.engine
        live = self._compact([b for b, r in enumerate(self._rows) if r is not None])
        # Requests take the lowest free rows, and the chunk runs over the rows up to the
        # highest busy one (rounded up to the groups times a power of two: few programs),
        # so a light load does not pay for every row's products.
        n = min(self.B, bucket(live[-1] + 1, self.groups))
        step = np.zeros(n, np.int32)
        limit = np.zeros(n, np.int32)  # an empty row: no step writes
        prompt_slots = np.zeros(n, np.int32)
        tokens = np.zeros(n, np.int32)
        per_row = [(Sampling(), 0, 0)] * n
        for b in live:
            row = self._rows[b]
            step[b] = len(row.generated) - 1  # decode step j feeds token j
            limit[b] = row.params.max_new_tokens - 1
            prompt_slots[b] = row.prompt_slots
            tokens[b] = row.generated[-1]
            per_row[b] = _row_sampling(row.params)
        if len(live) < self.B:  # one may arrive during the chunk, and waits for its end
            chunk = self.short_chunk
        elif self._waiting:
            chunk = chunk_while_waiting(
                stages=eng.stages,
                groups=self.groups,
                early_ends=self.early_ends,
                row_steps=self.busy_row_steps,
                short=self.short_chunk,
                long=eng.chunk,
            )
        else:
            chunk = eng.chunk
        left = [int(limit[b] - step[b]) for b in live]
        take, first = min(chunk, eng.chunk, max(left)), min(left)
        # Past the first row's budget that row sits empty to the chunk's end, while a
        # waiting (or the next) request could use it; ending the chunk there costs one
        # more pipeline fill and drain, S (S - 1) stage-ticks, against the empty row's
        # S G / B stage-ticks a step. End it there when that is the smaller loss (on
        # one stage, always).
        if (take - first) * self.groups > (eng.stages - 1) * self.B:
            take = first
        list_decode_slots(self._slot_pos, step, take, limit, self._lengths[:n], prompt_slots)
        inputs = DecodeInputs(
            tokens=tokens,
            positions=self._lengths[:n] + step,
            step=step,
            limit=limit,
            prompt_slots=prompt_slots,
            sampling=RowSampling.stack(per_row),
            run_steps=np.int32(take),
        )
        sampled = any(self._rows[b].params.sampling.temperature > 0 for b in live)
        logprobs = any(self._rows[b].params.logprobs for b in live)
        out, self._cache = eng.decode(
            self._cache, self._slot_pos, inputs, self.groups, sampled, False, self.clock, logprobs
        )
        new_tokens = np.asarray(out.tokens)
        self.row_steps += self.B * take
        self.decode_ticks += decode_ticks(self.groups, eng.stages, take)
        lp = TokenLogprobs(*(np.asarray(x) for x in out.logprobs)) if logprobs else None
        updates = []
        for b in live:
            row = self._rows[b]
            got = []
            for t in new_tokens[b, : min(take, limit[b] - step[b])]:
                got.append(int(t))
                row.generated.append(int(t))
                if self._finished(row):
                    break
            self.busy_row_steps += len(got)
            updates.append(Update(row.handle.id, got, self._finished(row)))
            if row.params.logprobs:
                at_step = TokenLogprobs(*(x[b] for x in lp))
                updates[-1].logprobs = [_logprob(at_step, k) for k in range(len(got))]
            if updates[-1].finish_reason:
                self._free(b)
                self.early_ends += updates[-1].finish_reason == "stop"
        return updates

    def _compact(self, live: list[int]) -> list[int]:
        """Moves the requests in rows past the fewest a chunk could run over
        (`bucket`ed) into free rows below, so that a light load after a burst decodes
        few rows: one request left in the last row would keep every row's products
        running to its end. One in-place copy of the moved rows' K/V. Returns the busy
        rows."""
        fewest = bucket(len(live), self.groups)
        above = [b for b in live if b >= fewest]
        if not above:  # the common case: nothing to move, no free rows to list
            return live
        below = [b for b in self._free_rows() if b < fewest][: len(above)]
        if len(below) < len(above):
            return live
        self._cache = self.engine.move_rows(self._cache, np.array(above), np.array(below))
        for a, b in zip(above, below):
            self._rows[b], self._lengths[b] = self._rows[a], self._lengths[a]
            self._slot_pos[b] = self._slot_pos[a]
            self._free(a)
        return sorted([b for b in live if b < fewest] + below)

    @staticmethod
    def _finished(row: _Row) -> str | None:
        if row.generated[-1] in row.params.eos_ids:
            return "stop"
        if len(row.generated) >= row.params.max_new_tokens:
            return "length"
        return None

    def _free(self, b: int) -> None:
        """Row b holds no request: it writes nothing from now on, and the slot positions
        of its last request are cleared, so a later request in the row sees none."""
        self._rows[b] = None
        self._slot_pos[b] = -1
        self._lengths[b] = 0


def chunk_while_waiting(
    stages: int, groups: int, early_ends: int, row_steps: int, short: int, long: int
) -> int:
    """Decode steps of a chunk over full rows while requests wait for one.

    A row frees before its budget only at an unforeseen end (an end id, a cancel), then
    sits empty to the chunk's end, and the request waiting for it with it. At q such
    ends per busy row-step (`early_ends` / `row_steps` so far), a chunk of n steps
    leaves about B q n^2 / 2 row-steps empty, S G / B stage-ticks each, against one
    pipeline fill and drain a chunk, S (S - 1) stage-ticks: per row-step run, the sum is
    least at n = sqrt(2 (S - 1) / (G q)). On one stage a fill costs nothing, so chunks
    stay `short` (a freed row is refilled soonest); with no early end seen yet they are
    `long`. Between the two otherwise."""
    if stages == 1:
        return short
    if early_ends == 0:
        return long
    n = math.sqrt(2 * (stages - 1) * row_steps / (groups * early_ends))
    return max(short, min(long, round(n)))


def _row_sampling(p: Params) -> tuple:
    """A request's row of RowSampling.stack: its settings, seed, and its end ids
    banned before step min_tokens."""
    ban = (p.min_tokens, p.eos_ids) if p.min_tokens > 0 else (0, ())
    return (p.sampling, p.seed, 0, ban)


def _logprob(lp: TokenLogprobs, r: int) -> Logprob:
    """Row r of TokenLogprobs (numpy) as the handle keeps it."""
    top = [(int(i), float(v)) for i, v in zip(lp.top_ids[r], lp.top[r])]
    return Logprob(float(lp.chosen[r]), top)
