"""The two pipeline schedules as plain data, for the loops to follow and to report.

Prefill (GPipe over M microbatches, S stages, M + S - 1 ticks): stage s works on
microbatch t - s at tick t. For M = 3, S = 2:

    tick     0  1  2  3
    stage 0  0  1  2  .
    stage 1  .  0  1  2

Decode (round-robin over G groups, n steps each, period max(G, S)): stage s works on
group (t - s) mod period at tick t (idle when that is G or more), step (t - s) // period.
For G = S = 2, n = 2:

    tick     0  1  2  3  4
    stage 0  0  1  0  1  .
    stage 1  .  0  1  0  1

Group g's token from the last stage reaches stage 0 by the time stage 0 needs it
(period >= S); with G >= S no stage is idle in steady state.

`decode_period` and `decode_ticks` are the one statement of the decode schedule's
length: the decode program loops over `decode_ticks` ticks, the engine counts them, and
`decode_grid` draws them.
"""

from __future__ import annotations

Grid = list[list[int | None]]  # [stage][tick] -> microbatch / group, None = idle


def prefill_grid(microbatches: int, stages: int) -> Grid:
    ticks = microbatches + stages - 1
    return [
        [t - s if 0 <= t - s < microbatches else None for t in range(ticks)] for s in range(stages)
    ]


def decode_period(groups: int, stages: int) -> int:
    """Ticks between two steps of one group: G, or S when there are fewer groups than
    stages (a group's token must come round from the last stage first)."""
    return max(groups, stages)


def decode_ticks(groups: int, stages: int, steps):
    """Ticks of a decode chunk of `steps` steps (an int, or a traced int32): the last
    group's last step starts at (steps - 1) * period + G - 1 and takes S ticks."""
    return (steps - 1) * decode_period(groups, stages) + groups + stages - 1


def decode_grid(groups: int, stages: int, steps: int) -> Grid:
    period = decode_period(groups, stages)
    ticks = decode_ticks(groups, stages, steps)

    def cell(u):
        return u % period if 0 <= u < steps * period and u % period < groups else None

    return [[cell(t - s) for t in range(ticks)] for s in range(stages)]


def stats(grid: Grid, skip_edges: int = 0) -> dict:
    """{"ticks", "busy_slots", "idle_fraction"} over ticks [skip_edges, ticks - skip_edges)."""
    ticks = len(grid[0])
    window = range(skip_edges, ticks - skip_edges)
    busy = sum(grid[s][t] is not None for s in range(len(grid)) for t in window)
    total = len(grid) * len(window)
    return {
        "ticks": len(window),
        "busy_slots": busy,
        "idle_fraction": (total - busy) / total if total else 0.0,
    }


def timeline(grid: Grid, title: str) -> str:
    """A text chart: a row per stage, a column per tick, each cell what the stage ran."""
    ticks = len(grid[0])
    width = max(
        2, len(str(ticks - 1)), *(len(str(c)) for row in grid for c in row if c is not None)
    )
    head = f"{title:<10}" + "".join(f"{t:>{width + 1}}" for t in range(ticks))
    rows = [
        f"stage {s:<4}" + "".join(f"{'' if c is None else c:>{width + 1}}" for c in row)
        for s, row in enumerate(grid)
    ]
    return "\n".join([head, *rows])
