"""Serving's first minute: a load sent the moment /health says 200, on a server that
compiles the rest of its programs in the background (`--precompile first`, the
default) against one that compiled them all first (`--precompile all`), in one run.

    python tools/first_minute.py --model /tmp/q06 --dtype float32 --mesh 1x1 \\
        --max-seq-len 256 --json

Each server starts cold (a compile cache of its own, empty) with the same flags; the
load is issue 47's: 32 streamed completions, 8 at a time, prompts of 16-128 random token
ids, 16-64 new tokens, greedy. Prints, per start, the seconds to /health and the load's
output tokens/s, TTFT and TPOT, then first/all ratios (one JSON object with --json).
`--starts first` starts only the default; run it with another tree's Python to
compare two revisions (the server is the running interpreter's package).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

from qwen3_spmd.run.bench.http_load import (
    Started,
    _load,
    free_port,
    served_model,
    synthetic_prompts,
)


def one_start(args, precompile: str) -> dict:
    """A cold server with `--precompile precompile`, the load right after /health."""
    from qwen3_spmd.run.models import open_model

    port = free_port()
    cmd = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--port", str(port)]
    cmd += ["--model", args.model, "--dtype", args.dtype, "--mesh", args.mesh]
    cmd += ["--max-seq-len", str(args.max_seq_len), "--max-batch", str(args.concurrency)]
    cmd += ["--precompile", precompile, "--compile-cache", tempfile.mkdtemp(prefix="qwen3-fm-")]
    vocab = open_model(args.model).cfg.V
    load = synthetic_prompts(None, vocab, args.requests, (16, 128), (16, 64), seed=0)
    t0 = time.monotonic()
    with Started(cmd, port, f"serve --precompile {precompile}") as server:
        up = time.monotonic() - t0
        row = asyncio.run(_load(server.url, served_model(server.url), load, args.concurrency, None))
    return {"precompile": precompile, "up_s": up, **row}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a checkpoint folder, or a preset name")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--starts", default="first,all", help="the --precompile values to start")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    runs = [one_start(args, how) for how in args.starts.split(",")]
    by = {r["precompile"]: r for r in runs}
    ratios = {}
    if {"first", "all"} <= by.keys():
        first, all_ = by["first"], by["all"]
        ratios = {
            "output_tokens_per_s": first["output_tokens_per_s"] / all_["output_tokens_per_s"],
            "ttft_p50": first["ttft_s"]["p50"] / all_["ttft_s"]["p50"],
            "up_s": first["up_s"] / all_["up_s"],
        }
    if args.json:
        print(json.dumps({"runs": runs, "first_over_all": ratios}, indent=1))
        return
    for r in runs:
        print(
            f"--precompile {r['precompile']}: /health in {r['up_s']:.0f} s, then "
            f"{r['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {r['ttft_s']['p50']:.2f} s, "
            f"TPOT p50 {1e3 * r['tpot_s']['p50']:.0f} ms ({r['failed']} failed)"
        )
    if ratios:
        print(
            f"first/all: {ratios['output_tokens_per_s']:.2f}x output tok/s, "
            f"{ratios['ttft_p50']:.2f}x TTFT p50, {ratios['up_s']:.2f}x time to /health"
        )


if __name__ == "__main__":
    main()
