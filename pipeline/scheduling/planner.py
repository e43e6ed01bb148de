"""The planner: what a scheduler round runs, decided from the books alone.

`Planner.plan` reads the row book, the waiting requests and the cancellations, and
returns a `Round`, a frozen record of everything the round runs: the cancellations it
takes in, the next chunk of a long prompt, the admissions (their requests, rows and
padded shapes, from `pipeline.runtime.shapes`), the row moves, and the decode chunk (its rows and
steps). It touches no device and writes nothing: tests drive it with hand-made books,
and with several processes process 0 plans and sends the `Round` itself, so a rule that
reads a clock or a measured cost can never put the others out of step.

The policy, in the order a round runs:

    cancel  the requests cancelled since the last round, wherever they are;
    chunk   a prompt longer than a chunk (`prefill_tokens`, a multiple of 2C) holds a
            row and is prefilled a chunk a round, each chunk attending to the earlier
            ones in its cache (`ring.context_attention`), so it never stalls the rows
            that decode meanwhile;
    admit   waiting short prompts into free rows within the round's prompt tokens, each
            length bucket in whole batches of its own;
    move    requests left in high rows down into free low ones, so a light load after a
            burst decodes few rows;
    decode  one chunk over the rows up to the highest busy one, each at its own step
            (short while requests wait for a row, so finished rows free up soon; long
            when none wait); with speculation on, run as plain steps, a verify pass of
            width T or a loop of passes on the device (`pipeline.speculative.policy`).

With `data` replicas (`pipeline.batch.replicas`) every rule above runs on each
replica's rows and pages: a request goes to the replica with the most free room (free
pages, then free rows, then the lowest number), or, with a prefix cache, to the one
that holds the longest run of its blocks unless that one is busier by more than
ROUTING_MARGIN; a row moves within its replica, and a replica short of pages preempts
its own youngest.

A request that ends at its first token by an EOS id is only known once its prefill
ran: the round's decode plan counts it busy (its row then runs empty), and the next
round sees it gone.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterable

from qwen3_spmd.pipeline.batch.handles import Params, Request
from qwen3_spmd.pipeline.batch.prefix import PrefixBook
from qwen3_spmd.pipeline.batch.replicas import replica
from qwen3_spmd.pipeline.batch.rowbook import RowBook
from qwen3_spmd.pipeline.programs.layout import whole_batch
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.runtime.shapes import (
    DecodeShape,
    MoveShape,
    PrefillShape,
    Shape,
    ShapeRules,
)
from qwen3_spmd.pipeline.speculative.policy import Drafting, SpecPlan, SpecPolicy, drafting
from qwen3_spmd.pipeline.structured.constraints import Constraint

# Cache-aware routing over replicas: a prompt reads its blocks on the replica that holds
# the longest run of them unless that replica's busy rows exceed the least loaded
# replica's by more than this share of a replica's rows (at least one row); then the
# load decides among the others. SGLang's router balances by the same two measures
# (prefix match, then load past a threshold). Lenient, as SGLang's threshold is: a
# decode step reads every weight whatever its rows, so a few more rows on one replica
# cost little, while a hit spares its blocks' prefill; the load wins once one replica
# would run out of rows well before the others.
ROUTING_MARGIN = 0.5


@dataclasses.dataclass(frozen=True)
class Chunk:
    """The next chunk of the long prompt in row `row`: its tokens start..end.
    request: the request when this is its first chunk (it then takes the row), None for
    the one the row book holds already."""

    row: int
    start: int
    end: int
    shape: PrefillShape
    request: Request | None = None
    cached: int = 0  # a first chunk's prefix-cache hit: its first blocks the cache
    # names (its tokens before `start`), whose pages its row shares
    cp: str = "ring"  # how its prompt attention splits along seq (Engine.cp_plan's choice)


@dataclasses.dataclass(frozen=True)
class Admission:
    """Short prompts prefilled together (`shape`), request i into row rows[i]."""

    requests: tuple[Request, ...]
    rows: tuple[int, ...]
    shape: PrefillShape
    cp: str = "ring"  # how their prompt attention splits along seq (Engine.cp_plan's choice)


@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """A decode chunk over rows 0..shape.rows-1 that runs `steps` steps. with_logits:
    row 0's logits at each step come back too (a static batch's first request). spec:
    the chunk runs as speculative verify passes instead, as this plan says."""

    shape: DecodeShape
    steps: int
    with_logits: bool = False
    spec: SpecPlan | None = None


def decode_chunk(
    shape: DecodeShape,
    steps: int,
    rows: dict[int, Drafting],
    speculate: SpecPolicy | None,
    with_logits: bool = False,
) -> DecodeChunk:
    """The decode chunk over shape.rows rows, whose busy ones are `rows`, that runs up to
    `steps` steps. A row under a constraint needs the host between its tokens (its
    grammar's matcher takes each and gives the next mask): the chunk runs one step.
    With `speculate`, its policy decides plain steps or verify passes."""
    if shape.constrained:
        steps = 1
    chunk = DecodeChunk(shape, steps, with_logits)
    if speculate is None or with_logits or not speculate.takes(len(rows)):
        return chunk
    steps, plan = speculate.decide(rows, shape.rows, steps, shape.constrained)
    return dataclasses.replace(chunk, steps=steps, spec=plan)


@dataclasses.dataclass(frozen=True)
class Round:
    """Everything one round runs, in this order (preempts, cancels, chunk, admissions,
    moves, decode). close: process 0 has stopped (the followers stop after this)."""

    cancels: tuple[int, ...] = ()  # request ids
    chunk: Chunk | None = None
    admissions: tuple[Admission, ...] = ()
    moves: tuple[tuple[int, int], ...] = ()  # (from row, to row)
    decode: DecodeChunk | None = None
    close: bool = False
    # requests whose rows (or chunks) give their pages back and who wait to be
    # prefilled again, after the cancels (`Request.resumed`)
    preempts: tuple[int, ...] = ()

    def taken(self) -> set[int]:
        """The waiting requests this round takes out of the queue."""
        ids = {r.id for a in self.admissions for r in a.requests} | set(self.cancels)
        if self.chunk is not None and self.chunk.request is not None:
            ids.add(self.chunk.request.id)
        return ids

    def started(self) -> list[int]:
        """The rows this round starts a request in (its prefill, or a long prompt's
        first chunk)."""
        rows = [b for a in self.admissions for b in a.rows]
        if self.chunk is not None and self.chunk.request is not None:
            rows.append(self.chunk.row)
        return rows

    def shapes(self, rules: ShapeRules) -> set[Shape]:
        """The program shapes the round runs."""
        shapes: set[Shape] = {a.shape for a in self.admissions}
        if self.chunk is not None:
            shapes.add(self.chunk.shape)
        if self.moves:
            shapes.add(MoveShape(rules.moved(len(self.moves))))
        if self.decode is not None:
            shapes.add(self.decode.shape)
        return shapes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> Round:
        d = json.loads(text)
        chunk = decode = None
        if d["chunk"]:
            c = d["chunk"]
            shape, request = PrefillShape(**c.pop("shape")), _request(c.pop("request"))
            chunk = Chunk(**c, shape=shape, request=request)
        if d["decode"]:
            c = d["decode"]
            spec = SpecPlan.from_dict(c["spec"]) if c["spec"] else None
            decode = DecodeChunk(**{**c, "shape": DecodeShape(**c["shape"]), "spec": spec})
        return Round(
            cancels=tuple(d["cancels"]),
            chunk=chunk,
            admissions=tuple(
                Admission(
                    tuple(_request(r) for r in a["requests"]),
                    tuple(a["rows"]),
                    PrefillShape(**a["shape"]),
                    a["cp"],
                )
                for a in d["admissions"]
            ),
            moves=tuple(tuple(m) for m in d["moves"]),
            decode=decode,
            close=d["close"],
            preempts=tuple(d["preempts"]),
        )


def _request(d: dict | None) -> Request | None:
    if d is None:
        return None
    p = d["params"]
    constraint = Constraint(**p["constraint"]) if p.get("constraint") else None
    params = Params(
        **{
            **p,
            "sampling": Sampling(**p["sampling"]),
            "eos_ids": tuple(p["eos_ids"]),
            "constraint": constraint,
        }
    )
    return Request(d["id"], tuple(d["prompt"]), params, d["sample_index"], d["made"])


@dataclasses.dataclass
class Accounting:
    """Decode row-steps the rounds ran (all rows x steps), those that gave a request a
    token, pipeline ticks (a stage works on one group a tick), and rows freed before
    their budget (an end id, a cancel): how often a busy row ends unforeseen, which sets
    the chunk length while requests wait."""

    row_steps: int = 0
    busy_row_steps: int = 0
    decode_ticks: int = 0  # verify passes' included
    verify_ticks: int = 0  # of decode_ticks, those of verify passes
    verify_positions: int = 0  # a verify pass's ticks x its positions a row (k + 1)
    early_ends: int = 0
    masks: int = 0  # constrained rows' allowed-token masks filled (one per token)


class Planner:
    """Plans rounds for a row book padded by `rules`, on `stages` pipeline stages.
    short_chunk: decode steps a round runs while a row is free; long_chunk: the
    engine's chunk, the most a round runs. prefix: the prefix cache's book (read only),
    None without a cache. cp: a prefill shape's CP strategy, "ring" or "ulysses"
    (`Engine.cp_plan`): chosen here, on process 0, so that every process runs the same
    program even where their measured rates would choose differently. speculate: the
    speculative policy (None: plain decoding), chosen here for the same reason."""

    def __init__(
        self,
        rules: ShapeRules,
        stages: int,
        short_chunk: int,
        long_chunk: int,
        prefix: PrefixBook | None = None,
        cp: Callable[[PrefillShape], str] = lambda shape: "ring",
        speculate: SpecPolicy | None = None,
    ):
        self.rules, self.stages = rules, stages
        self.cp = cp
        self.speculate = speculate
        self.short_chunk, self.long_chunk = short_chunk, long_chunk
        self.prefix = prefix
        # Whether a shape's program is compiled; while the rest compile in the
        # background (`Scheduler.compile_later`), a round takes a compiled shape that does
        # the same work (fewer prompts, a longer padding, more decode rows, no move) over
        # waiting for one.
        self.ready: Callable[[Shape], bool] = lambda shape: True

    def long(self, request: Request) -> bool:
        """Whether a prompt is prefilled in chunks."""
        return len(request.prompt) > self.rules.chunk_tokens

    def cached(
        self, book: RowBook, request: Request, free: list[int], load: list[int]
    ) -> tuple[int | None, list[tuple[int, ...]]]:
        """(the replica whose prefix cache the prompt reads, the pages of its first
        blocks named there, `PrefixBook.lookup`), or (None, []): a hit is prefilled
        from its first uncached token on, as a long prompt's later chunks. Over
        replicas, the cache-aware routing of SGLang's router: of the replicas with a
        `free` row and a `load` (busy rows) within ROUTING_MARGIN of a replica's rows
        of the least loaded one, the one with the longest run (the lower number at a
        tie). None for a request that asks for its prompt's log-probabilities (nor
        without a cache): a hit would skip the positions it asks for (vLLM bypasses the
        cache for it too)."""
        if self.prefix is None or request.params.prompt_logprobs or not free:
            return None, []
        open_ = sorted({book.replica_of(b) for b in free})
        margin = max(1, int(ROUTING_MARGIN * book.B / book.replicas))
        least = min(load[d] for d in open_)
        hits = {
            d: self.prefix.lookup(request.prompt, d) for d in open_ if load[d] - least <= margin
        }
        d = max(hits, key=lambda d: (len(hits[d]), -d))
        return (d, hits[d]) if hits[d] else (None, [])

    def plan(
        self,
        book: RowBook,
        waiting: Iterable[Request],
        cancels: Iterable[int] = (),
        accounting: Accounting | None = None,
    ) -> Round:
        """The next round for `book` with `waiting` requests (in arrival order) and the
        ids of requests `cancels` ends. Reads, writes nothing."""
        rules, cancels = self.rules, set(cancels)
        queue = list(waiting)
        found = [r.id for r in queue if r.id in cancels]
        # Rows after the round's writes, as far as the plan knows: request and tokens.
        busy, early_ends = {}, (accounting or Accounting()).early_ends
        decoding = {}  # the rows that decode already, by their row after the moves
        for b in book.live():
            row = book.rows[b]
            if row.request.id in cancels:
                found.append(row.request.id)
                early_ends += 1  # a row freed before its budget, this round
            else:
                busy[b] = (row.request, len(row.generated))
                decoding[b] = row
        held = book.chunking
        if held is not None and held.request.id in cancels:
            found.append(held.request.id)
            held = None
        queue = [r for r in queue if r.id not in cancels]
        free = [b for b in range(book.B) if b not in busy and (held is None or b != held.row)]
        # Each replica's free pages once the round's cancels have given theirs back.
        pages = [book.pages.free_in(d) for d in range(book.replicas)]
        for b in book.live():
            if book.rows[b].request.id in cancels:
                pages[book.replica_of(b)] += book.lets_go(b)
        if book.chunking is not None and held is None:
            pages[book.replica_of(book.chunking.row)] += book.lets_go(book.chunking.row)
        # Each decoding row takes the pages its next chunk may write; where they are not
        # free, the youngest requests give theirs back and wait to be prefilled again
        # (vLLM's recompute preemption), and nothing new starts this round.
        preempts, pages = self._preempt(book, decoding, held, pages)
        for b in [b for b in decoding if decoding[b].request.id in preempts]:
            del busy[b], decoding[b]
        if held is not None and held.request.id in preempts:
            held = None
        if preempts:
            queue = []  # (the queue's requests wait behind the preempted ones)
        budget, chunk = rules.prefill_tokens, None
        load = [0] * book.replicas  # each replica's busy rows (a long prompt's included)
        for b in list(busy) + ([held.row] if held is not None else []):
            load[book.replica_of(b)] += 1
        if held is None and queue and free:
            d, hit = self.cached(book, queue[0], free, load)
            if hit or self.long(queue[0]):
                d = d if hit else self._roomiest(book, free, pages)
                row = next(b for b in free if book.replica_of(b) == d)
                chunk = self._chunk(queue[0], row, done=0, offset=0, first=True, cached=len(hit))
                offset = len(hit) * (rules.block or 0) // rules.C
                # its row shares the hit's pages (no longer free where no row held them)
                shared = sum(map(len, hit))
                need = self._chunk_pages(book, chunk, queue[0], offset, shared)
                need += self.prefix.idle_of(hit) if hit else 0
                if need <= pages[d]:  # else it waits for pages at the queue's head
                    queue.pop(0), free.remove(row)
                    pages[d] -= need
                else:
                    chunk = None
        elif held is not None:
            d = book.replica_of(held.row)
            chunk = self._chunk(held.request, held.row, held.done, held.offset, first=False)
            need = self._chunk_pages(book, chunk, held.request, held.offset, book.held(held.row))
            if need <= pages[d]:
                pages[d] -= need
            else:  # it waits for pages, holding its row, and nothing starts before it there
                chunk, pages[d] = None, 0
        held_row = held.row if held is not None else None  # a long prompt's after this round
        if chunk is not None:
            held_row = None
            budget -= chunk.shape.P_pad  # the padded tokens it computes
            request = chunk.request or held.request
            if chunk.end == len(request.prompt):
                busy[chunk.row] = (request, 1)
            else:
                held_row = chunk.row

        admissions, queue = self._admit(queue, free, max(budget, 0), book, pages, load)
        for a in admissions:
            busy.update((b, (r, 1)) for r, b in zip(a.requests, a.rows))
        # A request whose budget is its first token ends at its prefill.
        busy = {b: (r, n) for b, (r, n) in busy.items() if n < r.params.max_new_tokens}
        moves, decode = (), None
        if busy:
            moves = self._compact(busy, held_row)
            for a, b in moves:  # a request admitted this round may move too
                if a in decoding:
                    decoding[b] = decoding.pop(a)
            acc = accounting or Accounting()
            decode = self._decode(
                busy, bool(queue), book.B, book.groups, early_ends, acc.busy_row_steps
            )
            decode = self._speculated(decode, busy, decoding)
        return Round(
            tuple(found),
            chunk,
            tuple(admissions),
            moves,
            decode,
            preempts=preempts,
        )

    def ahead(self) -> int:
        """Decode steps a round may write for a row at most: a chunk's, or (speculating:
        a loop of verify passes) the row's whole budget."""
        return self.long_chunk if self.speculate is None else 1 << 30

    def _preempt(
        self, book: RowBook, decoding: dict, held, pages: list[int]
    ) -> tuple[tuple, list[int]]:
        """(the ids of the requests preempted, each replica's free pages left) when every
        decoding row takes the pages its next chunk may write (`RowBook.decode_pages`)
        from its replica's `pages`: there the youngest (the last submitted) go first;
        when the oldest alone still lacks pages, the long prompt being chunked there
        gives its pages back too (it starts again)."""
        need = {b: book.decode_pages(b, self.ahead()) for b in decoding}
        preempts, pages = [], list(pages)
        for d in range(book.replicas):
            mine = [b for b in decoding if book.replica_of(b) == d]
            order = sorted(mine, key=lambda b: decoding[b].request.id)  # oldest first
            while sum(need[b] for b in order) > pages[d] and len(order) > 1:
                b = order.pop()
                preempts.append(decoding[b].request.id)
                pages[d] += book.lets_go(b)
            chunked_here = held is not None and book.replica_of(held.row) == d
            if sum(need[b] for b in order) > pages[d] and chunked_here:
                preempts.append(held.request.id)
                pages[d] += book.lets_go(held.row)
            pages[d] -= sum(need[b] for b in order)
        return tuple(preempts), pages

    def _chunk(
        self,
        request: Request,
        row: int,
        done: int,
        offset: int,
        first: bool,
        cached: int = 0,
    ) -> Chunk:
        """The next chunk of `request` in `row` after `done` tokens in `offset` local
        slots; a first chunk after a hit of `cached` blocks starts past them."""
        if cached:
            done = cached * self.rules.block
            offset = done // self.rules.C
        end = min(done + self.rules.chunk_tokens, len(request.prompt))
        new_tokens = request.params.max_new_tokens
        shape = self.rules.chunk(end - done, offset, new_tokens)
        shape = dataclasses.replace(shape, prompt_logprobs=request.params.prompt_logprobs)
        shape = self._stand_in(self.rules.prefill_stand_ins, shape, [new_tokens], offset) or shape
        return Chunk(row, done, end, shape, request if first else None, cached, self.cp(shape))

    def _chunk_pages(
        self, book: RowBook, chunk: Chunk, request: Request, offset: int, held: int
    ) -> int:
        """The pages `chunk` of `request` after `offset` local slots takes beyond the
        `held` its row holds: its slots', and after the last chunk its decode steps'."""
        slots = offset + chunk.shape.P_pad // self.rules.C
        if chunk.end == len(request.prompt) and self.rules.decodes:
            slots = book.decode_slots(slots, self._first(request))
        return max(0, book.pages_for(slots) - held)

    def _pages(self, book: RowBook, shape: PrefillShape, request: Request) -> int:
        """The pages a short prompt's prefill in `shape` takes: its prompt's and its first
        decode chunk's (none on a pooling runner, whose prefill has a cache of its own)."""
        if not self.rules.decodes:
            return 0
        return book.pages_for(book.decode_slots(shape.P_pad // self.rules.C, self._first(request)))

    def _first(self, request: Request) -> int:
        """Decode steps a request's first round after its prefill may write."""
        return min(self.ahead(), request.params.max_new_tokens - 1)

    def _roomiest(self, book: RowBook, free: list[int], pages: list[int]) -> int:
        """Of the replicas with a `free` row, the one with the most free room
        (`_most_room`)."""
        left = collections.Counter(book.replica_of(b) for b in free)
        return _most_room(left, pages, left)

    def _admit(
        self,
        queue: list[Request],
        free: list[int],
        budget: int,
        book: RowBook,
        pages: list[int],
        load: list[int],
    ) -> tuple[list[Admission], list[Request]]:
        """Waiting short prompts, in their order, into the free rows within `budget`
        tokens a replica (one at least, when no chunk runs this round), each on the
        replica with the most free room that can take it (pages, rows, tokens) and
        there into its lowest free row. Prompts of one length bucket go together
        (padded to one length, a short prompt would cost a long one's compute), in
        whole bucketed batches (padding rows compute for nobody): 7 prompts of a bucket
        are batches of 4, 2 and 1 (on each replica); a prefix cache's hit waits for
        the chunking seat. Returns the admissions and the queue left."""
        rules, D = self.rules, book.replicas
        rows = [[b for b in free if book.replica_of(b) == d] for d in range(D)]
        # in the order of each bucket's first: (request, its replica)
        by_bucket: dict[int, list[tuple[Request, int]]] = {}
        n = 0
        count, tokens, taking = [0] * D, [0] * D, [0] * D  # each replica's, so far
        for request in queue:
            if self.long(request) or self.cached(book, request, free, load)[1]:
                break  # a long prompt (or a hit) starts chunking when the one before is done
            length = len(request.prompt)
            together = by_bucket.setdefault(rules.prompt_length(length), [])
            if not _fits(rules, [r for r, _ in together] + [request]):
                break  # padded with longer prompts it would not fit: next round
            wants = self._pages(
                book, rules.prefill(1, length, [request.params.max_new_tokens]), request
            )
            # a replica's first prompt may take a whole round's tokens (not after a chunk)
            first = budget == rules.prefill_tokens
            room = [  # the replicas that can take it: a free row, its tokens, its pages
                d
                for d in range(D)
                if count[d] < len(rows[d])
                and (tokens[d] + length <= budget or (count[d] == 0 and first))
                and wants <= pages[d] - taking[d]
            ]
            if not room:
                break  # it waits (for a row, tokens or pages), and those after it with it
            pages_left = [p - t for p, t in zip(pages, taking)]
            d = _most_room(room, pages_left, [len(r) - c for r, c in zip(rows, count)])
            together.append((request, d))
            n += 1
            count[d] += 1
            tokens[d] += length
            taking[d] += wants
        admissions, into_rows, left = [], [iter(r) for r in rows], []
        for P_pad, together in by_bucket.items():
            while together:
                batch, shape = self._batch(together, rules.prefill_batch(_most(together), P_pad))
                taken = {r.id for r, _ in batch}
                together = [(r, d) for r, d in together if r.id not in taken]
                need = [0] * D
                for r, d in batch:
                    need[d] += self._pages(book, shape, r)
                if left or any(need[d] > pages[d] for d in range(D)):
                    left += [r for r, _ in batch + together]  # they wait, in their order
                    break
                pages = [p - k for p, k in zip(pages, need)]
                into = tuple(next(into_rows[d]) for _, d in batch)
                requests = tuple(r for r, _ in batch)
                admissions.append(Admission(requests, into, shape, self.cp(shape)))
        if left:
            ids = {r.id for r in left}
            left = [r for r in queue[:n] if r.id in ids]
        return admissions, left + queue[n:]

    def _batch(
        self, together: list[tuple[Request, int]], k: int
    ) -> tuple[list[tuple[Request, int]], PrefillShape]:
        """(prompts, shape) of a prefill of the first k of `together` ((request, its
        replica)) on each replica; where its program is not ready, the largest batch of
        them (k, or a smaller bucketed one) with a ready stand-in
        (`ShapeRules.prefill_stand_ins`), else a microbatch's own shape (one the
        background compiles before the batched ones)."""
        rules, M = self.rules, self.rules.microbatches
        n = k
        while True:
            batch = _first(together, n)
            new_tokens = [r.params.max_new_tokens for r, _ in batch]
            longest = max(len(r.prompt) for r, _ in batch)
            shape = rules.prefill(_most(batch), longest, new_tokens)
            # One row that asks makes the program score every row's prompt.
            scored = any(r.params.prompt_logprobs for r, _ in batch)
            shape = dataclasses.replace(shape, prompt_logprobs=scored)
            ready = self._stand_in(rules.prefill_stand_ins, shape, new_tokens)
            if ready is not None or n <= M:
                return batch, ready or shape
            n = whole_batch(n - 1, M)

    def _compact(self, busy: dict, held_row: int | None) -> tuple[tuple[int, int], ...]:
        """Moves the requests in rows past the fewest a chunk could run over into free
        rows of their replica below (one in-place copy of their K/V), so that a light
        load after a burst decodes few rows: one request left in the last row would keep
        every row's products running to its end. Updates `busy` to the rows after the
        moves."""
        D = self.rules.replicas
        most = max(collections.Counter(replica(b, D) for b in busy).values())
        fewest = self.rules.compact_below(most)
        above = sorted(b for b in busy if b >= fewest)
        if not above:
            return ()
        free = [b for b in range(fewest) if b not in busy and b != held_row]
        below = [iter([b for b in free if replica(b, D) == d]) for d in range(D)]
        moves = tuple((a, next(below[replica(a, D)], None)) for a in above)
        if any(b is None for _, b in moves) or not self.ready(
            MoveShape(self.rules.moved(len(above)))
        ):
            return ()
        for a, b in moves:
            busy[b] = busy.pop(a)
        return moves

    def _decode(
        self, busy: dict, waiting: bool, rows: int, groups: int, early_ends: int, row_steps: int
    ) -> DecodeChunk:
        """The decode chunk over the `busy` rows of `rows` in `groups` groups, with
        requests `waiting` for a row or not, after `early_ends` rows ended before their
        budget in `row_steps` busy row-steps."""
        if len(busy) < rows:  # one may arrive during the chunk, and waits for its end
            chunk = self.short_chunk
        elif waiting:
            chunk = chunk_while_waiting(
                stages=self.stages,
                groups=groups,
                early_ends=early_ends,
                row_steps=row_steps,
                short=self.short_chunk,
                long=self.long_chunk,
            )
        else:
            chunk = self.long_chunk
        left = [r.params.max_new_tokens - n for r, n in busy.values()]
        take, first = min(chunk, self.long_chunk, max(left)), min(left)
        # Past the first row's budget that row sits empty to the chunk's end, while a
        # waiting (or the next) request could use it; ending the chunk there costs one
        # more pipeline fill and drain, S (S - 1) stage-ticks, against the empty row's
        # S G / B stage-ticks a step. End it there when that is the smaller loss (on
        # one stage, always).
        if (take - first) * groups > (self.stages - 1) * rows:
            take = first
        constrained = any(r.params.constraint is not None for r, _ in busy.values())
        # One program samples or not (all-greedy rows skip the sort at run time), so a
        # server compiles one per row count where it would two.
        shape = DecodeShape(
            self.rules.decode_rows(max(busy)),
            sampled=True,
            logprobs=any(r.params.logprobs for r, _ in busy.values()),
            constrained=constrained,
        )
        shape = self._stand_in(self.rules.decode_stand_ins, shape) or shape
        return DecodeChunk(shape, take)

    def _speculated(self, chunk: DecodeChunk, busy: dict, decoding: dict) -> DecodeChunk:
        """`chunk` as `decode_chunk` runs it over the `busy` rows, of which those in
        `decoding` ({b: Row}) decoded before this round (the others' first tokens come
        from this round's prefills, so they do not draft yet)."""
        if self.speculate is None:  # still one step under a constraint
            return decode_chunk(chunk.shape, chunk.steps, {}, None)
        rows = drafting(decoding)
        for b, (request, made) in busy.items():
            if b not in rows:
                left = request.params.max_new_tokens - made
                rows[b] = Drafting(None, made, None, left, request.params.logprobs)
        rows = dict(sorted(rows.items()))
        return decode_chunk(chunk.shape, chunk.steps, rows, self.speculate)

    def _stand_in(self, stand_ins: Callable[..., list], shape: Shape, *args) -> Shape | None:
        """`shape` where its program is ready, else the first ready of
        stand_ins(shape, *args) (cheapest first; a `ShapeRules` method, called only
        then: while nothing compiles in the background every shape is ready), else None."""
        if self.ready(shape):
            return shape
        return next(filter(self.ready, stand_ins(shape, *args)), None)


def _most_room(replicas, pages, rows) -> int:
    """Of `replicas`, the one with the most free room: the most free `pages`, then the
    most free `rows` (each indexed by replica), then the lowest number (every process's
    plan alike)."""
    return max(replicas, key=lambda d: (pages[d], rows[d], -d))


def _most(placed: list[tuple[Request, int]]) -> int:
    """The most of `placed` ((request, its replica)) on one replica."""
    return max(collections.Counter(d for _, d in placed).values())


def _first(placed: list[tuple[Request, int]], k: int) -> list[tuple[Request, int]]:
    """The first k of `placed` on each replica, in their order."""
    seen = collections.Counter()
    out = []
    for r, d in placed:
        if seen[d] < k:
            out.append((r, d))
            seen[d] += 1
    return out


def _fits(rules: ShapeRules, requests: list[Request]) -> bool:
    """Whether requests prefilled together (padded as long as the longest) leave each
    its new tokens room in a row."""
    longest = max(len(r.prompt) for r in requests)
    return rules.fits(longest, [r.params.max_new_tokens for r in requests])


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
