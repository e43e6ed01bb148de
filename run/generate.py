"""`generate`: prompts in, tokens (and text) out, on any (stage, seq, tensor) mesh.

Without --model it runs the built-in demo (the `tiny` preset's layers with Qwen3's
vocabulary and tokenizer, seeded random weights) on an emulated 2x2 CPU mesh and says
so; its text is noise, but the tokenizer and the machinery (stage plan, schedules, ring,
sharded cache, the check against one device) are all real.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import CLIError, check_output_file, check_output_folder, int_list

DEMO_PROMPTS = ["The river flows", "Why is the sky blue?"]


# Long because it is the flag list, one add_argument per flag in --help's order.
def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate tokens for prompts on a device mesh")
    EngineArgs.add_cli_args(
        p,
        "Hugging Face checkpoint folder, orbax folder, hub id (Qwen/Qwen3-0.6B: downloaded "
        "on first use), or a preset name (tiny, 0.6B, ..., 32B) with random weights; "
        "default: the demo, tiny with Qwen3's tokenizer and random weights",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt as text (repeatable; needs tokenizer.json)",
    )
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="1,2,3",
        help="a prompt as comma-separated token ids (repeatable)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each text prompt in the checkpoint's chat template",
    )
    p.add_argument(
        "--no-thinking",
        action="store_true",
        help="with --chat: enable_thinking=False (Qwen3 answers without <think>)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help="structured output: each answer is JSON that follows this JSON Schema",
    )
    p.add_argument("--regex", help="structured output: each answer matches this regex")
    p.add_argument(
        "--choice", metavar="A,B,...", help="structured output: each answer is one of these"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed, any integer, taken modulo 2**31; a preset's weights' too (default 0)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="also run on one device and report whether the tokens match",
    )
    p.add_argument("--timeline", action="store_true", help="print the executed schedules")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--logits-out",
        metavar="FILE.npy",
        help="save the first request's logits at each generated step [steps, V]",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="write a JAX profiler trace of the generate run into DIR (TensorBoard, Perfetto)",
    )
    p.set_defaults(func=main)


def _prompts(args, text) -> list[list[int]]:
    prompts = [int_list(raw, "--prompt-ids") for raw in args.prompt_ids]
    for raw in args.prompt:
        if text is None:
            raise CLIError(
                "--prompt needs tokenizer.json in the checkpoint folder, which has "
                "none: pass --prompt-ids 1,2,3 instead"
            )
        prompts.append(text.encode(text.chat(raw, not args.no_thinking) if args.chat else raw))
    if args.chat and not args.prompt:
        raise CLIError("--chat applies to --prompt TEXT prompts, and none was given")
    if args.no_thinking and not args.chat:
        raise CLIError("--no-thinking applies to --chat prompts: add --chat")
    return prompts


def main(args) -> int:
    engine_args = EngineArgs.from_cli(args, weights_seed=args.seed)
    return engine_args.launch(args, lambda runtime: _run(args, engine_args, runtime))


@dataclasses.dataclass
class _Job:
    """What the command line asks for, checked before any weight is loaded."""

    spec: object  # run.models.ModelSpec
    text: object  # run.text.Text, or None without tokenizer.json
    prompts: list[list[int]]
    demo: bool
    dtype_name: str
    sampling: object  # pipeline.programs.sampling.Sampling
    max_seq_len: int
    eos: tuple[int, ...]
    mesh: object  # jax.sharding.Mesh
    unused_devices: int  # devices this process sees that the mesh leaves out
    constraint: object = (
        None  # pipeline.structured.constraints.Constraint: --json-schema, --regex, --choice
    )
    grammars: object = None  # pipeline.structured.constraints.Grammars, with a constraint


def _run(args, engine_args: EngineArgs, runtime) -> int:
    """Checks the job, loads and generates (a progress bar meanwhile), then reports."""
    procs = runtime.procs
    job = _job(args, engine_args, runtime)
    show = procs.leader  # only process 0 prints results; the others stay quiet
    out, engine, speculator, stream = _load_and_generate(args, engine_args, job, procs, show)
    report = _report(args, job, engine, out, procs, runtime.cache, speculator)
    if not show:
        return 0
    if args.check:
        report.update(_check_single_device(args, engine_args, job, out))
    if args.logits_out:
        _write_logits(args.logits_out, out.first_logits)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        _readable(
            report,
            job.prompts,
            job.text,
            streamed=stream is not None and stream.shown_all,
            timelines=_timelines(engine, out.layout) if args.timeline else (),
            demo=job.demo,
        )
    )
    return 0


# Every check of generate's flags before anything loads, in the order a user meets
# them; each failure is one CLIError line.
def _job(args, engine_args: EngineArgs, runtime) -> _Job:
    import jax

    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.pipeline.programs.sampling import Sampling
    from qwen3_spmd.pipeline.requests import check_request, fitting_seq_len
    from qwen3_spmd.pipeline.runtime import cp_cost

    procs, shape = runtime.procs, runtime.shape
    dtype = engine_args.dtype_name()
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    spec = engine_args.open_model()
    text = spec.text()
    prompts = _prompts(args, text)
    demo = args.model is None and not prompts
    if demo:
        prompts = [text.encode(p) for p in DEMO_PROMPTS]
        args.timeline = True  # the demo shows everything, checked where it can be
        args.check = args.check or not procs.many
    if not prompts:
        raise CLIError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    if args.logits_out:
        check_output_file(args.logits_out, "--logits-out")
    if args.profile:
        check_output_folder(args.profile, "--profile")
    seq = shape.seq
    split = TensorSplit(shape.tensor, args.expert_split)
    split.check(spec.cfg)
    mesh = runtime.mesh()
    if args.check and procs.many:
        raise CLIError(
            "--check reruns the requests on one device of one process, which a "
            "multi-process job cannot wait for: compare with a one-process run instead"
        )
    longest = max(len(p) for p in prompts)
    max_seq_len = args.max_seq_len or fitting_seq_len(longest, args.max_new_tokens, seq)
    check_request(spec.cfg, seq, max_seq_len, prompts, args.max_new_tokens)  # before loading
    constraint = _constraint(args)
    grammars = _grammars(constraint, text, spec.cfg.V, spec.eos_ids())
    cp_cost.check_cp(split.local(spec.cfg), seq, args.cp)
    if procs.leader and max_seq_len % seq:
        print(
            f"note: --max-seq-len {max_seq_len} rounded up to {-(-max_seq_len // seq) * seq}, "
            f"a multiple of the {seq} seq devices (each holds the same number of slots)",
            file=sys.stderr,
        )
    return _Job(
        spec=spec,
        text=text,
        prompts=prompts,
        demo=demo,
        dtype_name=dtype,
        sampling=sampling,
        max_seq_len=max_seq_len,
        eos=spec.eos_ids(),
        mesh=mesh,
        unused_devices=len(jax.devices()) - mesh.devices.size,
        constraint=constraint,
        grammars=grammars,
    )


def _load_and_generate(args, engine_args: EngineArgs, job: _Job, procs, show: bool):
    """(Generation, Engine, the streamer or None): loads the weights onto the mesh and
    generates, streaming text when a person reads it."""
    import jax.numpy as jnp

    from qwen3_spmd.run.progress import Progress

    dtype = jnp.dtype(job.dtype_name)
    stage = job.mesh.shape["stage"]
    progress = Progress(enabled=show)
    stream = None
    try:
        source = progress.loading(
            job.spec.source,
            _bytes_to_read(job.spec.cfg, dtype, stage, job.mesh, args.expert_split),
        )
        engine = engine_args.engine(
            job.spec.cfg, source, job.mesh, job.max_seq_len, on_compile=progress.compiling
        )
        speculator = engine_args.speculator(engine, on_compile=progress.compiling)
        progress.done_loading()
        engine.check(job.prompts, args.max_new_tokens)
        if show and not args.json:
            print(f"model: {job.spec.label}\n{_mesh_line(job, procs)}", flush=True)
            stream = (
                _Streamer(job.text, progress)
                if len(job.prompts) == 1
                else _DoneStreamer(job.text, progress, job.prompts, args.max_new_tokens, job.eos)
            )
        out = _generate(engine, args, job.prompts, job.sampling, job.eos, stream, job, speculator)
    finally:
        progress.stop()
    if stream:
        stream.finish()
    return out, engine, speculator, stream


def _mesh_line(job: _Job, procs) -> str:
    """'mesh 2x2 (stage x seq) over 4 CPU devices, float32', and what is left unused."""
    from qwen3_spmd.sharding.mesh import MeshShape

    shape = MeshShape(*job.mesh.devices.shape)
    n = shape.devices
    axes = "stage x seq x tensor" if shape.tensor > 1 else "stage x seq"
    platform = job.mesh.devices.flat[0].platform.upper()
    line = (
        f"mesh {shape} ({axes}) over {n} {platform} device{'s' * (n != 1)}"
        f"{f' in {procs.count} processes' if procs.many else ''}, {job.dtype_name}"
    )
    if job.unused_devices:
        line += (
            f" ({job.unused_devices} more device{'s' * (job.unused_devices != 1)} left "
            "unused: pass --mesh SxC or SxCxX to use them)"
        )
    return line


def _report(args, job: _Job, engine, out, procs, cache, speculator=None) -> dict:
    """The run as one JSON-ready dict (every process computes it; process 0 prints it)."""
    from qwen3_spmd.run import traffic

    cfg, mesh = job.spec.cfg, job.mesh
    S, C, X = mesh.shape["stage"], mesh.shape["seq"], mesh.shape["tensor"]
    read = getattr(job.spec.source, "bytes_read", 0) or 0
    text = job.text
    return {
        "model": {"name": job.spec.label, "random_weights": job.spec.random},
        "dtype": job.dtype_name,
        "bytes_per_value": engine.dtype.itemsize,
        "mesh": {"stage": S, "seq": C, "tensor": X},
        "processes": procs.count,
        "devices_unused": job.unused_devices,
        "stage_layers": engine.plan.stage_layers,
        "stage_devices": [[int(d.id) for d in row.flat] for row in mesh.devices],
        "stage_processes": [
            sorted({int(d.process_index) for d in row.flat}) for row in mesh.devices
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
            cfg, S, C, X, out.layout, engine.dtype.itemsize
        ),
        "schedule": engine.schedules(out.layout),
        "kv_bytes_per_device": max(traffic.bytes_per_device((out.cache.k, out.cache.v))),
        "weight_bytes_per_device": max(traffic.bytes_per_device(engine.weights.state)),
        # what each process read from the checkpoint (0 for random weights)
        "weight_bytes_read_per_process": _per_process(read, procs),
        "layout": out.layout,
        **_cp_report(out.layout, out.timing),
        **_speculative_report(speculator),
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


def _check_single_device(args, engine_args: EngineArgs, job: _Job, out) -> dict:
    """--check: the same requests on one device; do the tokens and logits agree?"""
    import jax

    from qwen3_spmd.pipeline.requests import key_seed
    from qwen3_spmd.pipeline.scheduling import static_batch
    from qwen3_spmd.run import traffic
    from qwen3_spmd.sharding.mesh import make_mesh

    # The same settings on one device: one microbatch and group, ring (nothing to split).
    one = dataclasses.replace(engine_args, microbatches=1, groups=1, cp="ring")
    single = one.engine(
        job.spec.cfg, job.spec.source, make_mesh(1, 1, jax.local_devices()[:1]), job.max_seq_len
    )
    ref = static_batch.generate(
        single,
        job.prompts,
        args.max_new_tokens,
        sampling=job.sampling,
        seed=key_seed(args.seed),
        eos_ids=job.eos,
        constraint=job.constraint,
        grammars=job.grammars,
    )
    return {
        "matches_single_device": all(
            a.token_ids == b.token_ids for a, b in zip(out.completions, ref.completions)
        ),
        "max_error_vs_single_device": traffic.max_abs_error(out.first_logits, ref.first_logits),
    }


def _write_logits(path: str, logits) -> None:
    import numpy as np

    try:
        with open(path, "wb") as f:  # the path given (np.save would add .npy)
            np.save(f, logits)
    except OSError as e:
        raise CLIError(f"--logits-out {path}: cannot write it ({e.strerror})") from None


def _timelines(engine, layout: dict) -> tuple[str, str]:
    from qwen3_spmd.pipeline.programs.schedule import decode_grid, prefill_grid, timeline

    steps = min(layout["chunk"], max(layout["decode_steps"], 1))
    return (
        timeline(prefill_grid(engine.M, engine.stages), "prefill"),
        timeline(decode_grid(layout["groups"], engine.stages, steps), "decode"),
    )


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


def _constraint(args):
    """The structured output --json-schema, --regex or --choice asks for (one at most),
    or None."""
    from qwen3_spmd.pipeline.structured.constraints import Constraint

    given = [f for f in ("json_schema", "regex", "choice") if getattr(args, f) is not None]
    if len(given) > 1:
        raise CLIError(f"{' and '.join('--' + f.replace('_', '-') for f in given)}: give one")
    if args.json_schema is not None:
        try:
            with open(args.json_schema) as f:
                return Constraint.json_schema(json.load(f))
        except (OSError, ValueError) as e:
            raise CLIError(f"--json-schema {args.json_schema}: cannot read it ({e})") from None
    if args.regex is not None:
        return Constraint("regex", args.regex)
    if args.choice is not None:
        options = [c for c in args.choice.split(",") if c]
        if not options:
            raise CLIError("--choice: give at least one option (A,B,...)")
        return Constraint.choice(options)
    return None


def _grammars(constraint, text, vocab: int, eos: tuple[int, ...]):
    """The grammar engine for `constraint` (compiled now, before any weight is loaded),
    or None without one."""
    from qwen3_spmd.pipeline.structured.constraints import ConstraintError, Grammars

    if constraint is None:
        return None
    grammars = Grammars.of_text(text, vocab, eos)
    if grammars is None:
        raise CLIError("--json-schema, --regex and --choice need the model's tokenizer.json")
    try:
        grammars.compile(constraint)
    except ConstraintError as e:
        raise CLIError(f"the structured output is refused: {e}") from None
    return grammars


def _generate(engine, args, prompts, sampling, eos, stream, job=None, speculator=None):
    """static_batch.generate, under the JAX profiler if --profile DIR; with the job's
    constraint, if any, and speculating with `speculator`."""
    import contextlib

    import jax

    from qwen3_spmd.pipeline.requests import key_seed
    from qwen3_spmd.pipeline.scheduling import static_batch

    # Per-step logits only when something reads them (--logits-out, --check).
    with_logits = bool(args.logits_out or args.check)
    profile = jax.profiler.trace(args.profile) if args.profile else contextlib.nullcontext()
    with profile:
        return static_batch.generate(
            engine,
            prompts,
            args.max_new_tokens,
            sampling=sampling,
            seed=key_seed(args.seed),
            eos_ids=eos,
            on_tokens=stream,
            with_logits=with_logits,
            constraint=job.constraint if job else None,
            grammars=job.grammars if job else None,
            speculator=speculator,
        )


def _bytes_to_read(cfg, dtype, stages: int, mesh, experts: str) -> int:
    """Bytes this process reads (the progress bar's total): the layers of its stages, of
    each split parameter only its rows (`sharding.place.host_cut`, as the placement
    reads them), the rest whole."""
    import math

    import jax
    from jax.sharding import NamedSharding

    from qwen3_spmd.model.params import abstract_model, map_params
    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.sharding.place import host_cut
    from qwen3_spmd.sharding.specs import param_spec
    from qwen3_spmd.sharding.stages import StagePlan

    plan = StagePlan(cfg.L, stages)
    here = jax.process_index()
    mine = {
        s for s, row in enumerate(mesh.devices) if any(d.process_index == here for d in row.flat)
    }
    layers = sum(plan.counts[s] for s in mine)
    split = TensorSplit(mesh.shape["tensor"], experts)
    placed = {}
    map_params(
        lambda path, x: placed.__setitem__(path, x.shape), abstract_model(cfg, dtype, split)[1]
    )
    total = []

    def add(path, x):
        size = math.prod(x.shape) * x.dtype.itemsize
        shape = placed[path]
        if path[0] == "layers":
            size, shape = size // x.shape[0] * layers, (stages, *shape[1:])
        c = host_cut(path, NamedSharding(mesh, param_spec(path, experts)), shape, split, x.shape)
        if c is not None:
            start, stop = c.rows()
            size = size * (stop - start) // c.n
        total.append(size)

    map_params(add, abstract_model(cfg, dtype)[1])
    return sum(total)


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


class _Streamer:
    """Prints one request's text (or ids) as decode chunks arrive."""

    shown_all = True

    def __init__(self, text, progress=None):
        self.text, self.shown, self.progress = text, 0, progress

    def __call__(self, tokens: list[list[int]]) -> None:
        if self.progress is not None:
            self.progress.stop()  # the bar and the streamed text share the terminal
        ids = tokens[0]
        if self.text is not None:
            s = self.text.decode(ids)
            sys.stdout.write(s[self.shown :])
            self.shown = len(s)
        else:
            sys.stdout.write("".join(f" {t}" for t in ids[self.shown :]))
            self.shown = len(ids)
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write("\n")


class _DoneStreamer:
    """Several requests: prints each request's text as soon as it is finished (an EOS
    id, or --max-new-tokens), in the order they finish."""

    def __init__(self, text, progress, prompts, max_new_tokens: int, eos):
        from qwen3_spmd.pipeline.batch.handles import Params

        self.text, self.progress, self.prompts = text, progress, prompts
        self.params = Params(max_new_tokens, eos_ids=tuple(eos))
        self.printed: set[int] = set()
        self.last: list[list[int]] = []

    @property
    def shown_all(self) -> bool:
        return len(self.printed) == len(self.prompts)

    def _show(self, n: int, ids: list[int], reason: str) -> None:
        if self.progress is not None:
            self.progress.stop()
        shown = self.text.decode(ids) if self.text is not None else " ".join(map(str, ids))
        print(
            f"[{n}] ({len(self.prompts[n])} prompt tokens -> {len(ids)} new, {reason}) {shown}",
            flush=True,
        )
        self.printed.add(n)

    def __call__(self, tokens: list[list[int]]) -> None:
        self.last = tokens
        for n, ids in enumerate(tokens):
            reason = self.params.finish_reason(ids)
            if reason and n not in self.printed:
                self._show(n, ids, reason)

    def finish(self) -> None:
        for n, ids in enumerate(self.last):
            if n not in self.printed:
                self._show(n, ids, "length")


def _from_cache(c: dict) -> str:
    n = c["programs_read"]
    return f" ({n} program{'s' * (n != 1)} read from the compile cache)" if n else ""


def _readable(r: dict, prompts, text, streamed: bool, timelines=(), demo=False) -> str:
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
    C = r["mesh"]["seq"]
    for s, (first, last) in enumerate(r["stage_layers"]):
        procs = r["stage_processes"][s]
        where = f" in process {', '.join(map(str, procs))}" if r["processes"] > 1 else ""
        lines.append(
            f"  stage {s}: layers {first}-{last}  on devices "
            f"{', '.join(str(s * C + c) for c in range(C))}{where}"
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
        f"{'KV cache bytes per device:':<27}{r['kv_bytes_per_device']:>12,}",
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
