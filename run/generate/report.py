"""`generate`'s report: the run as one JSON object (--json) or as a person reads it,
with the traffic and memory figures, the schedules' timelines and --logits-out."""

from __future__ import annotations

import dataclasses

from qwen3_spmd.run.flags import CLIError
from qwen3_spmd.run.generate.job import Job


def run_report(args, job: Job, engine, out, procs, cache, speculator=None) -> dict:
    """The run as one JSON-ready dict (every process computes it; process 0 prints it)."""
    from qwen3_spmd.run import traffic
    from qwen3_spmd.sharding.mesh import stage_devices

    cfg, mesh = job.spec.cfg, job.mesh
    D, S, C, X = (mesh.shape[a] for a in ("data", "stage", "seq", "tensor"))
    read = getattr(job.spec.source, "bytes_read", 0) or 0
    text = job.text
    return {
        "model": {"name": job.spec.label, "random_weights": job.spec.random},
        "dtype": job.dtype_name,
        "bytes_per_value": engine.dtype.itemsize,
        "mesh": {"data": D, "stage": S, "seq": C, "tensor": X},
        "processes": procs.count,
        "devices_unused": job.unused_devices,
        "stage_layers": engine.plan.stage_layers,
        "stage_devices": [[int(d.id) for d in row] for row in stage_devices(mesh)],
        "stage_processes": [
            sorted({int(d.process_index) for d in row}) for row in stage_devices(mesh)
        ],
        "requests": [
            {
                "prompt_ids": c.prompt_ids,
                "token_ids": c.token_ids,
                "text": text.decode(c.token_ids) if text else None,
                "finish_reason": c.finish_reason,
            }
            for c in out.completions
        ],
        "timing": out.timing,
        "compile_cache": cache.report(),
        "max_seq_len": job.max_seq_len,
        "bytes_between_stages": traffic.bytes_between_stages(
            cfg,
            S,
            [len(p) for p in job.prompts],
            [len(c.token_ids) - 1 for c in out.completions],
            engine.dtype.itemsize,
        ),
        "bytes_sent": traffic.bytes_sent(cfg, S, C, out.layout, engine.dtype.itemsize),
        "bytes_all_reduced_per_device": traffic.bytes_all_reduced(
            cfg, S, C, X, out.layout, engine.dtype.itemsize, D
        ),
        # Qwen3-MoE's "a2a" split: its two all-to-alls (zeros under the others)
        "bytes_all_to_all_per_device": traffic.bytes_all_to_all(
            cfg, engine.split, S, C, out.layout, engine.dtype.itemsize
        ),
        "schedule": engine.schedules(out.layout),
        "kv_bytes_per_device": max(traffic.bytes_per_device((out.cache.k, out.cache.v))),
        "kv_cache": _pool_report(engine, out.cache.k.shape[1]),
        "weight_bytes_per_device": max(traffic.bytes_per_device(engine.weights.state)),
        # what each process read from the checkpoint (0 for random weights)
        "weight_bytes_read_per_process": _per_process(read, procs),
        "layout": out.layout,
        **_cp_report(out.layout, out.timing),
        **_speculative_report(speculator),
    }


def _pool_report(engine, pages: int) -> dict:
    """The pool of KV pages the run held: its pages (each `data` replica an equal part),
    the tokens a page and the pool hold (over the seq devices), and how many requests of
    max_seq_len tokens it holds."""
    page_tokens = engine.block_size * engine.C
    return {
        "pages": pages,
        "replicas": engine.D,
        "page_tokens": page_tokens,
        "tokens": pages * page_tokens,
        "max_concurrency": pages / engine.pages_per_row,
    }


def _speculative_report(speculator) -> dict:
    """With --speculative-config: the config and the drafts proposed and accepted."""
    if speculator is None:
        return {}
    m = speculator.metrics
    return {
        "speculative": {
            **dataclasses.asdict(speculator.config),
            "num_drafts": m.drafts,
            "num_draft_tokens": m.draft_tokens,
            "num_accepted_tokens": m.accepted_tokens,
            "mean_acceptance_length": m.mean_acceptance_length,
        }
    }


def _cp_report(layout: dict, timing: dict) -> dict:
    """The strategy prefill ran along `seq`, the bytes it moved per device (cost model,
    pipeline.runtime.cp_cost) and the model's time next to the measured one."""
    chosen = layout["cp"][layout["cp_strategy"]]
    return {
        "cp_strategy": layout["cp_strategy"],
        "cp_bytes_per_device": chosen["bytes_per_device"],
        "cp_predicted_prefill_s": chosen["predicted_s"],
        "cp_measured_prefill_s": timing["prefill_s"],
    }


def _per_process(value: int, procs) -> list[int]:
    if not procs.many:
        return [int(value)]
    import numpy as np
    from jax.experimental import multihost_utils

    return [
        int(v)
        for v in np.asarray(multihost_utils.process_allgather(np.array([value], np.int64))).reshape(
            -1
        )
    ]


def write_logits(path: str, logits) -> None:
    import numpy as np

    try:
        with open(path, "wb") as f:  # the path given (np.save would add .npy)
            np.save(f, logits)
    except OSError as e:
        raise CLIError(f"--logits-out {path}: cannot write it ({e.strerror})") from None


def timelines(engine, layout: dict) -> tuple[str, str]:
    from qwen3_spmd.pipeline.programs.schedule import decode_grid, prefill_grid, timeline

    steps = min(layout["chunk"], max(layout["decode_steps"], 1))
    return (
        timeline(prefill_grid(engine.M, engine.stages), "prefill"),
        timeline(decode_grid(layout["groups"], engine.stages, steps), "decode"),
    )


def _from_cache(c: dict) -> str:
    n = c["programs_read"]
    return f" ({n} program{'s' * (n != 1)} read from the compile cache)" if n else ""


def readable(r: dict, prompts, text, streamed: bool, timelines=(), demo=False) -> str:
    """The report the way a person reads it."""
    lines = [""]
    if not streamed:
        for n, req in enumerate(r["requests"]):
            shown = req["text"] if text is not None else " ".join(map(str, req["token_ids"]))
            lines.append(
                f"[{n}] ({len(prompts[n])} prompt tokens -> {len(req['token_ids'])} "
                f"new, {req['finish_reason']}) {shown}"
            )
        lines.append("")
    lines.append(
        "stages (layers each stage holds, and its seq devices, numbered by mesh position):"
    )
    D, S, C = r["mesh"]["data"], len(r["stage_layers"]), r["mesh"]["seq"]
    for s, (first, last) in enumerate(r["stage_layers"]):
        procs = r["stage_processes"][s]
        where = f" in process {', '.join(map(str, procs))}" if r["processes"] > 1 else ""
        at = [d * S * C + s * C + c for d in range(D) for c in range(C)]  # every replica's
        lines.append(
            f"  stage {s}: layers {first}-{last}  on devices {', '.join(map(str, at))}{where}"
        )
    if timelines:
        lines += [
            "",
            "timeline (a column per tick: the microbatch (prefill) or request group "
            "(decode) each stage works on; blank = idle):",
        ]
        for t in timelines:
            lines += ["  " + row for row in t.splitlines()]
    t = r["timing"]
    lines += [
        "",
        f"{'bytes between stages:':<27}{r['bytes_between_stages']:>12,}  (hidden states "
        f"at {r['bytes_per_value']} bytes per value)",
        f"{'KV cache bytes per device:':<27}{r['kv_bytes_per_device']:>12,}  "
        f"({r['kv_cache']['pages']} pages of {r['kv_cache']['page_tokens']} tokens"
        f"{', ' + str(r['kv_cache']['replicas']) + ' replicas' if D > 1 else ''})",
        f"{'weight bytes per device:':<27}{r['weight_bytes_per_device']:>12,}",
        # With one seq device nothing moves along seq: no strategy to name.
        f"{'seq attention:':<27}{r['cp_strategy']:>12}  ({r['cp_bytes_per_device']:,} "
        f"bytes per device; prefill predicted {r['cp_predicted_prefill_s']:.3f} s)"
        if C > 1
        else f"{'seq attention:':<27}{'none':>12}  (one seq device)",
        f"time: prefill {t['prefill_s']:.3f} s ({t['prefill_tokens_per_s']:.1f} tok/s), "
        f"decode {t['decode_s']:.3f} s ({t['decode_tokens_per_s']:.1f} tok/s), "
        f"compile {t['compile_s']:.1f} s{_from_cache(r['compile_cache'])}",
    ]
    if "matches_single_device" in r:
        lines.append(
            f"matches_single_device: {str(r['matches_single_device']).lower()} "
            f"(the tokens of a one-device run of the same requests; max logits error "
            f"{r['max_error_vs_single_device']:.2e})"
        )
    if demo:
        lines += [
            "",
            "(the built-in demo: Qwen3's real tokenizer, but random weights, so the text is "
            "noise; pass --model a Hugging Face Qwen3 folder or hub id for real text)",
        ]
    return "\n".join(lines)
