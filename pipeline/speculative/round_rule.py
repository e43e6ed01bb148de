"""Which pass a speculative round runs: the one expected to give the most tokens a
second, a plain decode chunk included.

A verify pass over T positions gives each live row 1 + the drafts it keeps; a plain
step gives each one token. What a pass costs against a step is the machine's and the
batch's, and it varies too much to assume (docs/benchmarks.md: a pass of 9 positions
cost about 2.6 steps for one row on a 2-core CPU, about 6 for eight rows there, and 6
for one row on an H200, where the round trip dominates). So it is measured:
`RoundRule` keeps the times of the last `RECENT` rounds of each kind (a plain step over
n rows, a chunk's time over its steps; a pass of T positions over n rows, with a draft
model's passes) and reads their median: not disturbed by a slow round (a collection, a
neighbour's work), nor biased as the fastest of many would be (a pass is timed alone, a
step as a chunk's average, so the fastest pass would drift lower than the fastest step).

    tokens(T) = sum over live rows b of 1 + f_b * min(d_b, T - 1)

where d_b is the row's drafts and f_b the fraction of its drafts kept so far (its
`Pace`, smoothed towards all rows' fraction). `RoundRule.choose` runs the pass length
(or the plain step) of largest tokens(T) / seconds(T). Until the pass the drafts ask
for, and then a plain step, each have `SAMPLES` times, it measures them instead: the
drafts' pass first (as if there were no rule), then plain chunks. Shorter passes are
weighed once measured (pacing makes short proposals often). A row's fraction is learnt
from its passes, so after `PROBE_AFTER` rounds in a row decoded plain though rows
proposed, the drafts' pass runs anyway.

With prompt lookup, a chunk of rounds may also loop on the device
(`pipeline.speculative.loop`, which chooses each round's width by the same test,
`loop.choose_width`, on the seconds measured here) instead of returning to the host
after every pass, for as many rounds as the chunk's tokens are expected to take
(`RoundRule.loop_rounds`). `RoundRule.on_device` chooses the way by each one's measured
seconds a token.

The choice changes speed only: a pass and a plain chunk give the same tokens. Only
process 0 chooses (its planner, `pipeline.speculative.policy`), and the Round carries the
choice to the others, so the rule reads process 0's own clock.
"""

from __future__ import annotations

import collections

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
