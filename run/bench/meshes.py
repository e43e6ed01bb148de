"""`bench` in this process: each scenario's jobs on every --mesh (1x1 first), the
rooflines and the transformers peer, then the report.

The scenarios and how each figure is taken: run.bench.command's docstring and
run.bench.measure. This module checks what the flags ask of the model and the devices,
then runs the jobs (run.bench.jobs) mesh by mesh.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

from qwen3_spmd.run.flags import (
    CLIError,
    check_output_file,
    dtype_name,
    in_flags,
    platform_is_cpu,
    use_cpu_devices,
)


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
    if "embed" in scenarios and s["embed_lens"][1] > positions:
        raise CLIError(
            f"--embed-lens {s['embed_lens'][1]}: the model has {positions} positions: use "
            "lengths up to it"
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
        split = TensorSplit.of(m.tensor, m.data, args.expert_split)
        split.check(cfg)
        for cp in cps:
            try:
                cp_cost.check_cp(split.local(cfg), m.seq, cp)
            except RequestError as e:
                raise CLIError(f"--mesh {m}: {in_flags(e)}") from None
    return cps


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
def bench_meshes(args, settings: dict) -> int:
    """bench without --url: `settings` (the flags, checked: run.bench.command) run on
    every mesh; prints the report (--json: one JSON object)."""
    meshes = _meshes(args)
    scenarios = _scenarios(args, meshes)

    import jax

    # Compile times are part of the figures: every program compiles here, none is read
    # from a persistent cache (generate's, or $JAX_COMPILATION_CACHE_DIR), unless
    # --compile-cache names one.
    from qwen3_spmd.run import compile_cache

    cache = compile_cache.use(args.compile_cache or "off")

    from qwen3_spmd.run.bench.jobs import MeshEngines, run_mesh
    from qwen3_spmd.run.bench.measure import MemoSource, machine
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
    # What every mesh's jobs share.
    common = dict(dtype=dtype, settings=settings, scenarios=scenarios, roof=roof, say=say)
    common["grammars"] = grammars
    for m in meshes:
        alone = m.devices == 1
        mesh = (
            single.mesh
            if alone
            else make_mesh(m.stage, m.seq, jax.devices()[: m.devices], tensor=m.tensor, data=m.data)
        )
        engines = single if alone else None
        for cp in cps if m.seq > 1 else ["ring"]:
            entry = run_mesh(spec.cfg, source, mesh, engines=engines, cp=cp, **common)
            report["meshes"].append(entry)
    add_ratios(report["meshes"])
    if "embed" in scenarios:
        from qwen3_spmd.run.bench.embed import add_embed_ratios

        add_embed_ratios(report["meshes"])

    if "peer" in scenarios:
        from qwen3_spmd.run.bench.peer import run_peer

        embed = report["meshes"][0].get("embed")  # 1x1's, which the peer's is paired with
        report["peer"] = run_peer(spec, source, single, settings, scenarios, say, embed)
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
