"""A server's start, then a steady load on it: when does a request last wait on a compile?

    python tools/serve_start.py --model 0.6B --dtype float32 --mesh 1x1 \\
        --max-seq-len 1024 --seconds 180 --json

starts `qwen3-spmd serve` with those flags (a compile cache of its own: empty, so a cold
start, unless `--compile-cache DIR` names a filled one), times it to `/health` 200, then
runs a steady load from that moment: `--concurrency` clients in a closed loop, each
request a prompt of 16-512 random token ids (log-uniform), 16-64 new tokens, half of
them sampled, one in eight with log-probabilities. Every line the server prints is
stamped as it arrives; `compiling NAME` is a round waiting for a compile (the
background's compiles print nothing), so the last such line says when the load last
waited. Prints one JSON object with `--json`, else a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from qwen3_spmd.run.bench.http_load import Started, free_port, served_model


class Stamped(Started):
    """`Started` whose stderr lines are kept with the time each arrived."""

    def __init__(self, argv: list[str], port: int):
        super().__init__(argv, port, "qwen3-spmd serve")
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in self.proc.stderr:
            self.lines.append((time.monotonic() - self.t0, raw.decode(errors="replace").rstrip()))


def requests(vocab: int, seed: int):
    """Request bodies (without the model), drawn as the load takes them: see the
    module's docstring."""
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        length = int(np.exp(rng.uniform(np.log(16), np.log(512))))
        body = {
            "prompt": rng.integers(min(1000, vocab // 2), min(vocab, 100_000), length).tolist(),
            "max_tokens": int(rng.integers(16, 65)),
            "temperature": 0.7 if i % 2 else 0.0,
            "seed": i,
        }
        if i % 8 == 3:
            body["logprobs"] = 2
        yield body


async def steady(url: str, model: str, bodies, concurrency: int, seconds: float):
    """The closed loop until `seconds` pass: each request's (start, end, status)
    relative to the loop's start."""
    import httpx

    t0, done, queue = time.monotonic(), [], iter(bodies)
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker():
            for body in queue:
                if time.monotonic() - t0 > seconds:
                    return
                start = time.monotonic() - t0
                r = await client.post(url + "/v1/completions", json={**body, "model": model})
                done.append((start, time.monotonic() - t0, r.status_code))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(done)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.6B")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--compile-cache", help="its folder: empty for a cold start (the default)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cache = args.compile_cache or tempfile.mkdtemp(prefix="qwen3-spmd-start-")
    cold = not any(Path(cache).iterdir()) if Path(cache).is_dir() else True
    port = free_port()
    cmd = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--port", str(port)]
    cmd += ["--model", args.model, "--dtype", args.dtype, "--mesh", args.mesh]
    cmd += ["--max-seq-len", str(args.max_seq_len), "--compile-cache", cache]
    with Stamped(cmd, port) as server:
        up = time.monotonic() - server.t0
        model = served_model(server.url)
        from qwen3_spmd.run.models import open_model

        vocab = open_model(args.model).cfg.V
        bodies = requests(vocab, seed=0)
        done = asyncio.run(steady(server.url, model, bodies, args.concurrency, args.seconds))
        end = time.monotonic() - server.t0
    server.reader.join(timeout=60)  # the server has exited: its stderr is at its end
    lines = list(server.lines)
    waits = [(t - up, line) for t, line in lines if t > up and line.startswith("compiling ")]
    latencies = [b - a for a, b, status in done if status == 200]
    out = {
        "command": " ".join(cmd[1:]),
        "cold": cold,
        "up_s": up,
        "start_log": [(round(t, 1), line) for t, line in lines if t <= up],
        "requests": len(done),
        "failed": sum(status != 200 for _, _, status in done),
        "load_s": end - up,
        "latency_s": {"p50": float(np.median(latencies)), "max": max(latencies)},
        "compile_waits": [{"after_s": round(t, 1), "what": line[10:]} for t, line in waits],
        "last_wait_after_s": waits[-1][0] if waits else None,
        "background": next((line for _, line in lines if "in the background" in line), None),
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"up in {up:.0f} s ({'cold' if out['cold'] else 'warm'}); {len(done)} requests "
            f"in {out['load_s']:.0f} s; {len(waits)} waited on a compile, the last "
            f"{out['last_wait_after_s']} s after /health; {out['background']}"
        )


if __name__ == "__main__":
    main()
