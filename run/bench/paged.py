"""bench --scenario paged: the paged KV cache under a served load.

One load of --serve-requests x --serve-max-batch requests (prompts of
--serve-prompt-lens random tokens, --serve-output-lens new tokens each, greedy, no end
id) with --serve-max-batch in flight, through a Scheduler of that many rows over a
pool of --kv-cache-memory-bytes, and the same load and pool through 2 rows (what rows
of the whole --decode-cache-len gave at that memory before pages), each timed after a
warm-up pass of the same load: output tokens/s of both and their ratio, the most
requests decoding at once, the preemptions, the pool's pages, the tokens they hold and
its maximum concurrency; and whether every request got the same tokens in both.
"""

from __future__ import annotations

from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.run.bench.loops import closed_loop, loop_requests

DEFAULT_MAX_MODEL_LEN = 4096  # a request's tokens at most, without --decode-cache-len


def paged_job(engines, settings: dict, say) -> dict:
    s = settings
    engine = engines.get(s["decode_cache_len"] or DEFAULT_MAX_MODEL_LEN)
    pool = s["kv_cache_memory_bytes"]
    flight = s["serve_max_batch"]
    requests = loop_requests(engines.cfg, s, flight)
    out, tokens = {}, {}
    for rows in (flight, 2):
        for _ in range(max(s["warmup"], 1)):  # meets (and compiles) what the timed pass will
            closed_loop(Scheduler(engine, rows, kv_cache_memory_bytes=pool), requests, flight)
        sched = Scheduler(engine, rows, kv_cache_memory_bytes=pool)
        tokens[rows] = []
        loop = closed_loop(sched, requests, flight, tokens=tokens[rows])
        out[f"rows_{rows}"] = {
            "max_num_seqs": sched.B,
            "output_tokens_per_s": loop["output_tokens_per_s"],
            "output_tokens": loop["output_tokens"],
            "time_s": loop["time_s"],
            "most_running": sched.most_running,
            "preemptions": sched.preemptions,
            "row_occupancy": loop["row_occupancy"],
            "time_to_first_token_s": loop["time_to_first_token_s"],
            "time_per_output_token_s": loop["time_per_output_token_s"],
        }
        say(
            f"  paged, {sched.B} rows: {loop['output_tokens_per_s']:.1f} tok/s, at most "
            f"{sched.most_running} decoding at once, {sched.preemptions} preemptions"
        )
    many, two = out[f"rows_{flight}"], out["rows_2"]
    out.update(
        pages=sched.pages,
        block_size=engine.block_size,
        kv_tokens=sched.kv_tokens,
        kv_bytes_per_device=sched.kv_bytes_per_device,
        max_model_len=engine.max_seq_len,
        max_concurrency=sched.max_concurrency,
        requests=len(requests),
        speedup_vs_2_rows=many["output_tokens_per_s"] / two["output_tokens_per_s"],
        same_tokens=tokens[flight] == tokens[2],
    )
    say(
        f"  paged: {out['speedup_vs_2_rows']:.2f}x the tokens/s of 2 rows; pool "
        f"{out['kv_tokens']:,} tokens ({out['max_concurrency']:.2f}x at {engine.max_seq_len}); "
        f"same tokens: {out['same_tokens']}"
    )
    return out
