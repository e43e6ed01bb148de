"""Speculative decoding carried out: a round's drafts checked in one verify pass (or a
loop of passes on the device), the longest run the model agrees with kept with the
model's own next token, the rest rolled back.

The planner decides how a round runs (`pipeline.speculative.policy.SpecPlan`); the
executor hands it to `Speculator.run` with a narrow context (the row book, the decode
accounting, the clock, the rows' grammars):

    drafts   the plan's (prompt lookup's, made on process 0), or a draft model's
             (`pipeline.speculative.draft_model`), cut where a row's grammar refuses;
    verify   one pass over [newest token, drafts] padded to the plan's width T:
             out[b, i], the token plain decoding would choose after position i
             (greedy, or drawn with the row's key at that step);
    accept   a_b = the longest prefix of the drafts equal to out[b, :k_b]; the row gets
             out[b, : a_b + 1], cut at its first end as a decode chunk's tokens are;
    roll back the slots of the rejected positions leave the row's listed slots.

The tokens are plain decoding's, seeded sampling's included: out[b, i] depends on the
row's tokens up to position p + i and its key (seed, request, step) only. For a drafter
that proposes one token, this acceptance is as likely as rejection sampling's; a draft
model draws its drafts with the same keys. Docs: docs/serving.md#speculative-decoding.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from qwen3_spmd.pipeline.batch.handles import Logprob
from qwen3_spmd.pipeline.batch.rowbook import Update, row_sampling
from qwen3_spmd.pipeline.programs.sampling import RowSampling, Sampling
from qwen3_spmd.pipeline.programs.schedule import decode_ticks
from qwen3_spmd.pipeline.runtime.registry import Clock, Stopwatch
from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig
from qwen3_spmd.pipeline.speculative.draft_model import DraftModel
from qwen3_spmd.pipeline.speculative.loop import LoopInputs, LoopShape
from qwen3_spmd.pipeline.speculative.policy import (
    MAX_WAIT,
    Pace,
    RoundRule,
    SpecPlan,
    SpecPolicy,
    ladder,
    pass_kind,
    step_kind,
    way_kind,
    widths,
)
from qwen3_spmd.pipeline.speculative.verify import VerifyInputs, VerifyShape, common_prefix
from qwen3_spmd.pipeline.structured.rows import RowGrammars

if TYPE_CHECKING:
    from qwen3_spmd.pipeline.batch.rowbook import RowBook
    from qwen3_spmd.pipeline.runtime.engine import Engine


@dataclasses.dataclass
class SpecMetrics:
    """Counts since start, as vLLM's spec_decode metrics: verify passes that carried
    drafts (a row each), draft tokens proposed, draft tokens accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def __add__(self, other: SpecMetrics) -> SpecMetrics:
        return SpecMetrics(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a row gets per verify pass that carried drafts: 1 + accepted/drafts."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class SpecContext(NamedTuple):
    """What a speculative round reads and writes besides the device: the row `book` (its
    methods are the writers), the decode `accounting` (pipeline.scheduling.planner's
    Accounting), the `clock`, and the rows' `grammars` (None: no row can have one)."""

    book: RowBook
    accounting: object
    clock: Clock
    grammars: RowGrammars | None


class Speculator:
    """Verify rounds on `engine`, as `config` drafts (a SpeculativeConfig, or any drafter
    with its `num_speculative_tokens` and `propose(context, k)`: the tests' and the
    benchmark's oracles), or `drafter` (a DraftModel, which proposes for all rows at
    once). `policy` decides the rounds (the planner asks it); `run` carries one out.
    The compiled programs are the engine's, so a new Speculator over the same engine
    compiles nothing again."""

    def __init__(self, engine: Engine, config, drafter: DraftModel | None = None):
        self.engine, self.config, self.drafter = engine, config, drafter
        self.metrics = SpecMetrics()
        self.policy = SpecPolicy(config, draft_model=drafter is not None)

    @property
    def rule(self) -> RoundRule:
        """The round rule the policy reads and the runs measure."""
        return self.policy.rule

    @rule.setter
    def rule(self, rule: RoundRule) -> None:
        self.policy.rule = rule

    # ---- compiling ---------------------------------------------------------------------

    def _loop_program(self, rows: int, groups: int, sampled: bool) -> LoopShape:
        """The loop of rounds over `rows` rows in `groups` groups, as the config drafts."""
        c = self.config
        return LoopShape(
            rows,
            groups,
            widths(c.num_speculative_tokens),
            sampled,
            c.prompt_lookup_max,
            c.prompt_lookup_min,
            c.num_speculative_tokens,
            MAX_WAIT,
        )

    def shapes(self, row_counts: list[int], constrained: bool = False) -> list[VerifyShape]:
        """Every verify pass a scheduler whose decode chunks run over `row_counts` rows
        can meet (T: 1 + each of the ladder's draft counts), likeliest first: fewest
        rows, fewest positions, greedy before sampled; then, with `constrained` (a
        server that takes structured outputs), the same passes under a grammar."""
        k = self.config.num_speculative_tokens
        return [
            VerifyShape(n, 1 + d, sampled, masked)
            for masked in sorted({False, constrained})
            for n in sorted(row_counts)
            for d in ladder(k)
            for sampled in (False, True)
        ]

    def compile(
        self, shape: VerifyShape, cache_rows: int, pages: int | None, groups: int, announce: bool
    ) -> None:
        """Compiles, unless compiled, the verify pass of `shape` on a cache of
        `cache_rows` rows (on a pool of `pages` pages) in `groups` groups (what `run` would meet), a draft model's
        passes over as many rows, and at the widest pass the loop of passes. Nothing
        runs."""
        eng, n = self.engine, shape.rows
        if self.drafter is not None:
            self.drafter.compile(n, cache_rows, groups, shape.sampled, announce, shape.constrained)
        words = eng.mask_words if shape.constrained else None
        inputs = VerifyInputs.zeros(n, shape.T, words).placed(eng.mesh)
        eng.programs.get(
            dataclasses.replace(shape, groups=groups),
            eng.weights,
            eng.copies.abstract_cache(cache_rows, pages),
            inputs,
            announce,
        )
        ws = widths(self.config.num_speculative_tokens)
        if self.policy.loops() and shape.T == ws[-1] and not shape.constrained:
            zeros = LoopInputs.zeros(n, shape.T, eng.max_seq_len, len(ws))
            eng.programs.get(
                self._loop_program(n, groups, shape.sampled),
                eng.weights,
                eng.copies.abstract_cache(cache_rows, pages),
                zeros.placed(eng.mesh),
                announce,
            )

    # ---- running a round ---------------------------------------------------------------

    def saw_steps(self, n: int, seconds: float) -> None:
        """A plain decode chunk over n rows took `seconds` a step (the round rule's
        measure of the alternative to a pass)."""
        self.rule.saw(step_kind(n), seconds)

    def run(self, ctx: SpecContext, cache, n: int, plan: SpecPlan) -> tuple[list[Update], object]:
        """The round `plan` over rows 0..n-1 of ctx.book on `cache` (donated): (every
        live row's new tokens, 1 .. k_b + 1 each per pass, its end, its rejected slots
        unlisted; the cache)."""
        book, k = ctx.book, self.config.num_speculative_tokens
        watch = Stopwatch(ctx.clock)
        live = [b for b in book.live() if b < n]
        for b in live:
            book.rows[b].pace = book.rows[b].pace or Pace(k)
        drafts = {b: [] for b in live}
        if plan.asks:
            wants = {b: (_context(book.rows[b]), k_b) for b, k_b in plan.asks}
            drafts.update(self.drafter.propose(ctx, wants, n))
        else:
            drafts.update((b, list(d)) for b, d in plan.drafts)
        allowed = None
        if ctx.grammars is not None:
            requests = [book.rows[b].request if b in drafts else None for b in range(n)]
            cut, allowed = ctx.grammars.check_drafts(
                requests, [drafts.get(b, []) for b in range(n)], k + 1
            )
            for b in drafts:  # refused at once: a pass that kept nothing
                if drafts[b] and not cut[b]:
                    book.rows[b].pace.after(0, 1, k, len(book.rows[b].generated))
                drafts[b] = cut[b]
        if plan.rounds > 1:
            updates, cache = self._loop(ctx, cache, n, drafts, plan)
        else:
            updates, cache = self._verify(ctx, cache, n, drafts, plan.T, allowed)
            # The round's time: its drafting (a draft model's), the pass, the booking.
            self.rule.saw(pass_kind(n, plan.T), watch.seconds())
        if plan.rounds > 1 or plan.host_way:
            tokens = max(1, sum(len(u.tokens) for u in updates))
            self.rule.saw(way_kind(n, plan.rounds > 1), watch.seconds() / tokens)
        return updates, cache

    def _loop(self, ctx: SpecContext, cache, n: int, drafts: dict, plan: SpecPlan):
        """`plan.rounds` rounds of passes on the device, drafting between them there, the
        first `drafts`; the same booking as `_verify`'s, over the chunk."""
        eng, book = self.engine, ctx.book
        live = sorted(drafts)
        H = eng.max_seq_len
        T = widths(self.config.num_speculative_tokens)[-1]
        feed = _feed(book, n, drafts, T)
        limit, length, reach = (np.zeros(n, np.int32) for _ in range(3))
        context = np.zeros((n, H), np.int32)
        so_far = np.zeros((n + 1, 2), np.int32)
        so_far[n] = plan.overall
        pace = np.zeros((n, 3), np.int32)
        for b in live:
            row = book.rows[b]
            limit[b] = row.request.params.max_new_tokens - 1
            tokens_so_far = _context(row)
            context[b, : len(tokens_so_far)] = tokens_so_far
            length[b] = len(tokens_so_far)
            reach[b] = min(row.steps_left, plan.rounds * T)
            so_far[b] = row.pace.drafted, row.pace.kept
            pace[b] = row.pace.k, row.pace.misses, row.pace.wait_until
        book.list_ahead(feed.step, reach, feed.prompt_slots, n)
        inputs = LoopInputs(
            tokens=feed.tokens,
            count=feed.count,
            step=feed.step,
            offset=book.lengths[:n].astype(np.int32),
            limit=limit,
            prompt_slots=feed.prompt_slots,
            sampling=feed.sampling,
            context=context,
            length=length,
            so_far=so_far,
            pass_seconds=np.array(plan.pass_seconds, np.float32),
            pace=pace,
            rounds=np.int32(plan.rounds),
        ).placed(eng.mesh)
        cache = eng.copies.with_rows(cache, book.slot_pos, book.table)
        sampled = any(book.rows[b].request.params.sampling.temperature > 0 for b in live)
        watch = Stopwatch(ctx.clock)
        program = self._loop_program(n, book.groups, sampled)
        out, cache = eng.run_program(program, ctx.clock, cache, inputs)
        out = jax.tree.map(np.asarray, out)
        ctx.clock.decode_s += watch.seconds()
        _count_passes(ctx, eng.stages, plan.rounds, T)
        updates = []
        for b in live:
            row = book.rows[b]
            drafted, kept = int(out.drafted[b]), int(out.kept[b])
            self.metrics.drafts += int(out.passes[b])
            self.metrics.draft_tokens += drafted
            self.metrics.accepted_tokens += kept
            self.rule.passed(drafted, kept)
            made = out.tokens[b, : out.made[b]]
            pace = row.pace  # as the last stage kept it
            pace.k, pace.misses, pace.wait_until = map(int, out.pace[b])
            pace.drafted += drafted
            pace.kept += kept
            updates.append(_extend(ctx, b, made))
        return updates, cache

    def _verify(self, ctx: SpecContext, cache, n: int, drafts: dict, T: int, allowed):
        """One verify pass of width T over rows 0..n-1 of ctx.book with each live row's
        `drafts`, each position's choice within `allowed` ([n, k + 1, W] bits, or
        None): (every live row's update, the cache)."""
        eng, book = self.engine, ctx.book
        k = self.config.num_speculative_tokens
        live = sorted(drafts)
        feed = _feed(book, n, drafts, T)
        book.list_ahead(feed.step, feed.count, feed.prompt_slots, n)
        constrained = allowed is not None
        inputs = VerifyInputs(
            tokens=feed.tokens,
            positions=book.lengths[:n] + feed.step,
            step=feed.step,
            count=feed.count,
            prompt_slots=feed.prompt_slots,
            sampling=feed.sampling,
            key_offset=np.zeros(n, np.int32),
            allowed=allowed[:, :T] if constrained else None,
        ).placed(eng.mesh)
        cache = eng.copies.with_rows(cache, book.slot_pos, book.table)
        params = [book.rows[b].request.params for b in live]
        sampled = any(p.sampling.temperature > 0 for p in params)
        logprobs = any(p.logprobs for p in params)
        watch = Stopwatch(ctx.clock)
        # Compiled once per shape, float32 at full precision, compile time counted
        # apart from the pass's (as the engine's own programs).
        program = VerifyShape(n, T, sampled, constrained, book.groups, logprobs)
        out, lp, cache = eng.run_program(program, ctx.clock, cache, inputs)
        out = np.asarray(out)
        lp = jax.tree.map(np.asarray, lp)
        ctx.clock.decode_s += watch.seconds()
        _count_passes(ctx, eng.stages, 1, T)
        updates = []
        for b in live:
            d = drafts[b]
            agreed = common_prefix(d, out[b])
            row = book.rows[b]
            request = row.request
            if d:
                self.metrics.drafts += 1
                self.metrics.draft_tokens += len(d)
                self.metrics.accepted_tokens += agreed
                row.pace.after(agreed, len(d), k, len(row.generated) + agreed + 1)
                self.rule.passed(len(d), agreed)
            kept, done = out[b, : agreed + 1].tolist(), False
            if ctx.grammars is not None:
                kept, done = ctx.grammars.take_run(request, kept)
            update = _extend(ctx, b, kept, done)
            if request.params.logprobs:  # each kept token's, as the pass computed it
                update.logprobs = [
                    Logprob(
                        float(lp.chosen[b, i]),
                        [(int(t), float(v)) for t, v in zip(lp.top_ids[b, i], lp.top[b, i])],
                    )
                    for i in range(len(update.tokens))
                ]
            updates.append(update)
        return updates, cache


def _context(row) -> tuple[int, ...]:
    """A row's tokens so far: its prompt, then what it generated."""
    return row.request.prompt + tuple(row.generated)


class Feed(NamedTuple):
    """What a pass feeds rows 0..n-1 (host arrays): `tokens` [n, T], each live row's
    newest token then its drafts; its decode `step` j [n] (step j feeds token j), the
    `count` of its tokens [n] (0: an empty row, which runs nothing), its prompt's local
    slots [n], its `sampling` (RowSampling of [n])."""

    tokens: np.ndarray
    step: np.ndarray
    count: np.ndarray
    prompt_slots: np.ndarray
    sampling: RowSampling


def _feed(book, n: int, drafts: dict[int, list[int]], T: int) -> Feed:
    """The Feed of `book`'s rows 0..n-1 with their `drafts` ({b: drafts} of the live)."""
    tokens = np.zeros((n, T), np.int32)
    step, count, prompt_slots = (np.zeros(n, np.int32) for _ in range(3))
    per_row = [(Sampling(), 0, 0)] * n
    for b, d in drafts.items():
        row = book.rows[b]
        fed = [row.generated[-1], *d]
        tokens[b, : len(fed)] = fed
        step[b] = len(row.generated) - 1
        count[b] = len(fed)
        prompt_slots[b] = row.prompt_slots
        per_row[b] = row_sampling(row.request)
    return Feed(tokens, step, count, prompt_slots, RowSampling.stack(per_row))


def _count_passes(ctx: SpecContext, stages: int, passes: int, T: int) -> None:
    """The accounting after `passes` passes of T positions in a row (one program's,
    scheduled as a decode chunk of as many steps)."""
    acc, book = ctx.accounting, ctx.book
    acc.row_steps += book.B * passes
    ticks = decode_ticks(book.groups, stages, passes)
    acc.decode_ticks += ticks
    acc.verify_ticks += ticks
    acc.verify_positions += ticks * T


def _extend(ctx: SpecContext, b: int, tokens, done: bool = False) -> Update:
    """Row b's kept tokens booked (`RowBook.extend`), its slots past them unlisted
    unless it ended, and the accounting's busy steps and early ends."""
    book, acc = ctx.book, ctx.accounting
    update = book.extend(b, tokens, done)
    if update.finish_reason is None:
        book.roll_back(b)
    acc.busy_row_steps += len(update.tokens)
    acc.early_ends += update.finish_reason == "stop"
    return update


def make_speculator(engine: Engine, config, draft: Engine | None = None) -> Speculator | None:
    """The Speculator of `config` on `engine` (a SpeculativeConfig, or its JSON or mapping:
    vLLM's speculative_config; None: plain decoding, None back); `draft`: the draft
    model's Engine on the same mesh, for method "draft_model"."""
    spec = SpeculativeConfig.parse(config)
    if spec is None:
        return None
    if (spec.method == "draft_model") != (draft is not None):
        raise ValueError(
            f"method {spec.method!r} takes a draft Engine exactly when it is draft_model"
        )
    return Speculator(engine, spec, DraftModel(draft) if draft is not None else None)
