"""The executor: runs a planned `Round`'s programs and writes what came out.

It owns the device state of continuous batching (the pool of KV pages every row's
slots live in), runs each part of a `Round` on the `Engine` (prefills into the rows'
pages, the decode chunk), and writes the results into the row book through its
methods (which hand out the pages and name the prefix cache's blocks). It decides
nothing: every process of a job executes the same `Round` alike, and gets the same
tokens.

With `data` replicas the book's rows are interleaved over them and a program's rows
are in replica blocks (`pipeline.batch.replicas`): each prefill places its rows in
their replicas' blocks, and a decode chunk's inputs and outputs change order on the
host, so the book and the planner never see the programs' order.
"""

from __future__ import annotations

import jax
import numpy as np

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.batch.handles import Logprob, Request
from qwen3_spmd.pipeline.batch.prefix import block_slot_pos
from qwen3_spmd.pipeline.batch.replicas import positions, to_book, to_program
from qwen3_spmd.pipeline.batch.rowbook import Chunking, RowBook, Update, row_sampling
from qwen3_spmd.pipeline.programs.layout import Batch, lay_out
from qwen3_spmd.pipeline.programs.sampling import (
    PromptLogprobs,
    RowSampling,
    Sampling,
    TokenLogprobs,
)
from qwen3_spmd.pipeline.programs.schedule import decode_ticks
from qwen3_spmd.pipeline.runtime.engine import Engine, to_host
from qwen3_spmd.pipeline.runtime.registry import Clock, Stopwatch
from qwen3_spmd.pipeline.scheduling.planner import Accounting, Admission, Chunk, DecodeChunk, Round
from qwen3_spmd.pipeline.speculative.speculator import SpecContext, Speculator
from qwen3_spmd.pipeline.structured.constraints import Grammars
from qwen3_spmd.pipeline.structured.rows import RowGrammars


class Executor:
    """Runs rounds on `engine` for the rows of `book`, timing its programs on `clock`
    and counting decode work in `accounting`.

    cache: the KV pool of the book's pages (`Copies.empty_cache`), with the prefix
    cache's blocks where the book has one (`RowBook.prefix`); block_layout: the block
    prompts are laid out by (`ShapeRules.layout_block`). grammars: the grammar engine
    for requests with a constraint (`pipeline.structured.constraints`), None when none
    can have one.
    speculator: runs the rounds the planner plans as verify passes (None: plain
    decoding only).
    """

    def __init__(
        self,
        engine: Engine,
        book: RowBook,
        accounting: Accounting,
        clock: Clock,
        cache: KVCache,
        block_layout: int | None = None,
        grammars: Grammars | None = None,
        speculator: Speculator | None = None,
    ):
        self.engine, self.book, self.accounting, self.clock = engine, book, accounting, clock
        self.cache = cache
        self.prefix, self.block_layout = book.prefix, block_layout
        self.grammars = RowGrammars(grammars, clock, accounting) if grammars else None
        self.speculator = speculator
        self._chunk_prompt: list[Logprob] = []  # its prompt log-probabilities, if asked
        # Requests preempted this round, oldest first, for the scheduler to queue first.
        self.resumed: list[Request] = []
        self.preemptions = 0  # requests preempted in all
        # The last program's logits on device: a prefill's [B, V], or a decode chunk's
        # row 0 at each step, each replica's [D steps, V], row 0's first
        # (DecodeChunk.with_logits; [0, V] without).
        self.logits = None

    def admit(self, round: Round) -> list[Update]:
        """The round's cancellations, long-prompt chunk and admissions: the first tokens
        of the requests prefilled (and the ends of those cancelled in rows)."""
        updates = []
        for id in round.preempts:  # their pages free for this round's rows to grow into
            self._preempt(id)
        for id in round.cancels:
            in_row = self.book.row_of(id) is not None
            if self.grammars is not None:
                self.grammars.forget([id])
            if self.book.cancel(id):
                updates.append(Update(id, [], "cancelled"))
                self.accounting.early_ends += in_row  # a row freed before its budget
                if not in_row:  # the long prompt being chunked
                    self._chunk_prompt = []
        if round.chunk is not None:
            updates += self._chunk(round.chunk)
        for admission in round.admissions:
            updates += self._prefill(admission)
        return self._forget(updates)

    def decode(self, round: Round) -> list[Update]:
        """The round's row moves and decode chunk: every busy row's new tokens."""
        for a, b in round.moves:  # their tables move: no K/V does
            self.book.move(a, b)
        chunk = round.decode
        if chunk is None:
            return []
        # Each row takes the pages its steps will write (the planner saw them free).
        ahead = chunk.steps if chunk.spec is None else 1 << 30
        for b in self.book.live():
            self.book.grow_ahead(b, ahead)
        if chunk.spec is not None:
            context = SpecContext(self.book, self.accounting, self.clock, self.grammars)
            updates, self.cache = self.speculator.run(
                context, self.cache, chunk.shape.rows, chunk.spec
            )
            return self._forget(updates)
        watch = Stopwatch(self.clock)
        updates = self._decode(chunk)
        if self.speculator is not None and not chunk.with_logits:
            self.speculator.saw_steps(chunk.shape.rows, watch.seconds() / chunk.steps)
        return self._forget(updates)

    # ---- the parts of a round ------------------------------------------------------

    def _preempt(self, id: int) -> None:
        """Request `id` gives its pages back: a decoding row's request waits to be
        prefilled again from its prompt and tokens so far (`Request.resumed`, in
        `self.resumed` for the scheduler's queue); the long prompt being chunked starts
        over. Its handle hears nothing: the tokens it has are its own, the next follow."""
        book = self.book
        b = book.row_of(id)
        if b is not None:
            row = book.rows[b]
            self.resumed.append(row.request.resumed(row.generated))
            book.free(b)
        else:  # the chunking prompt
            held = book.chunking
            self.resumed.append(held.request)
            book.release(held.row)
            book.chunking = None
            self._chunk_prompt = []
        self.preemptions += 1

    def _chunk(self, chunk: Chunk) -> list[Update]:
        """The next chunk of the long prompt; after its last, the request decodes."""
        eng, book = self.engine, self.book
        if chunk.request is None:
            held = book.chunking
        elif chunk.cached:
            held = self._hit(chunk)
        else:
            held = book.hold(chunk.request, chunk.row)
            self._count(chunk.request, 0)
        request = held.request
        if chunk.request is not None:  # its first chunk
            self._chunk_prompt = []
        scored = chunk.shape.prompt_logprobs
        # its row's place in the chunk's batch (a microbatch a replica); the others pad
        (p,) = at = positions([held.row], eng.D, chunk.shape.B)
        batch = lay_out(
            [list(request.prompt[chunk.start : chunk.end])] * chunk.shape.B,
            eng.M,
            1,
            eng.C,
            eng.slots_per_device,
            start=chunk.start,
            offset=held.offset,
            P_pad=chunk.shape.P_pad,
            rows=chunk.shape.B,
            block=self.block_layout,
            targets=[_targets(request.prompt, chunk.start, chunk.end)] * chunk.shape.B
            if scored
            else None,
        )
        last = chunk.end == len(request.prompt)  # its sampled token is the request's first
        book.grow(held.row, batch.prompt_slots)
        book.chunk_prefilled(batch, chunk.end)  # its slots listed after the earlier ones'
        slot_pos = np.broadcast_to(held.slot_pos, batch.slot_pos.shape)
        cache = self._rows_cache(slot_pos, [held.row], at)
        if eng.pooling:
            return self._pooled_chunk(batch, chunk, cache, last, p)
        params = RowSampling.stack([row_sampling(request)] * batch.B)
        sampled = request.params.sampling.temperature > 0
        allowed = self._masks(_spread([request], at, batch.B, None)) if last else None
        first, logits, self.cache, prompt = eng.prefill(
            batch, chunk.cp, params, sampled, self.clock, cache, allowed
        )
        if scored:
            self._chunk_prompt += _prompt_rows(batch, prompt, p)
        if not last:
            return []
        held = book.chunked_in()
        done = self._advance({request.id: int(first[p])})
        update = book.start(
            held.row, request, int(first[p]), held.offset, held.slot_pos, request.id in done
        )
        update.cached_tokens = held.cached_tokens
        if scored:
            update.prompt_logprobs, self._chunk_prompt = self._chunk_prompt, []
        if request.params.logprobs:
            update.logprobs = [_logprob(eng.logprobs(logits, first), p)]
        return [update]

    def _pooled_chunk(self, batch: Batch, chunk: Chunk, cache, last: bool, p: int) -> list[Update]:
        """A pooling runner's chunk (its row at batch row p): after the last, the
        request ends with its hidden state, and its row is free again (nothing
        decodes)."""
        hidden, self.cache = self.engine.pool(batch, chunk.cp, self.clock, cache)
        if not last:
            return []
        held = self.book.chunked_in()
        self.book.release(held.row)
        update = Update(held.request.id, [], "stop", pooled=hidden[p])
        update.cached_tokens = held.cached_tokens
        return [update]

    def _hit(self, chunk: Chunk) -> Chunking:
        """A prompt whose first blocks the prefix cache names starts chunking past them:
        its row's first pages are theirs, shared."""
        eng, book, block = self.engine, self.book, self.prefix.block
        blocks = self.prefix.lookup(chunk.request.prompt, book.replica_of(chunk.row))
        blocks = blocks[: chunk.cached]
        assert len(blocks) == chunk.cached, "the planner's hit is not in the book"
        done = chunk.cached * block
        slot_pos = block_slot_pos(chunk.cached, block, eng.C, eng.slots_per_device)
        held = book.hold(chunk.request, chunk.row, done, done // eng.C, slot_pos)
        held.cached_tokens = done
        book.share(chunk.row, blocks)
        self._count(chunk.request, chunk.cached)
        return held

    def _count(self, request: Request, cached: int) -> None:
        """A prompt starts its prefill, its first `cached` blocks shared."""
        if self.prefix is not None:
            self.prefix.use(cached, len(request.prompt))

    def _prefill(self, admission: Admission) -> list[Update]:
        """Short prompts prefilled together into their rows; their first tokens."""
        eng, book, requests = self.engine, self.book, admission.requests
        B, scored = admission.shape.B, admission.shape.prompt_logprobs
        at = positions(admission.rows, eng.D, B)  # each request's row in the batch
        targets = [_targets(r.prompt, 0, len(r.prompt)) for r in requests] if scored else None
        batch = lay_out(
            _spread([list(r.prompt) for r in requests], at, B),
            eng.M,
            1,
            eng.C,
            eng.slots_per_device,
            P_pad=admission.shape.P_pad,
            rows=B,
            block=self.block_layout,
            targets=_spread(targets, at, B) if scored else None,
        )
        for r in requests:
            self._count(r, 0)
        if eng.pooling:  # each ends with its hidden state; no row (nor page) is taken
            hidden, _ = eng.pool(batch, admission.cp, self.clock)
            return [Update(r.id, [], "stop", pooled=hidden[p]) for p, r in zip(at, requests)]
        for b in admission.rows:
            book.grow(b, batch.prompt_slots)
        params = RowSampling.stack(_spread([row_sampling(r) for r in requests], at, B, _GREEDY))
        sampled = any(r.params.sampling.temperature > 0 for r in requests)
        allowed = self._masks(_spread(list(requests), at, B, None))
        cache = self._rows_cache(batch.slot_pos, admission.rows, at)
        first, self.logits, self.cache, prompt = eng.prefill(
            batch, admission.cp, params, sampled, self.clock, cache, allowed
        )
        logits = self.logits
        lp = eng.logprobs(logits, first) if any(r.params.logprobs for r in requests) else None
        done = self._advance({r.id: int(first[p]) for p, r in zip(at, requests)})
        updates = []
        for p, b, r in zip(at, admission.rows, requests):
            update = book.start(
                b, r, int(first[p]), batch.prompt_slots, batch.slot_pos[p], r.id in done
            )
            if r.params.logprobs:
                update.logprobs = [_logprob(lp, p)]
            if r.params.prompt_logprobs:
                update.prompt_logprobs = _prompt_rows(batch, prompt, p)
            updates.append(update)
        return updates

    def _decode(self, chunk: DecodeChunk) -> list[Update]:
        """One decode chunk over the first rows; hands out the new tokens, retires the
        rows that end."""
        eng, book, acc = self.engine, self.book, self.accounting
        n, take, D = chunk.shape.rows, chunk.steps, eng.D
        inputs = book.decode_inputs(n, take)
        if chunk.shape.constrained:  # a chunk of one step (the planner's rule)
            held = [book.rows[b].request if book.rows[b] else None for b in range(n)]
            inputs = inputs._replace(allowed=self._masks(held, always=True))
        # the book's first n rows, each replica's first n/D, in the program's order
        inputs = _rows_map(lambda x: to_program(x, D), inputs)
        out, self.cache = eng.decode(
            self.cache,
            to_program(book.slot_pos, D),
            to_program(book.table, D),
            inputs,
            groups=book.groups,
            sampled=chunk.shape.sampled,
            with_logits=chunk.with_logits,
            clock=self.clock,
            logprobs=chunk.shape.logprobs,
        )
        self.logits = out.logits
        tokens = to_book(to_host(out.tokens), D)
        lp = None
        if chunk.shape.logprobs:
            lp = TokenLogprobs(*(to_book(to_host(x), D) for x in out.logprobs))
        acc.row_steps += book.B * take
        acc.decode_ticks += decode_ticks(book.groups, eng.stages, take)
        live = [b for b in book.live() if b < n]
        done = self._advance({book.rows[b].request.id: int(tokens[b, 0]) for b in live})
        updates = []
        for b in live:
            request = book.rows[b].request
            update = book.extend(b, tokens[b, :take], request.id in done)
            acc.busy_row_steps += len(update.tokens)
            acc.early_ends += update.finish_reason == "stop"
            if request.params.logprobs:
                at_step = TokenLogprobs(*(x[b] for x in lp))
                update.logprobs = [_logprob(at_step, k) for k in range(len(update.tokens))]
            updates.append(update)
        return updates

    # ---- constraints (structured outputs) -------------------------------------------

    def _masks(self, requests: list[Request | None], always: bool = False) -> np.ndarray | None:
        """Each row's allowed tokens [len(requests), W] (`RowGrammars.masks`); None when
        no row is constrained (the programs without masks), unless `always`."""
        if self.grammars is None:
            return None
        return self.grammars.masks(requests, always)

    def _advance(self, tokens: dict[int, int]) -> set[int]:
        """Each constrained request's matcher takes its new token ({request id: token});
        returns the ids whose answers are done (their grammar admits nothing more)."""
        return self.grammars.take(tokens) if self.grammars is not None else set()

    def _forget(self, updates: list[Update]) -> list[Update]:
        """The matchers of the requests that ended are dropped."""
        if self.grammars is not None:
            self.grammars.forget(u.id for u in updates if u.finish_reason)
        return updates

    def _rows_cache(self, slot_pos: np.ndarray, rows, at: list[int]) -> KVCache:
        """The pool, as a prefill of a batch sees it: its rows' slot positions slot_pos
        [B', C, S_loc] and pages, the book's rows `rows` at batch rows `at`, padding rows
        (copies of the first prompt, their results dropped) elsewhere with no page: their
        writes drop."""
        table = np.full((len(slot_pos), self.book.table.shape[1]), self.book.pages.pages)
        table[at] = self.book.table[list(rows)]
        return self.engine.copies.with_rows(self.cache, slot_pos, table)


_GREEDY = (Sampling(), 0, 0)  # a padding row's sampling (`row_sampling`'s form)
_FIRST = object()


def _spread(items: list, at: list[int], B: int, fill=_FIRST):
    """A batch of B rows with items[i] at row at[i]; `fill` elsewhere (default: the
    first item, as a padding row copies the first prompt)."""
    out = [items[0] if fill is _FIRST else fill] * B
    for p, item in zip(at, items):
        out[p] = item
    return out


def _rows_map(f, inputs):
    """f on each per-row array of a chunk's inputs (the scalars stay)."""
    return jax.tree.map(lambda x: f(x) if np.ndim(x) else x, inputs)


def _logprob(lp: TokenLogprobs, r: int) -> Logprob:
    """Row r of TokenLogprobs (numpy) as the handle keeps it."""
    top = [(int(i), float(v)) for i, v in zip(lp.top_ids[r], lp.top[r])]
    return Logprob(float(lp.chosen[r]), top)


def _targets(prompt: tuple[int, ...], start: int, end: int) -> list[int]:
    """The next prompt token after each of prompt[start:end] (-1 after the last)."""
    return list(prompt[start + 1 : end + 1]) + [-1] * (end == len(prompt))


def _prompt_rows(batch: Batch, lp: PromptLogprobs, b: int) -> list[Logprob]:
    """Row b's PromptLogprobs (numpy, the batch's device order) as Logprobs in position
    order, one per token that has a next prompt token (its log-probability's)."""
    positions, targets = batch.prefill.positions[b], batch.prefill.targets[b]
    at = np.flatnonzero(targets >= 0)
    at = at[np.argsort(positions[at])]
    return [
        Logprob(
            float(lp.chosen[b, i]),
            [(int(t), float(v)) for t, v in zip(lp.top_ids[b, i], lp.top[b, i])],
            int(lp.rank[b, i]),
        )
        for i in at
    ]
