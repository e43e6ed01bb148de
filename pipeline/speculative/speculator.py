"""Speculative decoding: propose k tokens a row cheaply, check them in one verify pass,
keep the longest run the model agrees with and the model's own next token.

`SpeculativeConfig` (`pipeline.speculative.config`) is vLLM's `speculative_config`.
`Speculator` runs a decode round as a verify round (`pipeline.speculative.verify`) over the row
book's rows:

    drafts   each row's proposal from its tokens so far (`pipeline.speculative.ngram`), k_b <= k
             tokens, fewer near the row's max_tokens (it may produce k_b + 1 at most)
             and as the row's `Pace` allows;
    verify   one pass over [newest token, drafts] (padded to the next of the k ladder
             1, 2, 4, .., k, so a pass of short drafts costs less): out[b, i], the
             token plain decoding would choose after position i (greedy, or drawn
             with the row's key at that step);
    accept   a_b = the longest prefix of the drafts equal to out[b, :k_b]; the row gets
             out[b, : a_b + 1] (the agreed drafts, then the model's token after them),
             cut at its first end as a decode chunk's tokens are (`RowBook.extend`);
    roll back the slots of the rejected positions leave the row's listed slots.

The tokens are plain decoding's, seeded sampling's included: out[b, i] depends on the
row's tokens up to position p + i and its key (seed, request, step) only, and for every
kept i those tokens are the plain run's. For a drafter that proposes one token (not a
distribution), as ngram does, this acceptance is as likely as rejection sampling's: a
draft d is kept with probability P(the draw is d) = p(d) = min(1, p(d) / q(d)) for
q one-hot at d. A draft model draws its drafts with the same keys
(`pipeline.speculative.draft_model`), so its draft is kept where its draw agrees with the model's.
A kept token's log-probabilities (when its request asks) are those the pass computed
at its position.

A row under a constraint (structured outputs) drafts only what its grammar allows: its
drafts are cut at the first the grammar refuses (`RowMatcher.along`), and the pass
masks each position's choice with the tokens allowed after the drafts before it, as a
constrained decode chunk masks its step's. Its kept tokens then advance the grammar one
by one, and the row ends where its answer is done.

A pass of k + 1 positions costs more than a plain step (on a 2-core CPU, 0.6B float32:
about a fifth of a step more per position, docs/benchmarks.md), so drafts that are
rejected are paid for. Each request's `Pace` drafts as far as its last pass earned
(twice the run it kept, at most k) and, after a pass that kept nothing, waits 2, 4,
.. 64 tokens before it proposes again. A round where no row proposes runs as a plain
decode chunk (up to the next row's turn, at least k + 1 steps), so a drafter that is
always wrong costs one pass now and then. The pace depends on the tokens only, so
every process of a job paces alike.

A pass is the round's, so every live row pays for its positions while any row
proposes. The round rule (`pipeline.speculative.round_rule`) runs the pass length, or the plain
chunk, expected to give the most tokens a second by the rows' drafts, their kept
fractions and the rounds' measured times.

With prompt lookup, a round whose chunk is expected to take several passes (by the
fraction of drafts kept so far, `RoundRule.loop_rounds`) loops on the device
(`pipeline.speculative.loop`): the last stage accepts, looks up the next drafts and sends
them back to stage 0 itself, and the host books the chunk's tokens at its end. The
host's drafts start it; the last stage paces the rows and chooses each later round's
width as the host would. Whether a round loops or runs one pass is measured too
(`RoundRule.on_device`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from qwen3_spmd.pipeline.batch.handles import Logprob
from qwen3_spmd.pipeline.batch.rowbook import Update, row_sampling
from qwen3_spmd.pipeline.programs.sampling import RowSampling, Sampling
from qwen3_spmd.pipeline.programs.schedule import decode_ticks
from qwen3_spmd.pipeline.runtime.registry import Stopwatch
from qwen3_spmd.pipeline.speculative.draft_model import DraftModel
from qwen3_spmd.pipeline.speculative.loop import MAX_ROUNDS, LoopInputs, LoopShape
from qwen3_spmd.pipeline.speculative.round_rule import RoundRule, pass_kind, step_kind, way_kind
from qwen3_spmd.pipeline.speculative.verify import VerifyInputs, VerifyShape, common_prefix

if TYPE_CHECKING:
    from qwen3_spmd.pipeline.runtime.engine import Engine
    from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig


# The longest wait (tokens) after passes that kept no draft: a request whose drafter
# has started to agree is probed again within this many tokens.
MAX_WAIT = 64


@dataclasses.dataclass
class Pace:
    """How far a request drafts: `k` drafts its next pass may propose, and after
    `misses` passes in a row that kept none, no proposal before it has `wait_until`
    tokens. `drafted` and `kept`: its drafts so far, and how many were kept (the round
    rule's expectation, `pipeline.speculative.round_rule`)."""

    k: int
    misses: int = 0
    wait_until: int = 0
    drafted: int = 0
    kept: int = 0

    def after(self, kept: int, drafted: int, k_max: int, tokens: int) -> None:
        """The pass kept `kept` of the `drafted` drafts it proposed; the row now has
        `tokens`."""
        self.drafted += drafted
        self.kept += kept
        if kept == 0:
            self.misses += 1
            self.k = 1
            self.wait_until = tokens + min(2**self.misses, MAX_WAIT)
        else:
            self.misses = 0
            self.k = min(k_max, 2 * kept)

    def waits(self, tokens: int) -> int:
        """Tokens before it may propose again (0: now)."""
        return max(0, self.wait_until - tokens)


def ladder(k: int) -> list[int]:
    """The draft counts a verify pass is compiled for: 1, 2, 4, .. below k, and k."""
    return sorted({min(k, 2**i) for i in range(k.bit_length() + 1)})


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


class Proposal(NamedTuple):
    """A round's drafts: `tokens`, each live row's (empty where it proposes none), and
    `allowed`, the tokens its constraint allows at each position of a pass after the
    drafts before it ([rows, k + 1, W] int32 bits; `pipeline.structured.constraints`), or None
    when no row has a constraint."""

    tokens: dict[int, list[int]]
    allowed: np.ndarray | None = None


class Speculator:
    """Verify rounds on `engine` for the rows of an executor's book, as `config` drafts
    (a SpeculativeConfig, or any drafter with its `num_speculative_tokens` and
    `propose(context, k)`: the tests' and the benchmark's oracles), or `drafter` (a
    `pipeline.speculative.draft_model.DraftModel`, which proposes for all rows at once). The
    compiled verify programs are the engine's (`Engine.programs`, keyed by VerifyShape
    and LoopShape): a caller may change `config` (and reset `metrics`) between rounds."""

    def __init__(self, engine: Engine, config: SpeculativeConfig, drafter=None):
        self.engine, self.config, self.drafter = engine, config, drafter
        self.metrics = SpecMetrics()
        self.rule = RoundRule()  # pipeline.speculative.round_rule: a pass or a plain chunk
        self._watch = None  # since this round's drafting: its pass's time

    def takes(self, with_logits: bool, live: int) -> bool:
        """Whether a decode chunk over `live` busy rows may run as a verify round: no
        per-step logits are asked (`with_logits`), and no more rows are busy than the
        config's disable_by_batch_size (any count for a drafter without one)."""
        if with_logits:
            return False
        bound = getattr(self.config, "disable_by_batch_size", None)
        return bound is None or live <= bound

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

    def compile(self, shape: VerifyShape, cache_rows: int, groups: int, announce: bool) -> None:
        """Compiles, unless compiled, the verify pass of `shape` on a cache of
        `cache_rows` rows in `groups` groups (what `verify` would meet), and a draft
        model's passes over as many rows. Nothing runs."""
        eng, n = self.engine, shape.rows
        if self.drafter is not None:
            self.drafter.compile(n, cache_rows, groups, shape.sampled, announce, shape.constrained)
        words = eng.mask_words if shape.constrained else None
        inputs = VerifyInputs.zeros(n, shape.T, words).placed(eng.mesh)
        eng.programs.get(
            dataclasses.replace(shape, groups=groups),
            eng.weights,
            eng.copies.abstract_cache(cache_rows),
            inputs,
            announce,
        )
        widths = self._widths()
        if self._loops() and shape.T == widths[-1] and not shape.constrained:
            zeros = LoopInputs.zeros(n, shape.T, eng.max_seq_len, len(widths))
            eng.programs.get(
                self._loop_program(n, groups, shape.sampled),
                eng.weights,
                eng.copies.abstract_cache(cache_rows),
                zeros.placed(eng.mesh),
                announce,
            )

    def drafts(self, executor, n: int) -> Proposal:
        """Each live row below n of `executor`'s book: its proposal (empty where its pace
        says wait, or the drafter has none), at most k and one less than the tokens it
        may still make, and no further than its constraint allows, then cut to the pass
        the round rule chooses (none at all: a plain chunk; `pipeline.speculative.round_rule`). A
        draft model's drafts are chosen before they are made, on the counts the rows'
        paces ask (its passes cost), others' on the drafts made. A proposal the
        constraint refuses at once counts as a pass that kept nothing (its pace waits)."""
        book = executor.book
        k = self.config.num_speculative_tokens
        self.rule.tick()
        out, wants = {}, {}
        for b in (b for b in book.live() if b < n):
            row = book.rows[b]
            if row.pace is None:
                row.pace = Pace(k)
            pace = row.pace
            # It may produce steps_left more tokens: k_b drafts give k_b + 1 at most.
            k_b = min(pace.k, k, row.steps_left - 1)
            out[b] = []
            if k_b > 0 and not pace.waits(len(row.generated)):
                wants[b] = (row.request.prompt + tuple(row.generated), k_b)
        if self.drafter is not None:
            T = self._choose(book, n, {b: k_b for b, (_, k_b) in wants.items()})
            wants = {b: (c, min(k_b, T - 1)) for b, (c, k_b) in wants.items() if T > 1}
            self._watch = Stopwatch(executor.clock)
            if wants:
                out.update(self.drafter.propose(executor, wants, n))
        else:
            for b, (context, k_b) in wants.items():
                out[b] = list(self.config.propose(context, k_b))[:k_b]
        requests = [book.rows[b].request if b in out else None for b in range(n)]
        cut, allowed = executor.draft_masks(requests, [out.get(b, []) for b in range(n)], k + 1)
        for b in out:
            row = book.rows[b]
            if out[b] and not cut[b]:
                row.pace.after(0, 1, k, len(row.generated))
            out[b] = cut[b]
        if self.drafter is None:
            T = self._choose(book, n, {b: len(d) for b, d in out.items()})
            out = {b: d[: T - 1] for b, d in out.items()}
            self._watch = Stopwatch(executor.clock)
        return Proposal(out, allowed)

    def _choose(self, book, n: int, drafts: dict[int, int]) -> int:
        """The round rule's pass length for rows 0..n-1 of `book`, whose live rows would
        draft `drafts` ({b: d_b}, some 0) tokens: 1 (a plain chunk) when none would."""
        longest = max(drafts.values(), default=0)
        if longest == 0:
            return 1
        k = self.config.num_speculative_tokens
        ask = min(x for x in ladder(k) if x >= longest)
        rows = []
        for b in (b for b in book.live() if b < n):
            pace = book.rows[b].pace
            rows.append((drafts.get(b, 0), self.rule.fraction(pace.drafted, pace.kept)))
        lengths = [1 + x for x in ladder(k) if x <= ask]
        return self.rule.choose(n, rows, lengths)

    def plain_steps(self, book, n: int, steps: int) -> int:
        """Steps of the plain decode chunk a round runs when no row proposes: `steps` (the
        planner's), cut at the first row's turn to propose again, but at least k + 1 (a
        drafter with nothing now may have something a token later)."""
        k = self.config.num_speculative_tokens
        rows = [book.rows[b] for b in book.live() if b < n]
        turns = [row.pace.waits(len(row.generated)) for row in rows if row.pace is not None]
        return min(steps, max(k + 1, min(turns, default=steps)))

    def run(self, executor, n: int, proposal: Proposal, steps: int) -> list[Update]:
        """The round over rows 0..n-1 of `executor`'s book with `proposal`'s drafts: one
        verify pass, or, where the drafter can run on the device (prompt lookup, no row
        asking log-probabilities or under a constraint) and the planner's chunk of
        `steps` steps is expected to take more than one pass, a loop of passes there
        (`pipeline.speculative.loop`), the proposal its first round's drafts."""
        T = self._pass_length(proposal)
        book = executor.book
        live = sorted(proposal.tokens)
        rounds = min(
            MAX_ROUNDS,
            self.rule.loop_rounds(steps, T),
            max(book.rows[b].steps_left for b in live),  # each round gives a row a token
        )
        asks = any(book.rows[b].request.params.logprobs for b in live)
        if not self._loops() or rounds < 2 or proposal.allowed is not None or asks:
            return self.verify(executor, n, proposal)
        if not self.rule.on_device(n):  # measured: the host's passes give tokens faster
            return self._measured(n, False, self.verify(executor, n, proposal))
        return self._measured(n, True, self._loop(executor, n, proposal, rounds))

    def _measured(self, n: int, on_device: bool, updates: list[Update]) -> list[Update]:
        """`updates`, the round's, after the round rule saw its seconds a token."""
        tokens = max(1, sum(len(u.tokens) for u in updates))
        self.rule.saw(way_kind(n, on_device), self._watch.seconds() / tokens)
        return updates

    def _loops(self) -> bool:
        """Whether rounds may run as loops on the device: the drafter is prompt lookup
        (which the device runs too); whether they do is the round rule's."""
        return getattr(self.config, "method", None) == "ngram" and self.drafter is None

    def _pass_length(self, proposal: Proposal) -> int:
        """T of the pass that carries `proposal`: 1 + the ladder's count for its longest."""
        longest = max(map(len, proposal.tokens.values()), default=0)
        return 1 + min(x for x in ladder(self.config.num_speculative_tokens) if x >= longest)

    def _widths(self) -> tuple[int, ...]:
        """The pass widths a loop of rounds chooses among: 1 (a step), 1 + the ladder."""
        return (1, *(1 + x for x in ladder(self.config.num_speculative_tokens)))

    def _loop_program(self, rows: int, groups: int, sampled: bool) -> LoopShape:
        """The loop of rounds over `rows` rows in `groups` groups, as the config drafts."""
        c = self.config
        return LoopShape(
            rows,
            groups,
            self._widths(),
            sampled,
            c.prompt_lookup_max,
            c.prompt_lookup_min,
            c.num_speculative_tokens,
            MAX_WAIT,
        )

    def _pass_seconds(self, n: int) -> np.ndarray:
        """Each loop width's measured seconds over n rows (width 1: a plain step's; 0
        where unmeasured), as the round rule reads them."""
        kinds = [pass_kind(n, w) if w > 1 else step_kind(n) for w in self._widths()]
        return np.array([self.rule.seconds(kind) or 0.0 for kind in kinds], np.float32)

    def _loop(self, executor, n: int, proposal: Proposal, rounds: int) -> list[Update]:
        """`rounds` rounds of passes on the device, drafting between them there, the
        first `proposal`'s; the same bookkeeping as `verify`'s, over the chunk."""
        eng, book = self.engine, executor.book
        live = sorted(proposal.tokens)
        H = eng.max_seq_len
        T = self._widths()[-1]
        feed = _feed(book, n, proposal.tokens, T)
        limit, length, reach = (np.zeros(n, np.int32) for _ in range(3))
        context = np.zeros((n, H), np.int32)
        so_far = np.zeros((n + 1, 2), np.int32)
        so_far[n] = self.rule.drafted, self.rule.kept
        pace = np.zeros((n, 3), np.int32)
        for b in live:
            row = book.rows[b]
            limit[b] = row.request.params.max_new_tokens - 1
            tokens_so_far = row.request.prompt + tuple(row.generated)
            context[b, : len(tokens_so_far)] = tokens_so_far
            length[b] = len(tokens_so_far)
            reach[b] = min(row.steps_left, rounds * T)
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
            pass_seconds=self._pass_seconds(n),
            pace=pace,
            rounds=np.int32(rounds),
        ).placed(eng.mesh)
        cache = eng.copies.with_slot_pos(executor.cache, book.slot_pos)
        sampled = any(book.rows[b].request.params.sampling.temperature > 0 for b in live)
        clock = executor.clock
        watch = Stopwatch(clock)
        out, executor.cache = eng.run_program(
            self._loop_program(n, book.groups, sampled), clock, cache, inputs
        )
        out = jax.tree.map(np.asarray, out)
        clock.decode_s += watch.seconds()
        _count_passes(executor, eng.stages, rounds, T)
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
            updates.append(_extend(executor, b, made))
        return updates

    def verify(self, executor, n: int, proposal: Proposal) -> list[Update]:
        """One verify round over rows 0..n-1 of `executor`'s book (a pipeline.scheduling.executor
        Executor, which calls this, so it is not imported here) with each live row's
        drafts (`proposal`): every live row's new tokens (1 .. k_b + 1 each), its end,
        its rejected slots unlisted."""
        eng, book = self.engine, executor.book
        k = self.config.num_speculative_tokens
        drafts = proposal.tokens
        T = self._pass_length(proposal)
        live = sorted(drafts)
        feed = _feed(book, n, drafts, T)
        book.list_ahead(feed.step, feed.count, feed.prompt_slots, n)
        constrained = proposal.allowed is not None
        inputs = VerifyInputs(
            tokens=feed.tokens,
            positions=book.lengths[:n] + feed.step,
            step=feed.step,
            count=feed.count,
            prompt_slots=feed.prompt_slots,
            sampling=feed.sampling,
            key_offset=np.zeros(n, np.int32),
            allowed=proposal.allowed[:, :T] if constrained else None,
        ).placed(eng.mesh)
        cache = eng.copies.with_slot_pos(executor.cache, book.slot_pos)
        params = [book.rows[b].request.params for b in live]
        sampled = any(p.sampling.temperature > 0 for p in params)
        logprobs = any(p.logprobs for p in params)
        clock = executor.clock
        watch = Stopwatch(clock)
        # Compiled once per shape, float32 at full precision, compile time counted
        # apart from the pass's (as the engine's own programs).
        program = VerifyShape(n, T, sampled, constrained, book.groups, logprobs)
        out, lp, executor.cache = eng.run_program(program, clock, cache, inputs)
        out = np.asarray(out)
        lp = jax.tree.map(np.asarray, lp)
        clock.decode_s += watch.seconds()
        _count_passes(executor, eng.stages, 1, T)
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
            kept, done = executor.advance_along(request, out[b, : agreed + 1])
            update = _extend(executor, b, kept, done)
            if request.params.logprobs:  # each kept token's, as the pass computed it
                update.logprobs = [
                    Logprob(
                        float(lp.chosen[b, i]),
                        [(int(t), float(v)) for t, v in zip(lp.top_ids[b, i], lp.top[b, i])],
                    )
                    for i in range(len(update.tokens))
                ]
            updates.append(update)
        # The round's time, its drafting (a draft model's), the pass and its bookkeeping.
        self.rule.saw(pass_kind(n, T), self._watch.seconds())
        return updates


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


def _count_passes(executor, stages: int, passes: int, T: int) -> None:
    """The executor's accounting after `passes` passes of T positions in a row (one
    program's, scheduled as a decode chunk of as many steps)."""
    acc, book = executor.accounting, executor.book
    acc.row_steps += book.B * passes
    ticks = decode_ticks(book.groups, stages, passes)
    acc.decode_ticks += ticks
    acc.verify_ticks += ticks
    acc.verify_positions += ticks * T


def _extend(executor, b: int, tokens, done: bool = False) -> Update:
    """Row b's kept tokens booked (`RowBook.extend`), its slots past them unlisted
    unless it ended, and the executor's counts of busy steps and early ends."""
    book, acc = executor.book, executor.accounting
    update = book.extend(b, tokens, done)
    if update.finish_reason is None:
        book.roll_back(b)
    acc.busy_row_steps += len(update.tokens)
    acc.early_ends += update.finish_reason == "stop"
    return update


def attach(engine: Engine, config, draft: Engine | None = None) -> Engine:
    """`engine` with decode rounds that verify the drafts of `config` (a
    SpeculativeConfig, or its JSON or mapping: vLLM's speculative_config; None: plain
    decoding); `draft`: the draft model's Engine on the same mesh, for method
    "draft_model". The engine knows nothing above it, so this module sets it."""
    from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(config)
    if spec is None:
        engine.speculator = None
        return engine
    if (spec.method == "draft_model") != (draft is not None):
        raise ValueError(
            f"method {spec.method!r} takes a draft Engine exactly when it is draft_model"
        )
    drafter = DraftModel(draft) if draft is not None else None
    engine.speculator = Speculator(engine, spec, drafter)
    return engine
