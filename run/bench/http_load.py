"""bench --scenario serve --url URL: an OpenAI-compatible endpoint under load, measured
as vLLM's `bench serve` measures one.

At each concurrency c, c streamed /v1/completions requests are in flight (each one
that ends is replaced by the next) until all have run. Prompts are synthetic: random
ids of the checkpoint's tokenizer decoded to text (lengths uniform in a range, seeded),
output lengths likewise, greedy. Every endpoint gets the same requests, without
`ignore_eos` (transformers serve refuses it): a request may end at an EOS, and the
output tokens counted are the ones that came.
Per request: time to first token (TTFT: the first chunk with a choice), inter-token
latencies (ITL: between such chunks), time per output token after the first
(TPOT), end-to-end latency; output tokens from the stream's usage (else its chunks).
Per concurrency: p50/p90/p99 of each, output tokens/s and requests/s.

`--url local` starts `qwen3-spmd serve` on --model and the first --mesh for the run;
`--peer transformers` starts `transformers serve --continuous-batching` on the same
checkpoint folder and measures it with the same requests in the same run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qwen3_spmd.run.flags import CLIError, platform_is_cpu

READY_S = 900  # a server has this long to load and compile


def synthetic_prompts(text, vocab: int, n: int, prompt_lens, output_lens, seed: int):
    """n (prompt, max_tokens), lengths uniform in the inclusive ranges: text that the
    tokenizer encodes to that many tokens (random ids of whole-character tokens, decoded,
    re-encoded and cut, as vLLM's random dataset), or token ids without a tokenizer."""
    rng = np.random.default_rng([seed, n, 7])
    clean = _clean_ids(text) if text is not None else None
    out = []
    for _ in range(n):
        T = int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))
        new = int(rng.integers(output_lens[0], output_lens[1] + 1))
        if text is None:
            out.append((rng.integers(0, vocab, T).tolist(), new))
            continue
        ids = text.encode(text.decode(rng.choice(clean, T).tolist()))[:T]
        out.append((text.decode(ids), new))
    return out


@functools.cache  # one pass over the vocabulary per tokenizer, not per load
def _clean_ids(text) -> np.ndarray:
    """Ids of the tokenizer's regular tokens that decode to whole characters alone (a
    random sequence of byte pieces would decode to U+FFFD, which re-encodes longer)."""
    regular = text.tokenizer.get_vocab_size(with_added_tokens=False)
    ids = [i for i in range(regular) if "\ufffd" not in text.decode([i]) and text.decode([i])]
    return np.asarray(ids)


def _percentiles(xs) -> dict:
    xs = np.asarray(xs, float)
    if not len(xs):
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "p50": float(np.percentile(xs, 50)),
        "p90": float(np.percentile(xs, 90)),
        "p99": float(np.percentile(xs, 99)),
        "mean": float(xs.mean()),
    }


async def _one(client, url: str, body: dict, headers: dict) -> dict:
    """One streamed request's timings."""
    t0 = time.perf_counter()
    stamps, usage, chunks = [], None, 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            if chunk.get("choices"):  # a token's news (its text may be held or empty)
                stamps.append(time.perf_counter() - t0)
                chunks += 1
    if not stamps:
        return {"error": "no chunk came back"}
    tokens = usage["completion_tokens"] if usage else chunks
    latency = time.perf_counter() - t0
    return {
        "ttft_s": stamps[0],
        "itl_s": np.diff(stamps).tolist(),
        "latency_s": latency,
        "tpot_s": (latency - stamps[0]) / (tokens - 1) if tokens > 1 else None,
        "output_tokens": tokens,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
    }


async def _load(base: str, model: str, requests, concurrency: int, api_key) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base.rstrip("/") + "/v1/completions"
    queue = list(requests)
    done: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=READY_S, limits=limits) as client:

        async def worker():
            while queue:
                prompt, max_tokens = queue.pop(0)
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                done.append(await _one(client, url, body, headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [d for d in done if "error" not in d]
    tokens = sum(d["output_tokens"] for d in ok)
    prompt_tokens = [d["prompt_tokens"] for d in ok if d["prompt_tokens"] is not None]
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "failed": len(done) - len(ok),
        "errors": sorted({d["error"] for d in done if "error" in d})[:3],
        "time_s": wall,
        "output_tokens": tokens,
        "mean_prompt_tokens": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_s": _percentiles([d["ttft_s"] for d in ok]),
        "tpot_s": _percentiles([d["tpot_s"] for d in ok if d["tpot_s"] is not None]),
        "itl_s": _percentiles([x for d in ok for x in d["itl_s"]]),
        "latency_s": _percentiles([d["latency_s"] for d in ok]),
    }


def measure(base: str, model: str, requests_for, concurrencies, api_key=None, say=print):
    """Each concurrency's load on `base`; requests_for(c) gives its requests. An untimed
    first pass of the same load meets (and compiles) the shapes the timed one will."""
    rows = []
    for c in concurrencies:
        reqs = requests_for(c)
        asyncio.run(_load(base, model, reqs, c, api_key))  # warm-up
        row = asyncio.run(_load(base, model, reqs, c, api_key))
        rows.append(row)
        say(
            f"  {model} c={c}: {row['output_tokens_per_s']:.1f} tok/s, "
            f"{row['requests_per_s']:.2f} req/s, TTFT p50 {row['ttft_s']['p50'] or 0:.2f} s, "
            f"TPOT p50 {1e3 * (row['tpot_s']['p50'] or 0):.0f} ms"
            + (f", {row['failed']} failed: {row['errors'][0]}" if row["failed"] else "")
        )
    return rows


# ---- the servers this run starts ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Started:
    """A server subprocess on 127.0.0.1, ready when /health says 200; stopped with
    SIGTERM (then killed) on exit."""

    def __init__(self, argv: list[str], port: int, name: str, env=None):
        self.url, self.name = f"http://127.0.0.1:{port}", name
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.PIPE, env=env)

    def __enter__(self):
        import httpx

        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise CLIError(f"{self.name} exited while starting: {(err or ['?'])[-1]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise CLIError(f"{self.name} did not come up in {READY_S} s")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def ours(
    model: str | None,
    mesh: str,
    max_batch: int,
    max_seq_len: int,
    precompile: str = "all",
    compile_cache: str | None = None,
) -> Started:
    """`qwen3-spmd serve` on a free port (compile_cache: its --compile-cache; None:
    serve's default)."""
    port = free_port()
    argv = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--port", str(port)]
    argv += ["--mesh", mesh, "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len)]
    argv += ["--precompile", precompile]
    argv += ["--compile-cache", compile_cache] if compile_cache else []
    argv += ["--model", model] if model else []
    from qwen3_spmd.sharding.mesh import parse_mesh

    n = parse_mesh(mesh).devices
    if n > 1:
        argv += ["--cpu-devices", str(n)] if _cpu() else []
    return Started(argv, port, "qwen3-spmd serve")


def transformers_serve(folder: str) -> Started:
    """`transformers serve --continuous-batching` on `folder` (float32, CPU when our
    run is on CPU), run by this Python (its console script need not be on PATH)."""
    import importlib.metadata

    script = next(
        (
            e
            for e in importlib.metadata.entry_points(group="console_scripts")
            if e.name == "transformers"
        ),
        None,
    )
    if script is None:
        raise CLIError(
            "--peer transformers needs the `transformers` command: pip install "
            "torch transformers accelerate"
        )
    module, func = script.value.split(":")
    launch = (
        f"import sys; from {module} import {func} as m; sys.argv[0] = 'transformers'; sys.exit(m())"
    )
    port = free_port()
    argv = [sys.executable, "-c", launch, "serve", "--continuous-batching", "--dtype", "float32"]
    argv += ["--host", "127.0.0.1", "--port", str(port), str(Path(folder).resolve())]
    argv += ["--device", "cpu"] if _cpu() else []
    return Started(argv, port, "transformers serve")


def _cpu() -> bool:
    return platform_is_cpu()


def served_model(url: str, api_key=None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    return data["data"][0]["id"]
