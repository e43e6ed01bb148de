"""Closed loops through the continuous-batching scheduler, and their figures: what the
serve scenario (run.bench.serve) and the prefix cache's loads (run.bench.prefix) run.

Closed loop at concurrency c: c requests are in flight; each one that finishes is
replaced by the next, until every request has run. Requests mix prompt and output
lengths (uniform in the given ranges, seeded). Seconds spent waiting for compiles are
left out of the throughputs (each is reported); times to first token are as measured.
"""

from __future__ import annotations

import time

import numpy as np

from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler


def serve_requests(cfg, n: int, prompt_lens, output_lens, seed: int):
    """n (prompt ids, output tokens) pairs, lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng([seed, n])
    out = []
    for _ in range(n):
        T = int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))
        new = int(rng.integers(output_lens[0], output_lens[1] + 1))
        out.append((rng.integers(0, cfg.V, T).tolist(), new))
    return out


def _percentiles(xs) -> dict:
    xs = np.asarray(xs, float)
    if not len(xs):
        return {"p50": None, "p90": None}
    return {"p50": float(np.percentile(xs, 50)), "p90": float(np.percentile(xs, 90))}


def closed_loop(
    sched: Scheduler,
    requests,
    concurrency: int,
    constraint=None,
    every: int = 1,
    tokens: list | None = None,
) -> dict:
    """Every request through `sched` with `concurrency` in flight (greedy). The decode
    use (`Scheduler.decode_use`) is given over the whole loop, and over its steady part
    before the drain: until the last request goes in, each one that finishes has a
    successor (None when no decode round ran before it). constraint: request i follows
    it where i % every == 0 (a structured load; "unconstrained" gives the others'
    figures apart). tokens: a list that gets each request's tokens, in order."""
    pending, live, finished = list(enumerate(requests)), [], []
    free = set()  # the handles of the requests under no constraint
    index = {}  # handle -> its request's index
    compile_before, counts = sched.clock.compile_s, sched.decode_counts()
    before_drain = None
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, (prompt, n) = pending.pop(0)
            held = constraint if constraint is not None and i % every == 0 else None
            live.append(sched.submit(prompt, Params(n, constraint=held)))
            index[live[-1]] = i
            if held is None:
                free.add(live[-1])
            if not pending and sched.decode_counts()[0] > counts[0]:
                before_drain = sched.decode_use(since=counts)
        sched.step()
        finished += [h for h in live if h.done]
        live = [h for h in live if not h.done]
    compile_s = sched.clock.compile_s - compile_before
    wall = time.perf_counter() - t0 - compile_s
    out = {
        **finished_figures(finished, wall, compile_s),
        **sched.decode_use(since=counts),
        "before_drain": before_drain,
    }
    by_index = sorted(finished, key=index.get)
    out["completion_tokens"] = [h.completion_tokens for h in by_index]
    out["tpot_by_request_s"] = [_tpot(h) for h in by_index]
    if tokens is not None:
        tokens[:] = [h.tokens for h in by_index]
    if constraint is not None:
        masks = sched.accounting.masks
        out["mask_s_per_token"] = sched.clock.mask_s / masks if masks else None
        out["unconstrained"] = finished_figures([h for h in finished if h in free], wall, 0.0)
        out["unconstrained_requests"] = sorted(index[h] for h in free)
    return out


def _tpot(handle) -> float | None:
    """A finished request's time per output token after its first (None with one token)."""
    n = handle.completion_tokens
    return (handle.token_times_s[-1] - handle.token_times_s[0]) / (n - 1) if n > 1 else None


def finished_figures(finished, wall: float, compile_s: float) -> dict:
    """Counts, throughputs and latency percentiles of the handles `finished` in `wall`
    seconds (compiles' `compile_s` left out)."""
    tokens = sum(h.completion_tokens for h in finished)
    per_token = [t for t in map(_tpot, finished) if t is not None]
    return {
        "requests": len(finished),
        "output_tokens": tokens,
        "time_s": wall,
        "compile_s": compile_s,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(finished) / wall,
        "time_to_first_token_s": _percentiles([h.time_to_first_token_s for h in finished]),
        "time_per_output_token_s": _percentiles(per_token),
    }


def loop_requests(cfg, s: dict, c: int):
    """The closed loop's requests at concurrency c (the same in every pass)."""
    n = max(s["serve_requests_per_concurrency"] * c, 2)
    return serve_requests(cfg, n, s["serve_prompt_lens"], s["serve_output_lens"], s["seed"])
