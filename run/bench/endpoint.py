"""`bench --url`: an OpenAI-compatible endpoint loaded over HTTP, ours (`--url local`
starts `qwen3-spmd serve`) or any other, and `transformers serve` beside it with --peer:
the same synthetic requests at each --serve-concurrency, reported as vLLM's bench does
(the load itself: run.bench.http_load).
"""

from __future__ import annotations

import json
import sys
from functools import partial

from qwen3_spmd.run.flags import CLIError


def bench_endpoint(args, settings: dict, concurrencies: list[int]) -> int:
    """Loads an endpoint (ours, started or given, and transformers serve with --peer)
    with the same synthetic requests at each `concurrencies`; reports like vLLM's bench.
    settings: the flags, checked (run.bench.command)."""
    from qwen3_spmd.run.bench import http_load
    from qwen3_spmd.run.bench.measure import machine
    from qwen3_spmd.run.models import open_model

    spec = open_model(args.model, args.seed, args.revision)
    text = spec.text()
    prompt_lens, output_lens = settings["serve_prompt_lens"], settings["serve_output_lens"]
    per = settings["serve_requests_per_concurrency"]

    def requests_for(c: int):
        n = max(per * c, 2)
        return http_load.synthetic_prompts(
            text, spec.cfg.V, n, prompt_lens, output_lens, settings["seed"]
        )

    say = partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    say(f"bench serve over HTTP: {spec.label}; concurrency {concurrencies}")
    endpoints = []
    if args.url == "local":
        mesh = args.mesh[0] if args.mesh else "1x1"
        # Text prompts re-encode to about as many tokens as drawn: leave them twice.
        seq_len = min(2 * prompt_lens[1] + output_lens[1], spec.cfg.max_position_embeddings)
        # --smoke checks that it all runs: a server that compiles only what it meets.
        precompile = "lazy" if args.smoke else "all"
        max_batch = settings["serve_max_batch"]
        # The server reads the snapshot folder resolved here, not the hub again; without
        # --model it serves the tiny preset measured here (not serve's own demo).
        model = str(spec.folder) if spec.hub_id else (args.model or "tiny")
        started = http_load.ours(model, mesh, max_batch, seq_len, precompile, args.compile_cache)
        with started as srv:
            endpoints.append(_endpoint(srv.url, "qwen3-spmd", concurrencies, requests_for, say))
    else:
        endpoints.append(
            _endpoint(args.url, "endpoint", concurrencies, requests_for, say, args.api_key)
        )
    if args.peer:
        if spec.folder is None:
            raise CLIError("--peer transformers with --url needs --model FOLDER (a checkpoint)")
        with http_load.transformers_serve(str(spec.folder)) as srv:
            endpoints.append(_endpoint(srv.url, "transformers", concurrencies, requests_for, say))
    report = {
        "machine": machine(0),
        "model": spec.label,
        "settings": {**settings, "serve_concurrency": concurrencies, "url": args.url},
        "compile_cache": args.compile_cache if args.url == "local" else None,
        "http": {"endpoints": endpoints, "targets": _http_targets(endpoints)},
    }
    if args.json:
        print(json.dumps(report))
    else:
        from qwen3_spmd.run.bench.report import print_http

        print_http(report)
    return 0


def _endpoint(url, name, concurrencies, requests_for, say, api_key=None) -> dict:
    from qwen3_spmd.run.bench import http_load

    model = http_load.served_model(url, api_key)
    rows = http_load.measure(url, model, requests_for, concurrencies, api_key, say)
    return {"name": name, "url": url, "model": model, "concurrency": rows}


def _http_targets(endpoints) -> dict:
    """The issue's target: output tokens/s at concurrency 8 >= 3x transformers serve's."""
    by = {e["name"]: {r["concurrency"]: r for r in e["concurrency"]} for e in endpoints}
    ours = by.get("qwen3-spmd") or by.get("endpoint") or {}
    peer = by.get("transformers", {})
    if 8 not in ours or 8 not in peer or not peer[8]["output_tokens_per_s"]:
        return {}
    ratio = ours[8]["output_tokens_per_s"] / peer[8]["output_tokens_per_s"]
    return {"serve_http_c8_vs_transformers": {"value": ratio, "target": 3.0, "met": ratio >= 3.0}}
