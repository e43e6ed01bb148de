"""`ring` subcommand: ring attention on a 1-D ('seq',) mesh against dense attention.

Runs the real shard_map ring on random q, k, v with the contiguous and the zigzag
partition and prints, per partition, the largest error against dense causal
attention on one device (`model.attention.dense_attention`), the causal (q, k) pairs each device
computes and the (query half, key half) block pairs it actually ran. The defaults
(4 heads, 64 tokens, head dim 32, 4 devices) give work [136, 392, 648, 904]
contiguous and [520, 520, 520, 520] zigzag.
"""

import argparse
import json
import os
import sys

PARTITIONS = ("contiguous", "zigzag")


def register(subparsers) -> None:
    """Adds the `ring` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("ring", help="ring attention demo: error vs dense, work per device")
    p.add_argument("--heads", type=int, default=4, help="attention heads N (= KV heads)")
    p.add_argument(
        "--seq",
        type=int,
        default=64,
        help="sequence length (padded to a multiple of 2*devices)",
    )
    p.add_argument("--dim", type=int, default=32, help="head dim H")
    p.add_argument(
        "--devices",
        type=int,
        default=4,
        help="devices C on the seq axis (CPU devices are emulated)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--seed", type=int, default=0, help="seed of the random q, k, v")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def _devices(n: int):
    """n devices: the default backend's if it has enough, else emulated CPU devices.

    Emulated CPU devices are asked for only if nobody chose a count already (the
    XLA flag or the jax option): shrinking a test session's 8 devices to n would
    break the tests after this one. Asking works only before any backend starts;
    once one has, the devices there must do.
    """
    import jax  # here, not above: `qwen3-spmd --help` loads this module without JAX

    chosen = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if not chosen and jax.config.jax_num_cpu_devices < 0:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # a backend is already up
            pass
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= n:
            return devices[:n]
    raise ValueError(
        f"--devices {n} asks for more devices than the {len(jax.devices('cpu'))} "
        f"CPU devices available"
    )


def _run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from qwen3_spmd import ring
    from qwen3_spmd.model.attention import dense_attention

    for flag in ("heads", "seq", "dim", "devices", "batch"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    c = args.devices
    mesh = Mesh(np.array(_devices(c)), ("seq",), axis_types=(AxisType.Explicit,))
    scale = args.dim**-0.5

    def ring_fn(q, k, v, pos):
        return ring.ring_attention(
            q, k, v, pos, pos, axis_name="seq", scale=scale, count_blocks=True
        )

    seq = P(None, "seq")
    sharded = jax.jit(
        jax.shard_map(
            ring_fn,
            mesh=mesh,
            in_specs=(seq, seq, seq, seq),
            out_specs=(seq, seq, P("seq")),
        )
    )
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    positions = np.broadcast_to(np.arange(args.seq), (args.batch, args.seq))
    with jax.default_matmul_precision("highest"):  # a float32 reference, TF32 nowhere
        expected = np.asarray(dense_attention(q, k, v, positions, positions))  # scale H**-0.5

    report = {}
    for name in PARTITIONS:
        partition = getattr(ring, name)(args.seq, c)
        pos = np.broadcast_to(ring.device_positions(partition), (args.batch, c * partition[0].size))
        inputs = [ring.to_device_order(x, partition) for x in (q, k, v)] + [pos]
        placed = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, seq)) for x in inputs]
        o, _, blocks = sharded(*placed)
        o = ring.from_device_order(np.asarray(o), partition)
        report[name] = {
            "max_error": float(np.max(np.abs(o - expected))),
            "work": ring.causal_work(partition),
            "blocks": [int(b) for b in np.asarray(blocks)],
        }
    return {"partitions": report}


def main(args) -> int:
    """Runs the demo; prints a table, or one JSON object with --json. Returns the exit status."""
    try:
        report = _run(args)
    except ValueError as err:
        print(f"ring: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"ring attention: B={args.batch} T={args.seq} N={args.heads} H={args.dim} on {args.devices} seq devices"
    )
    for name, r in report["partitions"].items():
        print(f"{name:>10}: max error {r['max_error']:.2e}  work {r['work']}  blocks {r['blocks']}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ring_demo")
    register(parser.add_subparsers(required=True))
    parsed = parser.parse_args()
    sys.exit(parsed.func(parsed))
