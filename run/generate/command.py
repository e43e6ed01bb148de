"""`generate`: prompts in, tokens (and text) out, on any (stage, seq, tensor) mesh.

Without --model it runs the built-in demo (the `tiny` preset's layers with Qwen3's
vocabulary and tokenizer, seeded random weights) on an emulated 2x2 CPU mesh and says
so; its text is noise, but the tokenizer and the machinery (stage plan, schedules, ring,
sharded cache, the check against one device) are all real.

This module holds the flags and the run in order: the job checked (`job`), weights
loaded and tokens generated (`load`, printing them as they come: `stream`), the
report (`report`), and with --check the same requests on one device (`check`).
"""

from __future__ import annotations

import json

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.generate.check import check_single_device
from qwen3_spmd.run.generate.job import read_job
from qwen3_spmd.run.generate.load import load_and_generate
from qwen3_spmd.run.generate.report import readable, run_report, timelines, write_logits


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


def main(args) -> int:
    engine_args = EngineArgs.from_cli(args, weights_seed=args.seed)
    return engine_args.launch(args, lambda runtime: _run(args, engine_args, runtime))


def _run(args, engine_args: EngineArgs, runtime) -> int:
    """Checks the job, loads and generates (a progress bar meanwhile), then reports."""
    procs = runtime.procs
    job = read_job(args, engine_args, runtime)
    show = procs.leader  # only process 0 prints results; the others stay quiet
    out, engine, speculator, stream = load_and_generate(args, engine_args, job, procs, show)
    report = run_report(args, job, engine, out, procs, runtime.cache, speculator)
    if not show:
        return 0
    if args.check:
        report.update(check_single_device(args, engine_args, job, out))
    if args.logits_out:
        write_logits(args.logits_out, out.first_logits)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        readable(
            report,
            job.prompts,
            job.text,
            streamed=stream is not None and stream.shown_all,
            timelines=timelines(engine, out.layout) if args.timeline else (),
            demo=job.demo,
        )
    )
    return 0
