"""speculative_config's `draft_model`: a smaller Qwen3 with the target's vocabulary
proposes each row's drafts (issue 46).

Where it runs: on the target's own mesh, sharded as the target is (its layers over
`stage`, its K/V over `seq`, its heads over `tensor`), with a KV cache of as many rows
as the target's row book. No device is set apart or left idle, its rows are the book's
rows, and its weights are small beside the target's (0.6B beside 8B or 32B). The cost:
each of its steps crosses every stage, as a plain decode step does, so on S stages a
draft of k tokens takes k such trips before the verify pass.

Its passes are the verify program (`pipeline.speculative.verify`) on the draft model's weights,
each row's choice after the last token it feeds only (`last_only`). Its cache holds
each row's tokens as decode steps from position 0 (step j is position j, at
`ring.decode_slot(j, 0, C)`; no prompt layout), and `known[b]` remembers which tokens
row b's cache holds. The K/V at a position depends only on the tokens up to it, so the
valid part of a row's cache is the common prefix of `known[b]` with the row's tokens
now: a rejected draft, a request that ended and a row given to another request need
no message, only the slots past that prefix unlisted. A proposal over rows 0..n-1:

    catch up  each proposing row's tokens the cache lacks (a new request's whole
              prompt, then the tokens of the last pass), in passes of LENGTHS positions
              (a long one only where it is full);
              the output at the row's newest token is its first draft
    draft     k_b - 1 passes of one position, each feeding the previous draft

Each draft is drawn as the model draws at that step: with the row's sampling and its
key (seed, request, step), so the same Gumbel noise g that the model's draw
argmax(log p + g) adds (`jax.random.categorical`) picks argmax(log q + g) from the
draft model's q. The verify pass keeps a draft while it equals the model's draw, so
the tokens are plain sampling's whatever q is, and a draft model close to the model
is kept often: always when q = p, and with probability at least (1 - d)/(1 + d) for a
total variation distance d (Daliri, Musco and Suresh 2024, "Coupling without
communication"), against 1 - d for rejection sampling, which would not keep the seeded
tokens. Greedy rows draft the draft model's argmax.

A row under a constraint (structured outputs) draws each draft among the tokens its
grammar allows after the drafts before it (`Guide`: the row's grammar walked along the
drafts as they are drawn, and rolled back when the proposal is done), as the model's
constrained choice is masked, so its drafts pass the verify pass's grammar check.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np

from qwen3_spmd.pipeline.batch.rowbook import row_sampling
from qwen3_spmd.pipeline.programs.layout import list_decode_slots
from qwen3_spmd.pipeline.programs.sampling import RowSampling, Sampling
from qwen3_spmd.pipeline.runtime.registry import Stopwatch
from qwen3_spmd.pipeline.speculative.verify import VerifyInputs, VerifyShape, common_prefix
from qwen3_spmd.pipeline.structured.constraints import allows

if TYPE_CHECKING:
    from qwen3_spmd.pipeline.runtime.engine import Engine

CATCH_UP = 16  # the longest pass that may carry padding
# The pass lengths compiled: one (a draft step), a few (the catch-up after a verify
# pass: its kept tokens), CATCH_UP and a long one (a prompt). A pass wider than its
# tokens costs little where a step is bound by reading the weights, but a long one
# would cost its width in compute, so it runs only full: a prompt of 2,000 tokens takes
# 15 passes of 128 and 5 of 16, not 125 of 16, each a trip through the stages.
LENGTHS = (1, 4, CATCH_UP, 128)


def pass_length(n: int, lengths: tuple[int, ...] = LENGTHS) -> int:
    """The positions of the pass that feeds up to n tokens a row: the shortest of
    `lengths` that holds them, up to CATCH_UP; past it, the longest they fill (the
    first that many of them)."""
    if n <= CATCH_UP:
        return next(T for T in lengths if T >= n)
    return max(T for T in lengths if T <= n)


class Guide:
    """The grammars of a proposal's constrained rows ({b: RowMatcher}), walked along
    their drafts as the drafts are drawn and rolled back when the proposal is done:
    each draft is drawn among the tokens allowed after those before it, so a grammar
    steers a row's drafts rather than cutting them. `done`: rows whose answer a draft
    completed (they draft no further)."""

    def __init__(self, rows: dict, grammars):
        self.rows, self.grammars, self.done = rows, grammars, set()
        self._trials = contextlib.ExitStack()
        self._next: dict[int, np.ndarray] = {}  # row -> [W]: what its next draft may be

    def __enter__(self):
        for matcher in self.rows.values():
            self._trials.enter_context(matcher.trial())
        return self

    def __exit__(self, *exc):
        return self._trials.__exit__(*exc)

    def masks(self, n: int, T: int, pieces: dict, drawing) -> np.ndarray | None:
        """A pass's allowed tokens [n, T, W] (None with no constrained row): for each
        constrained row of `drawing` (those whose pass output is a draft), at its
        piece's last position, the tokens its grammar allows now; all elsewhere."""
        if not self.rows:
            return None
        allowed = np.full((n, T, self.grammars.words), -1, np.int32)
        for b in drawing:
            if b in self.rows:
                self.rows[b].fill(allowed[b], len(pieces[b]) - 1)
                self._next[b] = allowed[b, len(pieces[b]) - 1]
        return allowed

    def took(self, b: int, token: int) -> None:
        """Row b drew `token` as its next draft. One its grammar refuses (never drawn
        from its mask) is not taken, and the row drafts no further: the verify pass's
        check cuts it there."""
        if b not in self.rows:
            return
        if not allows(self._next[b], token) or self.rows[b].take(token):
            self.done.add(b)


class DraftModel:
    """Proposes drafts for the rows of a target's row book with `engine` (the draft
    model's Engine, on the target's mesh; its max_seq_len at least the target's)."""

    def __init__(self, engine: Engine, lengths: tuple[int, ...] = LENGTHS):
        self.engine = engine
        # Its passes' lengths: none past CATCH_UP that no prompt could fill.
        self.lengths = tuple(T for T in lengths if T <= max(CATCH_UP, engine.max_seq_len))
        self.cache = None  # the draft model's KV cache, made for the book's B rows
        self.slot_pos: np.ndarray | None = None  # [B, C, S_loc] host copy of cache.pos
        self.known: list[list[int]] = []  # [B] the tokens each row's cache holds

    def _fresh(self, B: int) -> None:
        copies = self.engine.copies
        self.cache = copies.empty_cache(B)
        self.slot_pos = np.full((B, copies.C, copies.slots_per_device), -1, np.int32)
        self.known = [[] for _ in range(B)]

    def propose(self, ctx, wants: dict[int, tuple], n: int) -> dict[int, list[int]]:
        """Each row b of `wants` ({b: (its tokens, prompt and generated; k_b >= 1)}, rows
        below n of ctx.book) -> its k_b drafts, fewer where its answer is done (a row
        under a constraint draws each draft among the tokens its grammar allows after
        the drafts before it). Runs the draft model's passes over rows 0..n-1 in the
        book's groups; their time goes to ctx.clock as decode time. ctx: the round's
        `speculator.SpecContext` (book, clock, the rows' grammars)."""
        book, clock = ctx.book, ctx.clock
        if self.cache is None or len(self.known) != book.B:
            self._fresh(book.B)
        watch = Stopwatch(clock)
        feed, drafts = {}, {b: [] for b in wants}
        for b, (context, _) in wants.items():
            # The newest token is always fed: its output is the first draft.
            valid = common_prefix(self.known[b], context[:-1])
            del self.known[b][valid:]
            self.slot_pos[b][self.slot_pos[b] >= valid] = -1
            feed[b] = list(context[valid:])
        rows = ctx.grammars
        grammars = {b: rows.of(book.rows[b].request) for b in wants} if rows else {}
        guide = Guide({b: g for b, g in grammars.items() if g is not None}, rows and rows.grammars)
        with guide:
            while any(feed.values()):  # catch up; a row's last piece gives its first draft
                T = pass_length(max(len(f) for f in feed.values()), self.lengths)
                pieces = {b: f[:T] for b, f in feed.items() if f}
                last = [b for b in pieces if len(feed[b]) == len(pieces[b])]
                out = self._pass(book, n, T, pieces, clock, guide.masks(n, T, pieces, last))
                for b, piece in pieces.items():
                    self.known[b] += piece
                    feed[b] = feed[b][len(piece) :]
                    if not feed[b]:
                        drafts[b].append(int(out[b, 0]))
                        guide.took(b, drafts[b][-1])
            while True:  # one position a pass: the previous draft in, the next out
                pieces = {
                    b: d[-1:]
                    for b, d in drafts.items()
                    if len(d) < wants[b][1] and b not in guide.done
                }
                if not pieces:
                    break
                out = self._pass(book, n, 1, pieces, clock, guide.masks(n, 1, pieces, pieces))
                for b, piece in pieces.items():
                    self.known[b] += piece
                    drafts[b].append(int(out[b, 0]))
                    guide.took(b, drafts[b][-1])
        clock.decode_s += watch.seconds()
        return drafts

    def compile(
        self,
        n: int,
        cache_rows: int,
        groups: int,
        sampled: bool,
        announce: bool,
        constrained: bool = False,
    ):
        """Compiles, unless compiled, the passes a proposal over n rows of a book of
        `cache_rows` rows in `groups` groups can run (one a length of its lengths),
        greedy or `sampled`, steered by grammars if `constrained`. Nothing runs."""
        eng = self.engine
        words = eng.mask_words if constrained else None
        for T in self.lengths:
            inputs = VerifyInputs.zeros(n, T, words).placed(eng.mesh)
            eng.programs.get(
                self._program(n, groups, T, sampled, constrained),
                eng.weights,
                eng.copies.abstract_cache(cache_rows),
                inputs,
                announce,
            )

    def _pass(self, book, n: int, T: int, pieces: dict[int, list[int]], clock, allowed):
        """One pass of the draft model over rows 0..n-1: row b feeds pieces[b] at the
        positions after its known tokens (rows without a piece run nothing), each
        position's token drawn as the model would draw it there (its request's sampling
        and key at that token's step), among the tokens `allowed` there ([n, T, W]
        bits, or None: any). Returns out [n, 1]: each row's token after its piece's
        last position (the pass computes no other)."""
        eng = self.engine
        tokens = np.zeros((n, T), np.int32)
        step = np.zeros(n, np.int32)
        count = np.zeros(n, np.int32)
        key_offset = np.zeros(n, np.int32)
        per_row = [(Sampling(), 0, 0)] * n
        for b, piece in pieces.items():
            request = book.rows[b].request
            tokens[b, : len(piece)] = piece
            step[b] = len(self.known[b])
            count[b] = len(piece)
            key_offset[b] = len(request.prompt)
            per_row[b] = row_sampling(request)
        zeros = np.zeros(n, np.int32)
        list_decode_slots(self.slot_pos, step, T, step + count, zeros, zeros)
        inputs = VerifyInputs.zeros(n, T)._replace(
            tokens=tokens,
            positions=step,
            step=step,
            count=count,
            sampling=RowSampling.stack(per_row),
            key_offset=key_offset,
            allowed=allowed,
        )
        sampled = bool((inputs.sampling.temperature > 0).any())
        cache = eng.copies.with_rows(self.cache, self.slot_pos)
        program = self._program(n, book.groups, T, sampled, allowed is not None)
        out, _, self.cache = eng.run_program(program, clock, cache, inputs.placed(eng.mesh))
        return np.asarray(out)

    def _program(
        self, n: int, groups: int, T: int, sampled: bool, constrained: bool
    ) -> VerifyShape:
        """A pass over n rows in `groups` groups: the verify program, each row's token
        after its last position only."""
        return VerifyShape(n, T, sampled, constrained, groups, last_only=True)
