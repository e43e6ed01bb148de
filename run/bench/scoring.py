"""bench --scenario prompt_logprobs: a prefill with the prompt's log-probabilities (every
token scored: lm_head, a log-softmax and the top ones over each position, as an
evaluation harness asks) against the same prefill without, in one run.

Each prompt length of --prompt-lens is prefilled --prefill-batch prompts at a time
through `Engine.prefill`, both ways in turn (compiled first, then --warmup and --repeats
calls of each), the first token sampled and the log-probabilities brought to the host as
a server does. The ratio is the scored prefill's median time over the plain one's.
"""

from __future__ import annotations

import time

from qwen3_spmd.pipeline.programs.layout import lay_out
from qwen3_spmd.pipeline.programs.sampling import RowSampling, Sampling
from qwen3_spmd.pipeline.requests import fitting_seq_len
from qwen3_spmd.pipeline.runtime.registry import Clock
from qwen3_spmd.run.bench.measure import prompts_for, spread


def prompt_logprobs_job(engines, T: int, say) -> dict:
    """The prefill of T-token prompts with the prompt's log-probabilities and without."""
    cfg, s = engines.cfg, engines.s
    B, C = s["prefill_batch"], engines.mesh.shape["seq"]
    engine = engines.get(fitting_seq_len(T, 1, C))
    prompts = prompts_for(cfg, B, T, s["seed"])
    targets = [p[1:] + [-1] for p in prompts]

    def run(scored: bool) -> float:
        batch = lay_out(
            prompts,
            engine.M,
            1,
            engine.C,
            engine.slots_per_device,
            targets=targets if scored else None,
        )
        strategy = engine.cp_plan(batch.B, batch.P_pad)[0]
        params = RowSampling.of(Sampling(), 0, batch.request)
        clock = Clock()
        t0 = time.perf_counter()
        engine.prefill(batch, strategy, params, False, clock)  # first tokens and scores on the host
        return time.perf_counter() - t0 - clock.compile_s

    compile_s = {}
    for scored in (False, True):
        t0 = time.perf_counter()
        run(scored)
        compile_s[scored] = time.perf_counter() - t0
        for _ in range(s["warmup"]):
            run(scored)
    times = {False: [], True: []}
    for _ in range(s["repeats"]):  # alternating, so both meet the same machine
        for scored in (False, True):
            times[scored].append(run(scored))
    plain, scored = spread(times[False]), spread(times[True])
    out = {
        "prompt_len": T,
        "batch": B,
        "plain_s": plain,
        "scored_s": scored,
        "ratio": scored["median"] / plain["median"],
        "first_call_s": {"plain": compile_s[False], "scored": compile_s[True]},
    }
    say(
        f"  prompt log-probabilities T={T} B={B}: {scored['median']:.3f} s vs "
        f"{plain['median']:.3f} s without ({out['ratio']:.2f}x)"
    )
    return out
