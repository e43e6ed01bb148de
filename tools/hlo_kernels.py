"""What XLA launches per program, from an HLO dump: for each program's optimized module,
its entry computation and each while loop's body (with the trip count where XLA knows
it), the instructions that run as work of their own (fusions, custom calls such as
cuBLAS or cuDNN, copies, collectives, unfused dots) and the custom calls by target.

On a GPU each of those is about one kernel launch, so the counts show where a launch-
bound program (decode at batch 1) spends its launches, and whether a dequantization
was fused into its product (FP8: a `__cublas$gemm` fed by a convert fusion, or a
`__triton_gemm` fusion that holds the convert).

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" qwen3-spmd generate ...
    python tools/hlo_kernels.py DIR [--only decode]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# Instructions that run as work of their own (on a GPU, about a kernel each).
WORK = (
    "fusion",
    "custom-call",
    "copy",
    "copy-start",
    "dot",
    "convolution",
    "all-reduce",
    "all-reduce-start",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
    "dynamic-update-slice",
    "scatter",
    "gather",
    "sort",
    "reduce",
)
HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
OPCODE = re.compile(r"\s=\s.*?\s([a-z][a-z\-]*)\(")
BODY = re.compile(r"body=%?([\w.\-]+)")
TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
TARGET = re.compile(r'custom_call_target="([^"]+)"')


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        if name is None:
            m = HEADER.match(line)
            if m and "=" not in line.split("{")[0].split("->")[0].split("(")[0]:
                name = m.group(2)
                comps[name] = []
                if m.group(1):
                    entry = name
        elif line.strip() == "}":
            name = None
        else:
            comps[name].append(line)
    return comps, entry


def summary(lines: list[str]) -> tuple[collections.Counter, collections.Counter]:
    """(work instructions by opcode, custom calls by target) of a computation."""
    ops, targets = collections.Counter(), collections.Counter()
    for line in lines:
        m = OPCODE.search(line)
        if m and m.group(1) in WORK:
            ops[m.group(1)] += 1
            if m.group(1) == "custom-call":
                t = TARGET.search(line)
                targets[t.group(1) if t else "?"] += 1
    return ops, targets


def report(path: Path) -> list[str]:
    comps, entry = computations(path.read_text())
    if entry is None:
        return [f"{path.name}: no entry computation found"]
    out, todo, seen = [], [(entry, None)], set()
    while todo:
        name, trip = todo.pop(0)
        if name in seen or name not in comps:
            continue
        seen.add(name)
        ops, targets = summary(comps[name])
        label = "entry" if name == entry else f"loop body {name} (trips: {trip or '?'})"
        listed = ", ".join(f"{op} {n}" for op, n in ops.most_common())
        out.append(f"  {label}: {sum(ops.values())} work instructions ({listed})")
        if targets:
            out.append(
                "    custom calls: " + ", ".join(f"{t} {n}" for t, n in targets.most_common())
            )
        for line in comps[name]:
            if " while(" in line and (b := BODY.search(line)):
                t = TRIP.search(line)
                todo.append((b.group(1), t.group(1) if t else None))
    return [path.name.split("_after_optimizations")[0].split(".", 1)[1], *out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dump", type=Path, help="the --xla_dump_to folder")
    p.add_argument("--only", default="", help="programs whose name holds this (e.g. decode)")
    args = p.parse_args()
    files = sorted(
        f
        for f in args.dump.glob("*after_optimizations.txt")
        if args.only in f.name and "-" not in f.name.split("after_optimizations")[1]
    )
    if not files:
        raise SystemExit(
            f"error: no *after_optimizations.txt in {args.dump}: dump with --xla_dump_hlo_as_text"
        )
    for f in files:
        print("\n".join(report(f)))


if __name__ == "__main__":
    main()
