"""bench --scenario serve: a closed-loop load through the continuous-batching scheduler,
and the same requests as static batches through `static_batch.generate`, in one run
(the loops and their figures: run.bench.loops).
"""

from __future__ import annotations

import time

import numpy as np

from qwen3_spmd.pipeline.programs.schedule import decode_grid, stats
from qwen3_spmd.pipeline.requests import fitting_seq_len
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.run.bench.loops import closed_loop, loop_requests, serve_requests


def static_batches(engine, requests, batch: int) -> dict:
    """The same requests through static_batch.generate, `batch` at a time in order; each batch
    runs until its longest request is done (its output budget is the batch's largest)."""
    tokens, wall, compile_s = 0, 0.0, 0.0
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        t0 = time.perf_counter()
        out = static_batch.generate(
            engine, [p for p, _ in group], max(n for _, n in group), with_logits=False
        )
        wall += time.perf_counter() - t0 - out.timing["compile_s"]
        compile_s += out.timing["compile_s"]
        tokens += sum(min(len(c.token_ids), n) for c, (_, n) in zip(out.completions, group))
    return {
        "output_tokens": tokens,
        "time_s": wall,
        "compile_s": compile_s,
        "output_tokens_per_s": tokens / wall,
    }


def serve_job(engines, settings: dict, say) -> dict:
    """The serve scenario on one mesh: each concurrency's closed loop next to static
    batches of the same requests, and a static batch of equal-length requests."""
    s = settings
    cfg = engines.cfg
    C, S = engines.mesh.shape["seq"], engines.mesh.shape["stage"]
    longest_output = s["serve_output_lens"][1]
    engine, B_max, sched_rows = _serve_engine(engines, s)
    G = engine.groups_for(S)
    concurrencies = sorted({1, G, sched_rows, 2 * sched_rows})
    steady = stats(decode_grid(G, S, engine.chunk), skip_edges=S - 1)["idle_fraction"]
    rows = []
    for c in concurrencies:
        reqs = loop_requests(cfg, s, c)
        # A closed loop of one thread is deterministic: a first pass meets (and compiles)
        # every shape the timed one will; the same for the static batches.
        for _ in range(max(s["warmup"], 1)):
            closed_loop(Scheduler(engine, B_max), reqs, c)
            static_batches(engine, reqs, min(c, sched_rows))
        loop = closed_loop(Scheduler(engine, B_max), reqs, c)
        static = static_batches(engine, reqs, min(c, sched_rows))
        row = {
            "concurrency": c,
            **loop,
            "static": static,
            "speedup_vs_static": loop["output_tokens_per_s"] / static["output_tokens_per_s"],
            # the decode schedule's bubbles in a long chunk with every row busy
            "steady_idle_fraction": steady,
        }
        rows.append(row)
        say(
            f"  serve c={c}: {loop['output_tokens_per_s']:.1f} tok/s "
            f"({row['speedup_vs_static']:.2f}x static batches of {min(c, sched_rows)}), "
            f"{loop['requests_per_s']:.2f} req/s, TTFT p50 "
            f"{loop['time_to_first_token_s']['p50']:.2f} s, TPOT p50 "
            f"{1e3 * (loop['time_per_output_token_s']['p50'] or 0):.0f} ms, rows busy "
            f"{loop['row_occupancy']:.2f}, stages idle {loop['stage_idle_fraction']:.2f}"
        )
    out = {
        "max_batch": sched_rows,
        "groups": G,
        "kv_bytes_per_device": engine.copies.cache_bytes_per_device(sched_rows),
        "concurrency": rows,
        "static_equal_batch": _static_equal_batch(engine, s, sched_rows),
        "paired": _paired(engine, s, B_max, sched_rows),
    }
    if s.get("serve_shared_prefix"):
        from qwen3_spmd.run.bench.prefix import longest_prompt, prefix_job

        longest = longest_prompt(s["serve_shared_prefix"], s["serve_output_lens"])
        prefixed = engines.get(fitting_seq_len(2 * longest, longest_output, C))
        out["prefix_cache"] = prefix_job(prefixed, s, B_max, say)
    return out


# A bounded schema (every answer ends by its grammar, in about 30 of Qwen3's tokens).
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["order", "refund", "question", "complaint"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["id", "ok", "kind", "tags"],
    "additionalProperties": False,
}


def _serve_engine(engines, s: dict):
    """(the engine the serve loads run on, the scheduler's max_batch, its rows: a
    multiple of the decode groups)."""
    C, S = engines.mesh.shape["seq"], engines.mesh.shape["stage"]
    longest_prompt, longest_output = s["serve_prompt_lens"][1], s["serve_output_lens"][1]
    # Bucketed admissions pad a prompt up to twice its length: leave them the room.
    engine = engines.get(fitting_seq_len(2 * longest_prompt, longest_output, C))
    B_max = s["serve_max_batch"]
    G = engine.groups_for(S)
    return engine, B_max, -(-B_max // G) * G


def structured_scenario(engines, settings: dict, grammars, say) -> dict:
    """The structured scenario on one mesh: `structured_job` on the serve loads' engine,
    at the scheduler's rows (skipped without `grammars`: the model has no tokenizer)."""
    if grammars is None:
        return {"skipped": "the model has no tokenizer, and fewer ids than Qwen3's"}
    engine, B_max, rows = _serve_engine(engines, settings)
    return structured_job(engine, settings, B_max, rows, grammars, say)


def structured_job(engine, s: dict, B_max: int, rows: int, grammars, say) -> dict:
    """A structured load against the same load unconstrained, closed loops at
    concurrency `rows` (compiled by a first pass each): every request following
    STRUCTURED_SCHEMA, then the same prompts unconstrained with the budgets the
    constrained answers took (a grammar ends an answer early: the same tokens to make,
    the same prefills), and the loop with every other request constrained; output
    tokens/s and the host's mask time per token. With half constrained, the others' time
    per output token is set against the same requests' in the unconstrained loop, in
    `min(repeats, 3)` pairs of the two loops run back to back (the host's speed drifts
    over minutes; a request's TPOT depends on its length and on the prefills beside it),
    and the pairs' median ratio is quoted. grammars: the model's
    (`pipeline.structured.constraints.Grammars`)."""
    from qwen3_spmd.pipeline.structured.constraints import Constraint

    constraint = Constraint.json_schema(STRUCTURED_SCHEMA)
    reqs = loop_requests(engine.cfg, s, rows)

    def loop(held, every=1) -> dict:
        return closed_loop(Scheduler(engine, B_max, grammars=grammars), reqs, rows, held, every)

    loop(constraint)  # compiles
    full = loop(constraint)
    reqs = [(p, n) for (p, _), n in zip(reqs, full["completion_tokens"])]
    loop(None)  # compiles
    loop(constraint, 2)
    ratios = []
    for _ in range(max(1, min(s["repeats"], 3))):
        free, half = loop(None), loop(constraint, 2)
        ratios.append(_others_tpot_ratio(free, half))
    ratio = full["output_tokens_per_s"] / free["output_tokens_per_s"]
    quoted = [r for r in ratios if r is not None]
    tpot_ratio = float(np.median(quoted)) if quoted else None
    say(
        f"  serve structured c={rows}: {full['output_tokens_per_s']:.1f} tok/s "
        f"({ratio:.2f}x unconstrained), mask {1e6 * (full['mask_s_per_token'] or 0):.0f} us "
        f"per token; half constrained: the others' TPOT {tpot_ratio or 0:.2f}x "
        f"(pairs: {', '.join(f'{r:.2f}' for r in quoted)})"
    )
    return {
        "concurrency": rows,
        "schema": STRUCTURED_SCHEMA,
        "constrained": full,
        "unconstrained": free,  # the last pair's
        "half": half,
        "constrained_vs_unconstrained_tokens_per_s": ratio,
        "half_others_tpot_vs_unconstrained": tpot_ratio,
        "half_others_tpot_ratios": ratios,
    }


def _others_tpot_ratio(free: dict, half: dict) -> float | None:
    """Median TPOT of the half-constrained loop's unconstrained requests over the median
    of the same requests' in the unconstrained loop (None: none made two tokens)."""
    pairs = [
        (half["tpot_by_request_s"][i], free["tpot_by_request_s"][i])
        for i in half["unconstrained_requests"]
    ]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs:
        return None
    return float(np.median([a for a, _ in pairs]) / np.median([b for _, b in pairs]))


def _equal_requests(cfg, s: dict, batch: int):
    """`batch` requests of equal lengths, the ranges' middles."""
    prompt_len = sum(s["serve_prompt_lens"]) // 2
    output_tokens = sum(s["serve_output_lens"]) // 2
    lengths = (prompt_len, prompt_len), (output_tokens, output_tokens)
    return serve_requests(cfg, batch, *lengths, s["seed"])


def _static_equal_batch(engine, s: dict, batch: int) -> dict:
    """The targets' reference: one static batch of equal requests."""
    equal = _equal_requests(engine.cfg, s, batch)
    static_batches(engine, equal, batch)  # compiles
    measured = static_batches(engine, equal, batch)
    return {
        "batch": batch,
        "prompt_len": len(equal[0][0]),
        "new_tokens_per_request": equal[0][1],
        **measured,  # output_tokens: the batch's
    }


def _paired(engine, s: dict, B_max: int, rows: int) -> dict:
    """The targets' ratios from measurements taken back to back: the host's speed drifts
    by tens of percent over minutes, so a ratio of two runs minutes apart says as much
    about the drift. `min(repeats, 5)` times in turn: the static batch of `rows` equal
    requests, the closed loop at concurrency `rows`, the equal batch again and the loop
    at concurrency 1 (all compiled by the passes before); the loop is set against the
    equal batch's runs on either side of it pooled (a batch of seconds beside a loop of
    tens of them: one run of it samples a moment of the host's speed). Each ratio of a
    turn, and their median."""
    full, one = loop_requests(engine.cfg, s, rows), loop_requests(engine.cfg, s, 1)
    equal = _equal_requests(engine.cfg, s, rows)
    vs_c1, vs_equal = [], []
    for _ in range(min(s["repeats"], 5)):
        before = static_batches(engine, equal, rows)
        loaded = closed_loop(Scheduler(engine, B_max), full, rows)["output_tokens_per_s"]
        after = static_batches(engine, equal, rows)
        alone = closed_loop(Scheduler(engine, B_max), one, 1)["output_tokens_per_s"]
        batch = (before["output_tokens"] + after["output_tokens"]) / (
            before["time_s"] + after["time_s"]
        )
        vs_c1.append(loaded / alone)
        vs_equal.append(loaded / batch)
    return {
        "concurrency": rows,
        "vs_c1": {"median": float(np.median(vs_c1)), "each": vs_c1},
        "vs_static_equal_batch": {"median": float(np.median(vs_equal)), "each": vs_equal},
    }
