"""How a round's decode chunk runs when speculation is on: plain steps, one verify pass
of width T, or a loop of passes on the device. Decided on process 0 by the planner
(`SpecPolicy.decide`) and carried in the Round (`SpecPlan`), as the cp strategy is, so
every process runs the same programs; the executor's `Speculator` carries it out.

Each request drafts as far as its `Pace` allows: twice the run its last pass kept (at
most k), and after a pass that kept nothing, not before 2, 4, .. 64 more tokens. A round
where no row may draft runs plain steps, up to the next row's turn. Otherwise the round
rule (`RoundRule`) runs the pass expected to give the most tokens a second, a plain
chunk included. A verify pass over T positions gives each live row 1 + the drafts it
keeps, a plain step one token:

    tokens(T) = sum over live rows b of 1 + f_b * min(d_b, T - 1)

where d_b is the row's drafts and f_b the fraction of its drafts kept so far (smoothed
towards all rows' fraction). What a pass costs against a step is the machine's and the
batch's and varies too much to assume (docs/benchmarks.md), so the rule measures it: it
keeps the seconds of the last `RECENT` rounds of each kind (a plain step over n rows, a
pass of T positions over n rows) and reads their median, which a slow round does not
disturb. Until the drafts' pass and a plain step each have `SAMPLES` times, it measures
them: the drafts' pass first, then plain chunks. A row's fraction is learnt from its
passes only, so after `PROBE_AFTER` rounds in a row decoded plain though rows proposed,
the drafts' pass runs anyway.

With prompt lookup, a chunk expected to take several passes may loop on the device
(`pipeline.speculative.loop`, which chooses each later round's width by the same test
on the seconds measured here) where its rounds measured faster than the host's. The
choice changes speed only: a pass and a plain chunk give the same tokens. Paces depend
on the tokens only, and only process 0 reads its clock, so every process runs alike.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import numpy as np

# Times of a kind of round before the rule trusts their median, and how many it keeps.
SAMPLES = 3
RECENT = 8
# Drafts' worth of all rows' kept fraction a row's own starts from.
PRIOR_DRAFTS = 4
# Rounds in a row decoded plain though rows proposed, before the drafts' pass runs
# anyway: a row's fraction is learnt from its passes only, and its output may have
# begun to repeat.
PROBE_AFTER = 8


def step_kind(n: int) -> tuple:
    """A plain decode step over n rows (a chunk's time over its steps)."""
    return ("step", n)


def pass_kind(n: int, T: int) -> tuple:
    """A verify pass of T positions over n rows, a draft model's passes included."""
    return ("pass", n, T)


def way_kind(n: int, on_device: bool) -> tuple:
    """A prompt lookup round over n rows, looped on the device or one pass from the
    host (its seconds over its tokens)."""
    return ("loop" if on_device else "host", n)


class RoundRule:
    """What the rule knows and how it chooses. `seen`: each kind of round's recent
    seconds; `rounds`: the rounds it was asked about; `drafted`, `kept`: all rows'
    drafts and those kept; `declined`: rounds in a row it decoded plain though rows
    proposed."""

    def __init__(self):
        self.seen: dict[tuple, collections.deque] = {}  # kind -> its last RECENT seconds
        self.rounds = 0
        self.drafted = self.kept = 0
        self.declined = 0
        self.way, self.streak = True, 0  # the last way `on_device` chose, how many times

    def saw(self, kind: tuple, seconds: float) -> None:
        self.seen.setdefault(kind, collections.deque(maxlen=RECENT)).append(seconds)

    def seconds(self, kind: tuple) -> float | None:
        """The kind's median time, None until it has SAMPLES."""
        times = self.seen.get(kind, ())
        return float(np.median(times)) if len(times) >= SAMPLES else None

    def tick(self) -> None:
        """A round is being decided."""
        self.rounds += 1

    def passed(self, drafted: int, kept: int) -> None:
        """A row's pass kept `kept` of its `drafted` drafts."""
        self.drafted += drafted
        self.kept += kept

    def fraction(self, drafted: int, kept: int) -> float:
        """A row's expected fraction of drafts kept (it kept `kept` of `drafted` so far):
        its own, smoothed towards all rows' (1 before any pass: a drafter is tried
        before it is judged)."""
        overall = self.kept / self.drafted if self.drafted else 1.0
        return (kept + PRIOR_DRAFTS * overall) / (drafted + PRIOR_DRAFTS)

    def loop_rounds(self, steps: int, T: int) -> int:
        """Rounds a loop on the device runs for a chunk the planner gave `steps` steps,
        its first pass T wide: as many as those tokens are expected to take, a round
        giving 1 + f (T - 1) (f: all rows' fraction of drafts kept), so a load whose
        drafts are refused loops longer, not back to the host after a token or two."""
        return -(-steps // max(1, round(1 + self.fraction(0, 0) * (T - 1))))

    def choose(self, n: int, rows: list[tuple[int, float]], lengths: list[int]) -> int:
        """The pass length T to run over n rows (1: a plain chunk). rows: each live
        row's (drafts d_b, kept fraction f_b); lengths: the pass lengths the drafts may
        be cut to, ascending, the last the drafts' own."""
        ask = lengths[-1]
        if self.seconds(pass_kind(n, ask)) is None:
            return ask  # measure the drafts' own pass
        step = self.seconds(step_kind(n))
        if step is None:
            return 1  # then a plain step
        best, rate = 1, len(rows) / step
        for T in lengths:
            seconds = self.seconds(pass_kind(n, T))
            if seconds is not None:
                tokens = sum(1 + f * min(d, T - 1) for d, f in rows)
                if tokens / seconds > rate:
                    best, rate = T, tokens / seconds
        self.declined = self.declined + 1 if best == 1 else 0
        if self.declined > PROBE_AFTER:
            self.declined = 0
            return ask
        return best

    def on_device(self, n: int) -> bool:
        """Whether a prompt lookup round over n rows loops on the device
        (`pipeline.speculative.loop`) rather than running one pass from the host: the way
        whose recent rounds gave a token in less time (the median of their seconds over
        their tokens). Each is measured first, the host's passes before the loop (they
        measure the widths the loop chooses among); after PROBE_AFTER rounds in a row
        one way, the other runs once (the load or the machine may have changed)."""
        loop, host = (self.seconds(way_kind(n, d)) for d in (True, False))
        if loop is None or host is None:
            return host is not None
        choice = loop <= host
        self.streak = self.streak + 1 if choice == self.way else 1
        self.way = choice
        if self.streak > PROBE_AFTER:
            self.streak = 0
            return not choice
        return choice


class Unmeasured(RoundRule):
    """Costs never measured, so every round with drafts verifies them, as before the
    rule: for measuring the verify mechanism itself (the benchmark's draft model
    drafting for itself, a test's distribution of sampled passes)."""

    def saw(self, kind: tuple, seconds: float) -> None:
        pass


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
