"""How a round's decode chunk runs when speculation is on: plain steps, one verify pass
of width T, or a loop of passes on the device. Decided on process 0 by the planner
(`SpecPolicy.decide`) and carried in the Round (`SpecPlan`), as the cp strategy is, so
every process runs the same programs; the executor's `Speculator` carries it out.

Each request drafts as far as its `Pace` allows: twice the run its last pass kept (at
most k), and after a pass that kept nothing, not before 2, 4, .. 64 more tokens. A round
where no row may draft runs plain steps, up to the next row's turn. Otherwise the round
rule (`pipeline.speculative.round_rule`) picks the width expected to give the most
tokens a second, a plain chunk included; with prompt lookup, a chunk expected to take
several passes may loop on the device (`pipeline.speculative.loop`) where that measured
faster. Paces depend on the tokens only, so they read alike on every process.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from qwen3_spmd.pipeline.speculative.round_rule import RoundRule, pass_kind, step_kind

# The longest wait (tokens) after passes that kept no draft: a request whose drafter has
# started to agree is probed again within this many tokens.
MAX_WAIT = 64
# The most rounds a loop on the device runs (its output holds MAX_ROUNDS x T tokens a row).
MAX_ROUNDS = 8


@dataclasses.dataclass
class Pace:
    """How far a request drafts: `k` drafts its next pass may propose, and after
    `misses` passes in a row that kept none, no proposal before it has `wait_until`
    tokens. `drafted` and `kept`: its drafts so far, and how many were kept (the round
    rule's expectation)."""

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


def widths(k: int) -> tuple[int, ...]:
    """The pass widths a loop of rounds chooses among: 1 (a step), 1 + the ladder."""
    return (1, *(1 + x for x in ladder(k)))


class Drafting(NamedTuple):
    """A busy decode row as the policy sees it when it plans: `tokens` so far, prompt
    then generated (None: admitted this round, so its first token is not known yet and
    it does not draft), how many it `made`, its `pace` (None: it never drafted), the
    tokens it may still make (`steps_left`), whether it asks for log-probabilities."""

    tokens: tuple[int, ...] | None
    made: int
    pace: Pace | None
    steps_left: int
    logprobs: bool = False


def drafting(rows: dict) -> dict[int, Drafting]:
    """{b: Drafting} of row book rows ({b: Row}) that decode already."""
    return {
        b: Drafting(
            row.request.prompt + tuple(row.generated),
            len(row.generated),
            row.pace,
            row.steps_left,
            row.request.params.logprobs,
        )
        for b, row in rows.items()
    }


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """A decode chunk run as verify passes, as process 0 decided it.

    T: a pass's positions a row, 1 + the most drafts it holds (a width of the ladder).
    drafts: ((row, its drafts), ...) of a host drafter (prompt lookup, a test's
      oracle), made by the planner, so no other process drafts.
    asks: ((row, k_b), ...) of a draft model: the drafts it is to make on the device.
    rounds: 1, one pass from the host; more, a loop of as many passes on the device,
      which chooses each later round's width by `pass_seconds` (process 0's measured
      seconds of each of `widths(k)`, 0 where unmeasured) and `overall` (all rows'
      drafts and kept drafts so far).
    host_way: a round that could have looped and runs one pass (its time measures the
      host's way, `RoundRule.on_device`).
    """

    T: int
    drafts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    asks: tuple[tuple[int, int], ...] = ()
    rounds: int = 1
    pass_seconds: tuple[float, ...] = ()
    overall: tuple[int, int] = (0, 0)
    host_way: bool = False

    @staticmethod
    def from_dict(d: dict) -> SpecPlan:
        """The plan from `dataclasses.asdict`'s JSON (lists back to tuples)."""
        return SpecPlan(
            T=d["T"],
            drafts=tuple((b, tuple(t)) for b, t in d["drafts"]),
            asks=tuple((b, k) for b, k in d["asks"]),
            rounds=d["rounds"],
            pass_seconds=tuple(d["pass_seconds"]),
            overall=tuple(d["overall"]),
            host_way=d["host_way"],
        )


class SpecPolicy:
    """Decides a speculative round from the row book and the round rule's measures.

    config: the drafter's settings (a SpeculativeConfig, or any object with
    `num_speculative_tokens` and `propose(context, k)`: the tests' and the benchmark's
    oracles); draft_model: the drafts come from a draft model's passes on the device
    (only their counts are decided here); rule: the round rule, which the executor's
    speculator feeds with measured seconds (on process 0 the same object)."""

    def __init__(self, config, draft_model: bool, rule: RoundRule | None = None):
        self.config, self.draft_model = config, draft_model
        self.rule = rule or RoundRule()

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def takes(self, live: int) -> bool:
        """Whether a chunk over `live` busy rows may speculate: no more than the config's
        disable_by_batch_size (any count for a drafter without one)."""
        bound = getattr(self.config, "disable_by_batch_size", None)
        return bound is None or live <= bound

    def loops(self) -> bool:
        """Whether rounds may loop on the device: the drafter is prompt lookup (which the
        device runs too); whether they do is the round rule's."""
        return getattr(self.config, "method", None) == "ngram" and not self.draft_model

    def decide(
        self, rows: dict[int, Drafting], n: int, steps: int, constrained: bool = False
    ) -> tuple[int, SpecPlan | None]:
        """(steps, plan) of a decode chunk over rows 0..n-1, whose busy ones are `rows`,
        that the planner gave `steps` steps: plan None, plain steps cut at the next
        row's turn to draft; or a SpecPlan. constrained: some row is under a constraint
        (it runs no loop)."""
        k, rule = self.k, self.rule
        rule.tick()
        wants = {}
        for b, row in rows.items():
            pace = row.pace or Pace(k)
            # It may produce steps_left more tokens: k_b drafts give k_b + 1 at most.
            k_b = min(pace.k, k, row.steps_left - 1)
            if row.tokens is not None and k_b > 0 and not pace.waits(row.made):
                wants[b] = (row.tokens, k_b)
        if self.draft_model:
            T = self._choose(rows, n, {b: k_b for b, (_, k_b) in wants.items()})
            if T == 1:
                return self._plain_steps(rows, steps), None
            asks = tuple((b, min(k_b, T - 1)) for b, (_, k_b) in wants.items())
            return steps, SpecPlan(T, asks=asks)
        drafts = {b: list(self.config.propose(c, k_b))[:k_b] for b, (c, k_b) in wants.items()}
        T = self._choose(rows, n, {b: len(d) for b, d in drafts.items()})
        if T == 1:
            return self._plain_steps(rows, steps), None
        drafts = tuple((b, tuple(d[: T - 1])) for b, d in drafts.items() if d)
        rounds = min(
            MAX_ROUNDS,
            rule.loop_rounds(steps, T),
            max(row.steps_left for row in rows.values()),  # a round gives a row a token
        )
        asks_logprobs = any(row.logprobs for row in rows.values())
        if not self.loops() or rounds < 2 or constrained or asks_logprobs:
            return steps, SpecPlan(T, drafts)
        if not rule.on_device(n):  # measured: the host's passes give tokens faster
            return steps, SpecPlan(T, drafts, host_way=True)
        seconds = tuple(rule.seconds(_kind(n, w)) or 0.0 for w in widths(k))
        overall = (rule.drafted, rule.kept)
        return steps, SpecPlan(T, drafts, rounds=rounds, pass_seconds=seconds, overall=overall)

    def _choose(self, rows: dict[int, Drafting], n: int, drafts: dict[int, int]) -> int:
        """The round rule's pass length over rows 0..n-1, whose busy `rows` would draft
        `drafts` ({b: d_b}) tokens: 1 (a plain chunk) when none would."""
        longest = max(drafts.values(), default=0)
        if longest == 0:
            return 1
        ask = min(x for x in ladder(self.k) if x >= longest)
        expect = []
        for b, row in rows.items():
            pace = row.pace or Pace(self.k)
            expect.append((drafts.get(b, 0), self.rule.fraction(pace.drafted, pace.kept)))
        lengths = [1 + x for x in ladder(self.k) if x <= ask]
        return self.rule.choose(n, expect, lengths)

    def _plain_steps(self, rows: dict[int, Drafting], steps: int) -> int:
        """Steps of the plain chunk a round runs when no row drafts: `steps` (the
        planner's), cut at the first row's turn to draft again, but at least k + 1 (a
        drafter with nothing now may have something a token later)."""
        turns = [(row.pace or Pace(self.k)).waits(row.made) for row in rows.values()]
        return min(steps, max(self.k + 1, min(turns, default=steps)))


def _kind(n: int, width: int) -> tuple:
    """The round rule's kind of a pass of `width` over n rows (1: a plain step)."""
    return pass_kind(n, width) if width > 1 else step_kind(n)
