"""`generate`: prompts in, tokens (and text) out, on any (stage, seq) mesh.

Without --model it runs the built-in `tiny` preset with seeded random weights on an
emulated 2x2 CPU mesh and says so; its output is noise, but the machinery (stage
plan, schedules, ring, sharded cache, the check against one device) is all real.
"""

from __future__ import annotations

import json
import sys
import time

DEMO_PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59]]


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate tokens for prompts on a device mesh")
    p.add_argument("--model", help="Hugging Face checkpoint folder, or a preset name "
                                   "(tiny, 0.6B, ..., 32B) with random weights; default: tiny")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt as text (repeatable; needs tokenizer.json)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each text prompt in the checkpoint's chat template")
    p.add_argument("--no-thinking", action="store_true",
                   help="with --chat: enable_thinking=False (Qwen3 answers without <think>)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", help="float32 or bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-seq-len", type=int,
                   help="KV cache capacity per request (default: just enough for the request)")
    p.add_argument("--mesh", default=None,
                   help="SxC: S pipeline stages x C sequence devices (default: 2x2 on CPU, "
                        "1x1 on an accelerator)")
    p.add_argument("--cpu-devices", type=int,
                   help="emulate this many CPU devices (default on CPU: S*C of --mesh)")
    p.add_argument("--microbatches", type=int, default=1, help="prefill microbatches M")
    p.add_argument("--groups", type=int, help="decode request groups G (default: S)")
    p.add_argument("--chunk", type=int, default=16, help="decode steps per on-device chunk")
    p.add_argument("--check", action="store_true",
                   help="also run on one device and report whether the tokens match")
    p.add_argument("--timeline", action="store_true", help="print the executed schedules")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--logits-out", metavar="FILE.npy",
                   help="save the first request's logits at each generated step [steps, V]")
    p.set_defaults(func=main)


def _platform_is_cpu() -> bool:
    import os

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] == "cpu"
    import importlib.util

    return not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                         "jax_rocm60_plugin", "libtpu"))


def _prompts(args, text) -> list[list[int]]:
    from run.cli import CLIError

    prompts = []
    for raw in args.prompt_ids:
        try:
            prompts.append([int(t) for t in raw.replace(" ", "").split(",") if t != ""])
        except ValueError:
            raise CLIError(f"--prompt-ids {raw!r} is not a comma-separated list of integers") from None
    for raw in args.prompt:
        if text is None:
            raise CLIError("--prompt needs tokenizer.json in the checkpoint folder, which has "
                           "none: pass --prompt-ids 1,2,3 instead")
        prompts.append(text.encode(text.chat(raw, not args.no_thinking) if args.chat else raw))
    if args.chat and not args.prompt:
        raise CLIError("--chat applies to --prompt TEXT prompts, and none was given")
    return prompts


def main(args) -> int:
    from run.cli import CLIError, use_cpu_devices
    from sharding.mesh import parse_mesh

    on_cpu = _platform_is_cpu()
    mesh_text = args.mesh or ("2x2" if on_cpu else "1x1")
    stage, seq = parse_mesh(mesh_text)
    if args.cpu_devices is not None and args.cpu_devices != stage * seq:
        raise CLIError(f"--mesh {mesh_text} needs {stage * seq} devices but --cpu-devices is "
                       f"{args.cpu_devices}: make them agree")
    if on_cpu:
        use_cpu_devices(args.cpu_devices or stage * seq)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pipeline import accounting
    from pipeline.engine import Engine
    from pipeline.sampling import Sampling
    from pipeline.schedule import decode_grid, prefill_grid, timeline
    from run.models import open_model
    from run.text import Text
    from sharding.mesh import make_mesh

    dtype_name = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if dtype_name not in ("float32", "bfloat16"):
        raise CLIError(f"--dtype {dtype_name} is not supported: use float32 or bfloat16")
    dtype = jnp.dtype(dtype_name)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    spec = open_model(args.model, args.seed)
    text = Text.find(spec.folder)
    prompts = _prompts(args, text)
    if not prompts and args.model is None:
        prompts = DEMO_PROMPTS
    if not prompts:
        raise CLIError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    mesh = make_mesh(stage, seq, jax.devices()[:stage * seq] if len(jax.devices()) > stage * seq
                     else None)
    max_seq_len = args.max_seq_len or _fitting_seq_len(prompts, args.max_new_tokens, seq)
    eos = spec.eos_ids()

    engine = Engine(spec.cfg, spec.source, mesh, dtype, max_seq_len, args.microbatches,
                    args.groups, args.chunk)
    engine.check(prompts, args.max_new_tokens)
    stream = _Streamer(text) if not args.json and len(prompts) == 1 else None
    if not args.json:
        print(f"model: {spec.label}; mesh {stage}x{seq} ({dtype_name}); "
              f"stage layers {engine.plan.stage_layers}", flush=True)
    out = engine.generate(prompts, args.max_new_tokens, sampling, args.seed, eos,
                          on_tokens=stream)
    if stream:
        stream.finish()

    S, C = stage, seq
    report = {
        "model": {"name": spec.label, "random_weights": spec.random},
        "dtype": dtype_name,
        "mesh": {"stage": S, "seq": C},
        "stage_layers": engine.plan.stage_layers,
        "requests": [{"prompt_ids": c.prompt_ids, "token_ids": c.token_ids,
                      "text": text.decode(c.token_ids) if text else None,
                      "finish_reason": c.finish_reason} for c in out.completions],
        "timing": out.timing,
        "max_seq_len": max_seq_len,
        "bytes_between_stages": accounting.bytes_between_stages(
            spec.cfg, S, [len(p) for p in prompts],
            [len(c.token_ids) - 1 for c in out.completions]),
        "bytes_sent": accounting.bytes_sent(spec.cfg, S, C, out.layout, dtype.itemsize),
        "schedule": engine.schedules(out.layout),
        "kv_bytes_per_device": max(accounting.bytes_per_device(engine.cache[:2])),
        "weight_bytes_per_device": max(accounting.bytes_per_device(engine.state)),
        "layout": out.layout,
    }
    if args.check:
        single = Engine(spec.cfg, spec.source, make_mesh(1, 1, jax.devices()[:1]), dtype,
                        max_seq_len, 1, 1, args.chunk)
        ref = single.generate(prompts, args.max_new_tokens, sampling, args.seed, eos)
        report["matches_single_device"] = all(
            a.token_ids == b.token_ids for a, b in zip(out.completions, ref.completions))
        report["max_error_vs_single_device"] = accounting.max_abs_error(out.first_logits,
                                                                        ref.first_logits)
    if args.logits_out:
        np.save(args.logits_out, out.first_logits[:len(out.completions[0].token_ids)])

    if args.json:
        print(json.dumps(report))
        return 0
    _print_report(report, prompts, text, stream is not None)
    if args.timeline:
        steps = min(out.layout["chunk"], max(out.layout["decode_steps"], 1))
        print(timeline(prefill_grid(engine.M, S), "prefill"))
        print(timeline(decode_grid(engine.G, S, steps), "decode"))
    return 0


def _fitting_seq_len(prompts, max_new_tokens: int, seq: int) -> int:
    """The smallest cache that holds the longest prompt, padded for C devices, plus the
    new tokens."""
    import math

    from ring import padded_length

    padded = padded_length(max(len(p) for p in prompts), seq) if prompts else 0
    return seq * (padded // seq + math.ceil(max(max_new_tokens - 1, 0) / seq))


class _Streamer:
    """Prints one request's text (or ids) as decode chunks arrive."""

    def __init__(self, text):
        self.text, self.shown = text, 0

    def __call__(self, tokens: list[list[int]]) -> None:
        ids = tokens[0]
        if self.text is not None:
            s = self.text.decode(ids)
            sys.stdout.write(s[self.shown:])
            self.shown = len(s)
        else:
            sys.stdout.write("".join(f" {t}" for t in ids[self.shown:]))
            self.shown = len(ids)
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write("\n")


def _print_report(r: dict, prompts, text, streamed: bool) -> None:
    if not streamed:
        for n, req in enumerate(r["requests"]):
            shown = req["text"] if text is not None else " ".join(map(str, req["token_ids"]))
            print(f"[{n}] ({len(prompts[n])} prompt tokens, {req['finish_reason']}) {shown}")
    t = r["timing"]
    print(f"prefill {t['prefill_s']:.3f} s ({t['prefill_tokens_per_s']:.1f} tok/s), "
          f"decode {t['decode_s']:.3f} s ({t['decode_tokens_per_s']:.1f} tok/s), "
          f"compile {t['compile_s']:.1f} s")
    print(f"bytes between stages: {r['bytes_between_stages']}; KV bytes per device: "
          f"{r['kv_bytes_per_device']}; weight bytes per device: {r['weight_bytes_per_device']}")
    if "matches_single_device" in r:
        print(f"matches_single_device: {str(r['matches_single_device']).lower()} "
              f"(max logits error {r['max_error_vs_single_device']:.2e})")
