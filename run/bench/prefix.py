"""bench --scenario serve --serve-shared-prefix N: the prefix cache against no cache, in
one run, on the loads it is for and on one it is not.

    shared      16 requests whose prompts are one N-token system prompt and a user turn
                of 16-64 tokens, in a closed loop over every row;
    turns       4 conversations of 4 turns: each turn's prompt is the turn before's
                prompt, its reply (the tokens the model gave) and a new user turn of
                16-64 tokens; the 4 run at once, each next turn when its reply is in;
    unshared    the closed loop of the serve scenario's own requests (random prompts,
                nothing to share): what the cache costs where it cannot help.

Each load runs once to compile what it meets, then timed with the cache and without,
in turn, over the same pool of KV pages (every row's most). Ratios are the cache's
over no cache's: time to first token p50 (lower is better) and output tokens/s.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.run.bench.loops import closed_loop, finished_figures, loop_requests

SHARED_REQUESTS, USER_TURN = 16, (16, 64)
CONVERSATIONS, TURNS = 4, 4


def longest_prompt(prefix: int, output_lens) -> int:
    """The longest prompt the loads build: a conversation's last turn."""
    return prefix + TURNS * USER_TURN[1] + (TURNS - 1) * output_lens[1]


def prefix_job(engine, settings: dict, B_max: int, say) -> dict:
    """The three loads with the cache and without on `engine` (its max_seq_len holds
    `longest_prompt` and the outputs)."""
    s = settings
    rng = np.random.default_rng([s["seed"], 7])
    words = lambda n: rng.integers(0, engine.cfg.V, n).tolist()  # noqa: E731
    turn_len = lambda: int(rng.integers(USER_TURN[0], USER_TURN[1] + 1))  # noqa: E731
    out_len = lambda: int(rng.integers(s["serve_output_lens"][0], s["serve_output_lens"][1] + 1))  # noqa: E731
    system = words(s["serve_shared_prefix"])
    shared = [(system + words(turn_len()), out_len()) for _ in range(SHARED_REQUESTS)]
    conversations = [
        [(words(turn_len()), out_len()) for _ in range(TURNS)] for _ in range(CONVERSATIONS)
    ]
    for c in conversations:  # every conversation opens with the system prompt
        c[0] = (system + c[0][0], c[0][1])
    unshared = loop_requests(engine.cfg, s, B_max)

    def scheduler(cache: bool) -> Scheduler:
        sched = Scheduler(engine, B_max, prefix_caching=cache)
        # A server fills its pool with zeros once, at start: not a request's time.
        jax.block_until_ready(sched.executor.cache)
        return sched

    loads = {
        "shared": lambda sched: closed_loop(sched, shared, B_max),
        "turns": lambda sched: _turns(sched, conversations),
        "unshared": lambda sched: closed_loop(sched, unshared, B_max),
    }
    pool = engine.copies.cache_bytes_per_device(B_max)
    out = {"prefix_tokens": len(system), "pool_bytes_per_device": pool}
    for name, load in loads.items():
        for cache in (True, False):  # compiles every shape the timed runs meet
            load(scheduler(cache))
        timed = {}
        for cache in (True, False):
            sched = scheduler(cache)
            timed[cache] = load(sched)
            if cache:
                p = sched.prefix
                timed[cache]["hit_rate"] = p.hits / p.queries if p.queries else 0.0
                timed[cache]["block"] = p.block
        ttft = [timed[c]["time_to_first_token_s"]["p50"] for c in (True, False)]
        row = {
            "cache": timed[True],
            "no_cache": timed[False],
            "ttft_p50_ratio": ttft[0] / ttft[1],
            "throughput_ratio": timed[True]["output_tokens_per_s"]
            / timed[False]["output_tokens_per_s"],
        }
        out[name] = row
        say(
            f"  prefix cache, {name}: TTFT p50 {ttft[0]:.2f} s vs {ttft[1]:.2f} s "
            f"({row['ttft_p50_ratio']:.2f}x), {timed[True]['output_tokens_per_s']:.1f} vs "
            f"{timed[False]['output_tokens_per_s']:.1f} tok/s ({row['throughput_ratio']:.2f}x), "
            f"hit rate {timed[True]['hit_rate']:.2f}"
        )
    return out


def _turns(sched: Scheduler, conversations) -> dict:
    """The conversations at once, each turn submitted when the one before has its reply:
    its prompt is the turn before's prompt, that reply and the new user turn."""
    compile_before = sched.clock.compile_s
    t0 = time.perf_counter()
    prompts = [c[0][0] for c in conversations]
    live = {i: sched.submit(prompts[i], Params(c[0][1])) for i, c in enumerate(conversations)}
    turn = dict.fromkeys(live, 0)
    finished = []
    while live:
        sched.step()
        for i, handle in list(live.items()):
            if not handle.done:
                continue
            finished.append(handle)
            del live[i]
            turn[i] += 1
            if turn[i] < len(conversations[i]):
                user, n = conversations[i][turn[i]]
                prompts[i] = list(prompts[i]) + handle.tokens + user
                live[i] = sched.submit(prompts[i], Params(n))
    compile_s = sched.clock.compile_s - compile_before
    return finished_figures(finished, time.perf_counter() - t0 - compile_s, compile_s)
