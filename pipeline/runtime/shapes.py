"""The program shapes a scheduler's rounds run, declared once.

A server meets requests of every length and count; each new shape of a program is a
compile that stalls every running request. `ShapeRules` is the one place that says how
the planner pads what it plans (prompt batches, prompt lengths, long-prompt chunks,
decode rows, row moves) to few shapes, and `ShapeRules.declared()` lists every shape
those rules can give, by running the same rules over every input they can meet: what
`Scheduler.precompile` compiles and what its test expects.

`ShapeRules.first` splits that list for a server's start: compiled before it serves,
the shapes a first light load meets (one request at a time, short prompts) and a few
that can stand in for all the others (`ShapeRules.cover`); compiled while it serves, the
rest, the likeliest first (`ShapeRules.weight`). Until a shape is compiled the planner
runs one that does the same work (`Planner.ready`): a batch a microbatch at a time, a
prompt padded longer (`ShapeRules.prefill_stand_ins`), a decode chunk over more rows
(`ShapeRules.decode_stand_ins`), no row move.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from qwen3_spmd.pipeline.programs.decode import DecodeShape
from qwen3_spmd.pipeline.programs.layout import bucket, length_bucket, whole_batch
from qwen3_spmd.pipeline.programs.prefill import PrefillShape
from qwen3_spmd.ring import padded_length, slots_per_device


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """What a scheduler's rounds run every shape's program with, beside the shape: a
    cache of `cache_rows` rows on a pool of `pages` pages in `groups` decode groups, prompts laid out by `block`
    (`ShapeRules.layout_block`), each prefill's cp strategy `cp(shape)` (the planner's),
    and the `speculator` whose verify passes they run (None without speculation)."""

    cache_rows: int
    groups: int
    pages: int | None = None  # the cache's pool (None: its rows' own pages)
    block: int | None = None
    cp: Callable[[PrefillShape], str] = lambda shape: "ring"
    speculator: Any = None


# A program's shape record is its key (`pipeline.runtime.registry.Program`): every static
# choice that shapes it. PrefillShape and DecodeShape live beside their programs
# (`pipeline.programs.prefill`, `.decode`); the planner's leave the runner's choices (cp
# and block, groups and steps) at their defaults, which the engine, or `compile` with a
# scheduler's RoundSettings, fills in.


@dataclasses.dataclass(frozen=True, order=True)
class MoveShape:
    """A move of `rows` rows (padded to a power of two) down into free rows: their
    tables and slot positions move on the host (`RowBook.move`); no program runs."""

    rows: int

    def compile(self, engine, settings: RoundSettings, announce: bool = True) -> None:
        pass


# The shapes a scheduler's rounds run; a speculative pass's VerifyShape
# (`pipeline.speculative.verify`) compiles alike.
Shape = PrefillShape | DecodeShape | MoveShape

# A light load's prompts: at most this many tokens. A few words: each first-set shape
# costs a 0.6B server about 8 s cold and 2 s warm on 2 CPU cores, so this keeps the
# start in bounds; the next lengths and rows come first in the background.
LIGHT_TOKENS = 8

# Every prompt is padded to this many tokens at least. A prefill of so few tokens is
# bound by reading the weights, not by its products (a CPU's matmuls reach their peak
# at about ten tokens, a GPU's at a few hundred), so the padding costs little, and the
# lengths below it would be five more compiled lengths, each at every batch size.
MIN_PROMPT_TOKENS = 16

# While programs compile in the background, a prefill may run padded longer, to a compiled
# shape of at most this many times its tokens (`ShapeRules.prefill_stand_ins`): a short
# prompt's padding costs less than the compile it spares, a long one's about as much.
STAND_IN_PADDING = 4

# Prompts are batched (beyond a microbatch) only while a microbatch's padded tokens stay
# within this: past it one prompt keeps the matmuls busy on its own, and a batch would
# save no time but add a compiled shape at each length.
BATCHED_PREFILL_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class DeclaredShapes:
    """Every shape a scheduler's rounds can run (each compiled with its helpers)."""

    prefills: tuple[PrefillShape, ...]
    decodes: tuple[DecodeShape, ...]
    moves: tuple[int, ...]  # rows a move copies (padded)

    def __len__(self) -> int:
        return len(self.prefills) + len(self.decodes) + len(self.moves)

    def shapes(self) -> list[Shape]:
        """Every shape, moves as MoveShape."""
        return [*self.prefills, *self.decodes, *map(MoveShape, self.moves)]


@dataclasses.dataclass(frozen=True)
class ShapeRules:
    """How a scheduler of `rows` decode rows in `groups` groups pads what it runs.

    microbatches: M, a prefill batch's row unit. C: seq devices. slots: S_loc, cache
    slots per device and row. max_seq_len: a request's prompt + new tokens at most.
    prefill_tokens: prompt tokens a round prefills at most. chunk_tokens: a long
    prompt's chunk (a multiple of 2C). block: the prefix cache's block (a multiple of 2C
    dividing chunk_tokens; `pipeline.batch.prefix`), None without one. decodes: False
    for a pooling runner, whose rounds only prefill (no decode chunk, no row move).
    replicas: D, the `data` replicas the rows are dealt to (`pipeline.batch.replicas`):
    every program runs on all of them at once, so a prefill's batch is D blocks of a
    microbatch unit each (a replica's prompts, padded), a decode chunk's rows D times a
    multiple of the groups, and prefill_tokens is each replica's."""

    rows: int
    groups: int
    microbatches: int
    C: int
    slots: int
    max_seq_len: int
    prefill_tokens: int
    chunk_tokens: int
    block: int | None = None
    decodes: bool = True
    replicas: int = 1

    @property
    def layout_block(self) -> int | None:
        """The block prompts are laid out by (`ring.zigzag_blocks`): the prefix cache's,
        on several `seq` devices (on one, every layout is position order)."""
        return self.block if self.C > 1 else None

    # ---- the padding the planner applies ------------------------------------------

    def prompt_length(self, tokens: int) -> int:
        """A short prompt's bucketed padded length (`layout.length_bucket` of 2C), at
        least MIN_PROMPT_TOKENS or half a row (the rest is its new tokens' room)."""
        return length_bucket(max(tokens, min(MIN_PROMPT_TOKENS, self.max_seq_len // 2)), 2 * self.C)

    def prefill_batch(self, n: int, P_pad: int) -> int:
        """Prompts of length bucket P_pad a replica prefills together from n waiting for
        it: the most that fill a bucketed batch without padding rows, a microbatch (M
        prompts) or as many as keep a microbatch within BATCHED_PREFILL_TOKENS."""
        M = self.microbatches
        return whole_batch(min(n, M * max(1, BATCHED_PREFILL_TOKENS // P_pad)), M)

    def prefill(self, n: int, longest: int, new_tokens: list[int]) -> PrefillShape:
        """The shape of a prefill of prompts of at most `longest` tokens, n at most on a
        replica, whose requests want `new_tokens`: bucketed rows and length where every
        request's new tokens still fit the row (a few compiled shapes), else its own."""
        M, D = self.microbatches, self.replicas
        if self.fits(self.prompt_length(longest), new_tokens):
            return PrefillShape(D * bucket(n, M), self.prompt_length(longest))
        return PrefillShape(D * math.ceil(n / M) * M, padded_length(longest, self.C))

    def fits(self, P_pad: int, new_tokens: list[int]) -> bool:
        """Whether prompts padded to P_pad leave each request's new tokens room in a
        row's cache slots."""
        return all(slots_per_device(P_pad, n, self.C) <= self.slots for n in new_tokens)

    def chunk(self, tokens: int, offset: int, new_tokens: int) -> PrefillShape:
        """A long prompt's chunk of `tokens` after `offset` local slots of earlier
        chunks: a whole chunk, or the last chunk's length bucket (one of few compiled
        shapes) where the row has room for it and the new tokens, else its own."""
        padded = min(self.prompt_length(tokens), self.chunk_tokens)
        if offset + slots_per_device(padded, new_tokens, self.C) > self.slots:
            padded = padded_length(tokens, self.C)
        return PrefillShape(self.unit, padded, with_context=offset > 0)

    @property
    def unit(self) -> int:
        """A prefill's fewest rows: a microbatch on every replica."""
        return self.replicas * self.microbatches

    def slots_taken(self, prompt_len: int, new_tokens: int) -> int:
        """The local cache slots a request takes on a device, padded as these rules pad
        it (no stand-in): its prompt (whole, or chunk by chunk) and its decode steps'."""
        if prompt_len <= self.chunk_tokens:
            P_pad = self.prefill(1, prompt_len, [new_tokens]).P_pad
            return slots_per_device(P_pad, new_tokens, self.C)
        done = offset = 0
        while done < prompt_len:
            tokens = min(self.chunk_tokens, prompt_len - done)
            offset += self.chunk(tokens, offset, new_tokens).P_pad // self.C
            done += tokens
        return offset + slots_per_device(0, new_tokens, self.C)

    def decode_rows(self, highest: int) -> int:
        """Rows a decode chunk runs over when row `highest` is the highest busy one: up
        to it, each replica's rounded up to the groups times a power of two (few
        programs), so a light load does not pay for every row's products."""
        D = self.replicas
        return min(self.rows, D * bucket(highest // D + 1, self.groups))

    def compact_below(self, most: int) -> int:
        """With `most` busy rows on the busiest replica, the rows a chunk could run over
        at fewest: requests above move down into free rows of their replica below it."""
        return self.replicas * bucket(most, self.groups)

    def prefill_stand_ins(
        self, shape: PrefillShape, new_tokens: list[int], offset: int = 0
    ) -> list[PrefillShape]:
        """The prefill shapes that can run `shape`'s prompts (or a long prompt's chunk
        after `offset` local slots), cheapest first (`shape` itself): the declared ones
        padded longer, up to STAND_IN_PADDING times, where each row still has room for
        its prompt and its `new_tokens`."""
        longer = [
            dataclasses.replace(s, prompt_logprobs=shape.prompt_logprobs)
            for s in self.declared().prefills
            if (s.B, s.with_context) == (shape.B, shape.with_context)
            and shape.P_pad < s.P_pad <= STAND_IN_PADDING * shape.P_pad
            and all(offset + slots_per_device(s.P_pad, n, self.C) <= self.slots for n in new_tokens)
        ]
        return [shape, *longer]

    def decode_stand_ins(self, shape: DecodeShape) -> list[DecodeShape]:
        """The decode shapes that can run `shape`'s chunk, cheapest first (`shape`
        itself): over as many rows or more (the rows past the busy ones idle), with
        log-probabilities where none are asked for."""
        return sorted(
            {shape}
            | {
                s
                for s in (*self.declared().decodes, *self.constrained_decodes())
                if s.rows >= shape.rows
                and s.logprobs >= shape.logprobs
                and s.sampled >= shape.sampled
                and s.constrained == shape.constrained  # a mask's chunk is of one step
            }
        )

    @staticmethod
    def moved(n: int) -> int:
        """Rows a move of n rows copies (a power of two: few programs)."""
        return bucket(n, 1)

    # ---- every shape those rules give --------------------------------------------

    def declared(self) -> DeclaredShapes:
        """Every program shape the rules above can give a round. Only a prompt whose
        bucket would leave its new tokens no room in the row (padded to its own length
        instead) still compiles a shape when met."""
        return self._declared

    @functools.cached_property
    def _declared(self) -> DeclaredShapes:
        short = min(self.max_seq_len - 1, self.chunk_tokens)  # a short prompt's tokens at most
        fewest = {}  # each length bucket a short prompt can take: its fewest tokens
        for n in range(short, 0, -1):
            fewest[self.prompt_length(n)] = n
        room = self.C * self.slots  # the longest padded prompt a row holds
        M, D, per = self.microbatches, self.replicas, self.rows // self.replicas
        prefills = {
            PrefillShape(D * B, P)
            for P in fewest
            if P <= room
            for B in {bucket(self.prefill_batch(n, P), M) for n in range(1, per + 1)}
            if B <= M or B * fewest[P] <= self.prefill_tokens
        }
        last = {min(self.prompt_length(n), self.chunk_tokens) for n in range(1, short + 1)}
        before = []  # the fewest tokens a chunk with context follows in its row
        if self.max_seq_len - 1 > self.chunk_tokens:  # long prompts go in chunks
            prefills.add(PrefillShape(self.unit, self.chunk_tokens))
            before.append(self.chunk_tokens)
        if self.block is not None and self.max_seq_len - 1 > self.block:
            before.append(self.block)  # a prefix cache's hit: its shared blocks
        if before:
            prefills |= {PrefillShape(self.unit, P, True) for P in last if P <= room - min(before)}
        rows = {self.decode_rows(b) for b in range(self.rows)} if self.decodes else set()
        decodes = {DecodeShape(n, True, logprobs) for n in rows for logprobs in (False, True)}
        moves = {
            self.moved(m)
            for most in range(1, per + 1)
            for m in range(1, min(D * most, self.rows - self.compact_below(most)) + 1)
            if self.decodes
        }
        return DeclaredShapes(tuple(sorted(prefills)), tuple(sorted(decodes)), tuple(sorted(moves)))

    def decode_row_counts(self) -> list[int]:
        """The row counts a decode chunk (or a verify pass) runs over."""
        return sorted({s.rows for s in self.declared().decodes})

    def constrained_decodes(self) -> list[DecodeShape]:
        """The decode chunks with allowed-token masks a structured output's rows run:
        over each row count, without log-probabilities (with them, rarer still, compiled
        when met)."""
        return [DecodeShape(n, True, False, True) for n in self.decode_row_counts()]

    # ---- which to compile first --------------------------------------------------

    def weight(self, shape: Shape) -> int:
        """How heavy a load must be to meet `shape` (a light one meets the lightest):
        the units of rows it needs busy at once (M prompts a prefill, G rows a decode;
        a move of n rows needs more than n busy) times its padded prompt tokens (at least
        a light prompt's), four times over for what few requests ask (log-probabilities,
        a long prompt's later chunks)."""
        light = self.prompt_length(LIGHT_TOKENS)
        if isinstance(shape, PrefillShape):
            units, tokens, rare = shape.B / self.unit, shape.P_pad, shape.with_context
        elif isinstance(shape, DecodeShape):
            units, tokens, rare = shape.rows / (self.replicas * self.groups), light, shape.logprobs
        else:
            units, tokens, rare = shape.rows + 1, light, False
        return math.ceil(units) * max(tokens, light) * (4 if rare else 1)

    def batched(self, shape: Shape) -> bool:
        """Whether `shape` prefills more prompts than a microbatch: the planner can
        prefill them a microbatch at a time while it is not compiled (`Planner.ready`)."""
        return isinstance(shape, PrefillShape) and shape.B > self.unit

    def cover(self) -> set[Shape]:
        """The few shapes that, compiled, stand in for all the others (but for prompts
        whose row has no room for a longer padding): the decode chunk over every row,
        with log-probabilities and without; prefills of a microbatch, with context and
        without, at a ladder of lengths each standing in for those down to
        1/STAND_IN_PADDING of it (below the top, each leaves a quarter of a row for new
        tokens); the prefix cache's copies."""
        programs, room = self.declared(), self.C * self.slots
        cover: set[Shape] = set(programs.decodes) & {
            DecodeShape(self.rows, True, lp) for lp in (False, True)
        }
        for context in (False, True):
            lengths = sorted(
                s.P_pad for s in programs.prefills if s.with_context == context and s.B == self.unit
            )
            while lengths:  # the longest within reach of the shortest left
                # that leaves a quarter of a row for new tokens (or the shortest itself)
                reach = min(STAND_IN_PADDING * lengths[0], max(lengths[0], 3 * room // 4))
                rung = max(P for P in lengths if P <= reach)
                cover.add(PrefillShape(self.unit, rung, context))
                lengths = [P for P in lengths if P > rung]
        return cover

    def first(self) -> tuple[list[Shape], list[Shape]]:
        """`declared()` in two: (what a server compiles before it serves: what a first
        light load meets, one request at a time, greedy or sampled, prompts of at most
        LIGHT_TOKENS tokens in one prefill, each prefill's batch of the fewest rows and
        the decode chunk over the fewest rows; and the `cover`, which stands in for
        every other shape until it compiles; the rest, compiled while it serves: the
        shapes no other stands in for at their own cost, then the batched prefills, each
        lightest first)."""
        light, cover = self.prompt_length(LIGHT_TOKENS), self.cover()
        shapes = sorted(
            self.declared().shapes(),
            key=lambda s: (self.batched(s), self.weight(s), type(s).__name__, s),
        )
        first = [s for s in shapes if self.weight(s) <= light or s in cover]
        return first, [s for s in shapes if s not in first]
