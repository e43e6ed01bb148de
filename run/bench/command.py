"""`bench`: jit-compiled benchmarks of the engine, against the machine's own rooflines
and (optionally) Hugging Face transformers, in one run.

Scenarios (--scenario, repeatable; default all but peer):
  prefill   tokens/s per prompt length (batch --prefill-batch), fraction of the matmul
            roofline, the stage pipeline's idle fraction and the bytes moved per token;
  decode    tokens/s and time per output token per batch size, fraction of the
            bandwidth roofline, idle fraction and bytes moved per token;
  memory    per-device weights and KV cache (addressable shards) and XLA's buffers
            (memory_analysis() of every compiled program);
  roofline  memory bandwidth and matmul throughput measured on this machine;
  peer      the same prompts through transformers' Qwen3ForCausalLM (--peer);
  prompt_logprobs  each prompt length's prefill with the prompt's log-probabilities
            (every token scored, as evaluation harnesses ask) against without, and the
            ratio (run.bench.scoring);
  speculative  decode per batch size with speculation against plain: an oracle drafter
            (every draft accepted) for each k of --spec-tokens, an always-wrong one and
            ngram, tokens/s and acceptance, each run's tokens checked against plain
            decoding's (run.bench.speculative);
  structured  a closed loop at the scheduler's rows of bounded-JSON-Schema requests
            against the same load unconstrained and with half of it constrained:
            output tokens/s, the host's mask time a token, the others' time per output
            token (run.bench.serve.structured_job; needs the model's tokenizer, or
            Qwen3's vocabulary).
Every --mesh runs each job, once per --cp strategy where C > 1 (the seq attention:
ring, ulysses or auto; each prefill job then reports the bytes each device received
along seq and pipeline.runtime.cp_cost's predicted time next to the measured one; roofline then
also measures ppermute and all-to-all bandwidth over the seq devices, which the
prediction uses); 1x1 always runs too and each other mesh reports its time
ratio against it (mesh / 1x1, same job, same process). Each job compiles first (timed
apart), then runs --warmup more times untimed and --repeats times timed: the median is
quoted with (min, max).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from functools import partial

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import (
    CLIError,
    check_output_file,
    dtype_name,
    in_flags,
    int_list,
    platform_is_cpu,
    use_cpu_devices,
)

SCENARIOS = (
    "prefill",
    "decode",
    "memory",
    "roofline",
    "peer",
    "serve",
    "prompt_logprobs",
    "speculative",
    "structured",
)
SMOKE = {
    "prompt_lens": "16,32",
    "batches": "1,2",
    "decode_steps": 4,
    "repeats": 2,
    "chunk": 4,
    "serve_max_batch": 2,
    "serve_prompt_lens": "3,12",
    "serve_output_lens": "2,6",
    "serve_requests": 1,
    "spec_tokens": "2",
}


# Long because it is the flag list, one add_argument per flag in --help's order.
def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark prefill and decode against rooflines and transformers"
    )
    EngineArgs.add_cli_args(
        p,
        "checkpoint folder, hub id (Qwen/Qwen3-0.6B: downloaded on first use) or preset "
        "(tiny, 0.6B, ...; random weights); default: tiny",
        bench=True,
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        default=[],
        help="repeatable; default: prefill, decode, memory, roofline "
        "(and peer when --peer is given)",
    )
    p.add_argument("--prompt-lens", help="prompt lengths for prefill (default 128,512,2048)")
    p.add_argument("--prefill-batch", type=int, default=1, help="requests per prefill job")
    p.add_argument("--batches", help="decode batch sizes (default 1,8,32)")
    p.add_argument(
        "--decode-prompt-len",
        type=int,
        help="prompt length before the decode steps (default: the shortest --prompt-lens)",
    )
    p.add_argument("--decode-steps", type=int, help="decode steps timed per job (default 32)")
    p.add_argument(
        "--spec-tokens",
        metavar="K,...",
        help="speculative: the oracle drafter's draft tokens a pass (default 2,4,8)",
    )
    p.add_argument(
        "--decode-cache-len",
        type=int,
        help="KV cache slots per request in decode jobs, as a server sized for "
        "long requests has (default: just enough for the prompt and steps)",
    )
    p.add_argument("--repeats", type=int, help="timed runs per job (default 5)")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed runs per job after the compiling one (default 1)",
    )
    p.add_argument(
        "--peer",
        choices=("transformers",),
        help="also run Hugging Face transformers on the same weights and prompts",
    )
    p.add_argument(
        "--serve-max-batch",
        type=int,
        help="serve, structured: the scheduler's decode rows (default 8)",
    )
    p.add_argument(
        "--serve-prompt-lens",
        metavar="MIN,MAX",
        help="serve, structured: prompt lengths, uniform in the range (default 16,512)",
    )
    p.add_argument(
        "--serve-output-lens",
        metavar="MIN,MAX",
        help="serve, structured: output tokens per request, uniform in the range (default 16,256)",
    )
    p.add_argument(
        "--serve-requests",
        type=int,
        help="serve, structured: requests per unit of concurrency in each closed loop (default 2)",
    )
    p.add_argument(
        "--serve-shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="serve: also the prefix cache against none, on 16 requests that share an "
        "N-token system prompt, 4 conversations of 4 turns, and the unshared load "
        "(default 0: not run)",
    )
    p.add_argument(
        "--url",
        metavar="URL|local",
        help="serve: load this OpenAI-compatible endpoint over HTTP instead of the "
        "scheduler in-process ('local': start `qwen3-spmd serve` on --model and the first "
        "--mesh for the run); with --peer transformers, `transformers serve` too",
    )
    p.add_argument("--api-key", help="with --url: the endpoint's API key")
    p.add_argument(
        "--serve-concurrency",
        metavar="1,8",
        help="with --url: requests in flight, each level a load of its own (default 1,8)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights (presets) and prompt ids")
    p.add_argument(
        "--layers",
        type=int,
        metavar="L",
        help="a preset cut to its first L layers (full width, random weights)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="read compiled programs from DIR (and keep new ones there), so that a rerun "
        "measures running only: compile_s then times the reads (default: off, every "
        "program compiles and compile_s is the compile; --url local: the server's "
        "--compile-cache, default serve's)",
    )
    p.add_argument(
        "--targets",
        action="store_true",
        help="also print the project's performance targets and whether this run met them "
        "(the JSON always carries them)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="throughput against prompt length per mesh, and the pipeline timeline",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes for tests: prompts 16,32, batches 1,2, 4 steps, 2 repeats (--url "
        "local: a server that compiles each program when first needed)",
    )
    p.set_defaults(func=main)


def _ints(text: str, flag: str) -> list[int]:
    xs = int_list(text, flag)
    if not xs or min(xs) < 1:
        raise CLIError(f"{flag} {text!r} needs positive integers")
    return xs


def _range(text: str, flag: str) -> tuple[int, int]:
    values = _ints(text, flag)
    if len(values) != 2 or values[0] > values[1]:
        raise CLIError(f"{flag} {text}: give MIN,MAX with 1 <= MIN <= MAX, e.g. 16,512")
    return values[0], values[1]


def _settings(args) -> dict:
    smoke = SMOKE if args.smoke else {}

    def given(value, name: str, default):  # a flag given as 0 stays 0 (and is refused)
        return value if value is not None else smoke.get(name, default)

    s = {
        "prompt_lens": _ints(
            given(args.prompt_lens, "prompt_lens", "128,512,2048"), "--prompt-lens"
        ),
        "batches": _ints(given(args.batches, "batches", "1,8,32"), "--batches"),
        "decode_steps": given(args.decode_steps, "decode_steps", 32),
        "repeats": given(args.repeats, "repeats", 5),
        "warmup": args.warmup,
        "chunk": given(args.chunk, "chunk", 16),
        "microbatches": args.microbatches,
        "groups": args.groups,
        "prefill_batch": args.prefill_batch,
        "seed": args.seed,
        "expert_split": args.expert_split,
        "smoke": bool(args.smoke),
        "decode_cache_len": args.decode_cache_len,
        "serve_max_batch": given(args.serve_max_batch, "serve_max_batch", 8),
        "serve_prompt_lens": _range(
            given(args.serve_prompt_lens, "serve_prompt_lens", "16,512"), "--serve-prompt-lens"
        ),
        "serve_output_lens": _range(
            given(args.serve_output_lens, "serve_output_lens", "16,256"), "--serve-output-lens"
        ),
        "serve_requests_per_concurrency": given(args.serve_requests, "serve_requests", 2),
        "serve_shared_prefix": args.serve_shared_prefix,
        "spec_tokens": _ints(given(args.spec_tokens, "spec_tokens", "2,4,8"), "--spec-tokens"),
    }
    s["decode_prompt_len"] = (
        args.decode_prompt_len if args.decode_prompt_len is not None else min(s["prompt_lens"])
    )
    for name, flag in (
        ("decode_steps", "--decode-steps"),
        ("repeats", "--repeats"),
        ("chunk", "--chunk"),
        ("microbatches", "--microbatches"),
        ("prefill_batch", "--prefill-batch"),
        ("decode_prompt_len", "--decode-prompt-len"),
        ("serve_max_batch", "--serve-max-batch"),
        ("serve_requests_per_concurrency", "--serve-requests"),
    ):
        if s[name] < 1:
            raise CLIError(f"{flag} {s[name]} must be at least 1")
    if s["warmup"] < 0:
        raise CLIError(f"--warmup {s['warmup']} must not be negative")
    if s["serve_shared_prefix"] < 0:
        raise CLIError(f"--serve-shared-prefix {s['serve_shared_prefix']} must not be negative")
    if s["decode_cache_len"] is not None:
        from qwen3_spmd.run.bench.measure import decode_cache_len

        decode_cache_len(s, 1)  # too small for one device is too small for any mesh
    return s


def _check_lengths(s: dict, scenarios, positions: int) -> None:
    """The jobs' sequences fit the model's positions, said in bench's own flags."""
    if "prefill" in scenarios and max(s["prompt_lens"]) + 1 > positions:
        raise CLIError(
            f"--prompt-lens {max(s['prompt_lens'])}: a prompt and the token after it "
            f"need {max(s['prompt_lens']) + 1} positions, but the model has "
            f"{positions}: use lengths up to {positions - 1}"
        )
    need = s["serve_prompt_lens"][1] + s["serve_output_lens"][1]
    if scenarios & {"serve", "structured"} and need > positions:
        raise CLIError(
            f"serve requests need up to {need} positions (--serve-prompt-lens and "
            f"--serve-output-lens maxima), but the model has {positions}: shorten one"
        )
    if s["serve_shared_prefix"]:
        from qwen3_spmd.run.bench.prefix import longest_prompt

        if "serve" not in scenarios:
            raise CLIError("--serve-shared-prefix is a part of --scenario serve: add it")
        need = longest_prompt(s["serve_shared_prefix"], s["serve_output_lens"])
        need += s["serve_output_lens"][1]
        if need > positions:
            raise CLIError(
                f"--serve-shared-prefix {s['serve_shared_prefix']}: a conversation's last "
                f"turn needs {need} positions, but the model has {positions}: shorten it "
                f"or --serve-output-lens"
            )
    need = s["decode_prompt_len"] + s["decode_steps"] + 1
    if scenarios & {"decode", "speculative"} and need > positions:
        raise CLIError(
            f"decode jobs need --decode-prompt-len {s['decode_prompt_len']} + "
            f"--decode-steps {s['decode_steps']} + 1 = {need} positions, but the "
            f"model has {positions}: shorten one"
        )


def _meshes(args) -> list:
    """The MeshShapes to run, 1x1 first."""
    from qwen3_spmd.sharding.mesh import MeshShape, parse_mesh

    shapes = [MeshShape(1, 1)]
    for text in args.mesh:
        shape = parse_mesh(text)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def _cps(args, cfg, meshes) -> list[str]:
    """The --cp strategies (default ring), each checked against every mesh first."""
    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.pipeline.requests import RequestError
    from qwen3_spmd.pipeline.runtime import cp_cost

    cps = list(dict.fromkeys(args.cp)) or ["ring"]
    for m in meshes:
        split = TensorSplit(m.tensor, args.expert_split)
        split.check(cfg)
        for cp in cps:
            try:
                cp_cost.check_cp(split.local(cfg), m.seq, cp)
            except RequestError as e:
                raise CLIError(f"--mesh {m}: {in_flags(e)}") from None
    return cps


def machine(device_count: int) -> dict:
    """Platform, CPU or GPU model, device count and versions."""
    import flax
    import jax
    import jaxlib
    import numpy as np

    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None
            )
    except OSError:
        pass
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": device_count,
        "cpu_model": cpu or platform.processor(),
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
    }


def _fewer_layers(spec, layers: int, seed: int):
    """A preset's first `layers` layers at full width, with seeded random weights."""
    import dataclasses

    from qwen3_spmd.model.checkpoint.random_weights import RandomWeights

    if not spec.random:
        raise CLIError(
            "--layers cuts a preset (random weights): pass --model with a preset "
            "name, not a checkpoint folder"
        )
    if not 1 <= layers <= spec.cfg.L:
        raise CLIError(f"--layers {layers} must be between 1 and the preset's {spec.cfg.L}")
    cfg = dataclasses.replace(spec.cfg, num_hidden_layers=layers)
    return dataclasses.replace(
        spec, cfg=cfg, source=RandomWeights(cfg, seed), label=f"{spec.label}, first {layers} layers"
    )


def _check_plot(path: str) -> None:
    """--plot needs matplotlib and a file name in one of the image formats it writes."""
    check_output_file(path, "--plot")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CLIError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    if os.path.splitext(path)[1][1:].lower() not in kinds:
        raise CLIError(
            f"--plot {path}: the name must end in an image format matplotlib "
            f"writes ({', '.join('.' + k for k in sorted(kinds))}), e.g. bench.png"
        )


def _measure_rooflines(dtype, settings: dict, meshes, say) -> dict:
    """The machine's own bandwidth and matmul rooflines, and the link among the `seq`
    devices of each seq size the meshes have (emulated devices share the cores, so the
    rate each device receives at falls with their number); the ratios in the report
    are taken against these, and the cost model of each mesh uses its own link."""
    import jax

    from qwen3_spmd.run.bench.measure import link_bandwidth, rooflines

    roof = rooflines(
        dtype, max(settings["repeats"], 3), max(settings["warmup"], 1), settings["smoke"]
    )
    seqs = sorted({m.seq for m in meshes if m.seq > 1})
    roof["links"] = [link_bandwidth(jax.devices()[:C], settings["smoke"]) for C in seqs]
    for link in roof["links"]:
        say(
            f"link over {link['devices']} devices, received per device: ppermute "
            f"{link['ppermute']['median'] / 1e9:.3f} GB/s, all-to-all "
            f"{link['all_to_all']['median'] / 1e9:.3f} GB/s"
        )
    say(
        f"roofline: {roof['bandwidth_bytes_per_s']['median'] / 1e9:.1f} GB/s, "
        f"{roof['matmul_flops_per_s']['median'] / 1e9:.1f} GFLOP/s ({dtype.name})"
    )
    return roof


def _model_entry(spec) -> dict:
    cfg = spec.cfg
    return {
        "name": spec.label,
        "random_weights": spec.random,
        "params": cfg.param_count(),
        "layers": cfg.L,
        "active_params": cfg.param_count(active=True),
        "vocab": cfg.V,
    }


def _scenarios(args, meshes) -> set[str]:
    """The scenarios to run, checked, and the CPU devices set up, before JAX starts."""
    need = max(m.devices for m in meshes)
    if args.cpu_devices is not None and args.cpu_devices < need:
        raise CLIError(
            f"--mesh {max(meshes, key=lambda m: m.devices)} "
            f"needs {need} devices but --cpu-devices is {args.cpu_devices}: raise it"
        )
    if platform_is_cpu():
        use_cpu_devices(args.cpu_devices or need)
    scenarios = set(args.scenario) or {"prefill", "decode", "memory", "roofline"}
    if args.peer:
        scenarios.add("peer")
    if "peer" in scenarios and not args.peer:
        raise CLIError("--scenario peer needs --peer transformers")
    if args.plot:
        _check_plot(args.plot)
    return scenarios


def _grammars(spec):
    """The structured scenario's grammar engine on the model's tokenizer, or on Qwen3's
    (shipped with the package) for a preset with Qwen3's vocabulary; None: neither."""
    from qwen3_spmd.pipeline.structured.constraints import Grammars
    from qwen3_spmd.run import qwen_tokenizer
    from qwen3_spmd.run.text import Text

    text = spec.text() if spec.folder is not None or spec.qwen_text else None
    if text is not None:
        return Grammars.of_text(text, spec.cfg.V, spec.eos_ids())
    if spec.cfg.V >= qwen_tokenizer.QWEN_VOCAB:
        return Grammars.of_text(Text.qwen(), spec.cfg.V, qwen_tokenizer.EOS_IDS)
    return None


def _dtype(args, meshes):
    """The benchmark's dtype (--dtype, or the platform's: run.flags.dtype_name), after
    checking that the largest mesh has its devices."""
    import jax
    import jax.numpy as jnp

    need = max(m.devices for m in meshes)
    if len(jax.devices()) < need:
        raise CLIError(
            f"the largest --mesh needs {need} devices but {len(jax.devices())} are "
            f"visible: on CPU pass --cpu-devices {need}"
        )
    return jnp.dtype(dtype_name(args.dtype))


# Reads as the benchmark's run in order (plan, rooflines, each mesh, peer, report); each
# step is a function above or in jobs/peer/report.
def main(args) -> int:
    if args.url:
        return _http_main(args)
    settings = _settings(args)
    meshes = _meshes(args)
    scenarios = _scenarios(args, meshes)

    import jax

    # Compile times are part of the figures: every program compiles here, none is read
    # from a persistent cache (generate's, or $JAX_COMPILATION_CACHE_DIR), unless
    # --compile-cache names one.
    from qwen3_spmd.run import compile_cache

    cache = compile_cache.use(args.compile_cache or "off")

    from qwen3_spmd.run.bench.jobs import MeshEngines, run_mesh
    from qwen3_spmd.run.bench.measure import MemoSource
    from qwen3_spmd.run.bench.report import add_ratios, check_targets, print_table
    from qwen3_spmd.run.models import open_model
    from qwen3_spmd.sharding.mesh import make_mesh

    dtype = _dtype(args, meshes)
    dtype_name = dtype.name
    spec = open_model(args.model, args.seed, args.revision)
    if args.layers is not None:
        spec = _fewer_layers(spec, args.layers, args.seed)
    _check_lengths(settings, scenarios, spec.cfg.max_position_embeddings)
    cps = _cps(args, spec.cfg, meshes)
    settings["cp"] = cps
    source = MemoSource(spec.source)
    # With --json, stdout holds only the report.
    say = partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)

    report = {
        "machine": machine(len(jax.devices())),
        "model": _model_entry(spec),
        "dtype": dtype_name,
        "scenarios": sorted(scenarios),
        "settings": settings,
        "compile_cache": cache.path,
    }
    say(
        f"bench: {spec.label}; {dtype_name}; meshes "
        f"{', '.join(map(str, meshes))}; scenarios {', '.join(sorted(scenarios))}"
    )
    roof = None
    if "roofline" in scenarios:
        roof = report["roofline"] = _measure_rooflines(dtype, settings, meshes, say)

    grammars = _grammars(spec) if "structured" in scenarios else None
    # The 1x1 engines (and their compiled programs) stay for the peer's paired runs.
    single = MeshEngines(
        spec.cfg, source, make_mesh(1, 1, jax.devices()[:1]), dtype, settings, "ring", roof
    )
    report["meshes"] = []
    for m in meshes:
        alone = m.devices == 1
        mesh = (
            single.mesh
            if alone
            else make_mesh(m.stage, m.seq, jax.devices()[: m.devices], tensor=m.tensor)
        )
        engines = single if alone else None
        for cp in cps if m.seq > 1 else ["ring"]:
            report["meshes"].append(
                run_mesh(
                    spec.cfg,
                    source,
                    mesh,
                    dtype,
                    settings,
                    scenarios,
                    roof,
                    say,
                    engines,
                    cp,
                    grammars=grammars,
                )
            )
    add_ratios(report["meshes"])

    if "peer" in scenarios:
        from qwen3_spmd.run.bench.peer import run_peer

        report["peer"] = run_peer(spec, source, single, settings, scenarios, say)
    report["targets"] = check_targets(report)

    if args.plot:
        from qwen3_spmd.run.bench.report import plot

        plot(report, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report, targets=args.targets)
    return 0


# ---- bench --scenario serve --url: the HTTP load ------------------------------------------


def _http_main(args) -> int:
    """Loads an endpoint (ours, started or given, and transformers serve with --peer)
    with the same synthetic requests at each concurrency; reports like vLLM's bench."""
    from qwen3_spmd.run.bench import http_load
    from qwen3_spmd.run.models import open_model

    if set(args.scenario) - {"serve"}:
        raise CLIError("--url measures an HTTP endpoint: only --scenario serve goes with it")
    settings = _settings(args)
    concurrencies = _ints(args.serve_concurrency or "1,8", "--serve-concurrency")
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
