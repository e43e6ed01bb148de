"""`plan`: which mesh to run a model on, before running it.

    qwen3-spmd plan --model 32B --devices 8 --hosts 1 --gpu h200 --target latency

Every factorisation D x S x C x X of the devices (tensor inside a host, replicas whole
hosts or shares of one) with its memory per device (exact, from the shardings) and the
cost model's prefill and decode times (`run.plan.mesh_cost`), ranked by the target:
`latency` (a token's time single-stream), `throughput` (decode tokens per second at
--batch, over every replica) or `prompt` (the cache tokens the free memory holds: the
longest prompts). Needs no devices: only the model's config is read.
"""

from __future__ import annotations

import dataclasses
import json

from qwen3_spmd.run.flags import CLIError, add_expert_split, add_model
from qwen3_spmd.run.plan.machines import GPUS, TARGETS


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank the meshes a model can run on (no devices needed)")
    add_model(p, "checkpoint folder, hub id or preset name (only its config is read)")
    p.add_argument("--devices", type=int, default=8, help="devices in all (default 8)")
    p.add_argument("--hosts", type=int, default=1, help="hosts they are spread over (default 1)")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="the device (default h200)")
    p.add_argument("--target", default="latency", choices=sorted(TARGETS), help="what to rank by")
    p.add_argument("--batch", type=int, default=8, help="requests decoded at once (default 8)")
    p.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument(
        "--max-seq-len", type=int, default=4096, help="cache slots per request (default 4096)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--quantize",
        choices=("fp8",),
        help="count the model's projections as an FP8 checkpoint holds them (one byte a "
        "weight plus 128x128 block scales); an FP8 folder is counted so without it",
    )
    add_expert_split(p)
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=main)


def main(args) -> int:
    from qwen3_spmd.run.models import open_model
    from qwen3_spmd.run.plan import mesh_cost

    for flag, value in (
        ("--devices", args.devices),
        ("--hosts", args.hosts),
        ("--batch", args.batch),
        ("--prompt-len", args.prompt_len),
        ("--max-seq-len", args.max_seq_len),
    ):
        if value < 1:
            raise CLIError(f"{flag} {value} must be at least 1")
    if args.devices % args.hosts:
        raise CLIError(
            f"--devices {args.devices} cannot be spread evenly over --hosts {args.hosts}"
        )
    cfg = open_model(args.model or "tiny").cfg
    if args.quantize and cfg.fp8_block is None:
        cfg = dataclasses.replace(cfg, fp8_block=(128, 128))  # Qwen's published blocks
    machine = GPUS[args.gpu]
    load = mesh_cost.Load(args.batch, args.prompt_len, args.max_seq_len, args.dtype)
    rows = [
        mesh_cost.predict(cfg, shape, machine, load, args.hosts, args.expert_split)
        for shape in mesh_cost.factorisations(cfg, args.devices, args.hosts, args.expert_split)
    ]
    ranked = mesh_cost.rank(rows, args.target)
    if args.json:
        print(json.dumps({"machine": machine.name, "target": args.target, "meshes": ranked}))
        return 0
    print(
        f"{args.model or 'tiny'} on {args.devices} {machine.name} in {args.hosts} "
        f"host{'s' * (args.hosts > 1)}, {args.dtype}, batch {args.batch}, prompts of "
        f"{args.prompt_len} tokens, {args.max_seq_len} cache slots each; ranked by {args.target}"
    )
    head = f"{'mesh':>8} {'weights':>9} {'KV':>8} {'prefill':>9} {'token':>9} {'tok/s':>9}"
    print(head + f" {'cache tokens':>13}  a step's time goes to")
    for r in ranked:
        if not r["fits"]:
            print(
                f"{r['mesh']:>8} does not fit: {r['weight_bytes_per_device'] / 1e9:.1f} GB "
                f"of weights + {r['kv_bytes_per_device'] / 1e9:.1f} GB of KV per device"
            )
            continue
        print(
            f"{r['mesh']:>8} {r['weight_bytes_per_device'] / 1e9:7.1f}GB "
            f"{r['kv_bytes_per_device'] / 1e9:6.1f}GB {r['prefill_s'] * 1e3:7.1f}ms "
            f"{r['decode_token_s'] * 1e3:7.2f}ms {r['decode_tokens_per_s']:9.0f} "
            f"{r['cache_tokens']:13,}  {mesh_cost.why(r)}"
        )
    print(
        "(D x S x C x X = replicas x stages x seq devices x tensor devices, D = 1 unwritten; "
        "times are the cost model's)"
    )
    return 0
