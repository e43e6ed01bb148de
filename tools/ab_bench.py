"""Before/after of a hot-path change: `qwen3-spmd bench` on two git revisions, alternated.

    python tools/ab_bench.py 96243af HEAD --rounds 3 -- \\
        --model /tmp/q06 --dtype float32 --mesh 1x1 --scenario roofline \\
        --scenario decode --batches 1,8 --decode-prompt-len 16 --decode-steps 32 \\
        --repeats 3 --warmup 1

Each revision is checked out once (a detached `git worktree` in a temporary folder) and
run from its own source tree in this venv (PYTHONPATH, so the installed package is not
what runs), with a compile cache of its own. The runs alternate A B A B ..., so a
machine that slows down or speeds up over the minutes (a shared 2-core host does) moves
both sides alike; one run of each revision is far noisier than that (the decode tokens/s
of one tree spread by 10-20% from run to run on such a host). It prints each run's
figures and, per job, the median over the rounds and B's median over A's; `--json` prints
one object instead.

Why a script and not a bench scenario: it runs bench itself, twice per round, on trees
other than the one installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, into: Path) -> Path:
    """A folder whose `qwen3_spmd` is revision `rev`'s tree (for PYTHONPATH)."""
    tree = into / f"tree-{rev.replace('/', '_')}"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    path = into / f"path-{rev.replace('/', '_')}"
    path.mkdir()
    (path / "qwen3_spmd").symlink_to(tree)
    return path


def figures(report: dict) -> dict[str, float]:
    """job name -> tokens/s (median of the run's repeats: prefill, decode, each
    speculative drafter), and the measured bandwidth."""
    out = {}
    for mesh in report["meshes"]:
        for kind, key in (("prefill", "prompt_len"), ("decode", "batch")):
            for j in mesh.get(kind, []):
                job = f"{mesh['mesh']} {kind} {key[0].upper()}={j[key]}"
                out[f"{job} tok/s"] = j["tokens_per_s"]["median"]
                if "host_overhead_fraction" in j:  # the time outside the decode program
                    out[f"{job} host share"] = j["host_overhead_fraction"]["median"]
        for j in mesh.get("speculative", []):  # each drafter's run
            for name, run in j["drafters"].items():
                job = f"{mesh['mesh']} speculative B={j['batch']} {name}"
                out[f"{job} tok/s"] = run["tokens_per_s"]["median"]
    roof = report.get("roofline")
    if roof:
        out["bandwidth GB/s"] = roof["bandwidth_bytes_per_s"]["median"] / 1e9
    return out


def run_bench(path: Path, cache: Path, bench_args: list[str]) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(path),
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "QWEN3_SPMD_COMPILE_CACHE": str(cache),
    }
    done = subprocess.run(
        [sys.executable, "-m", "qwen3_spmd.run.cli", "bench", *bench_args, "--json"],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"ab_bench: bench failed in {path}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the revision before (any git revision)")
    p.add_argument("b", help="the revision after")
    p.add_argument("--rounds", type=int, default=3, help="A B pairs to run (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", type=Path, help="a folder for each run's bench report (JSON)")
    p.epilog = "After the flags: -- then bench's flags, which both revisions run."
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = p.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="ab_bench-"))
    runs: dict[str, list[dict[str, float]]] = {args.a: [], args.b: []}
    try:
        paths = {rev: checkout(rev, work) for rev in runs}
        for r in range(args.rounds):
            for rev in runs:
                cache = work / f"cache-{rev.replace('/', '_')}"
                report = run_bench(paths[rev], cache, bench_args)
                if args.save:
                    args.save.mkdir(parents=True, exist_ok=True)
                    name = f"round{r + 1}-{rev.replace('/', '_')}.json"
                    (args.save / name).write_text(json.dumps(report, indent=1))
                got = figures(report)
                runs[rev].append(got)
                if not args.json:
                    shown = ", ".join(f"{k} {v:.2f}" for k, v in got.items())
                    print(f"round {r + 1} {rev}: {shown}", flush=True)
    finally:
        for tree in work.glob("tree-*"):
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
            )
        shutil.rmtree(work, ignore_errors=True)
    medians = {
        rev: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for rev, rs in runs.items()
    }
    ratio = {k: medians[args.b][k] / medians[args.a][k] for k in medians[args.a]}
    if args.json:
        print(json.dumps({"runs": runs, "medians": medians, "b_over_a": ratio}, indent=1))
        return 0
    print(f"\n{'job':<32} {args.a:>12} {args.b:>12}  b/a")
    for k, v in ratio.items():
        print(f"{k:<32} {medians[args.a][k]:>12.2f} {medians[args.b][k]:>12.2f}  {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
