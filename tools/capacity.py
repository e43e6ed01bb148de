"""How long a prompt fits a per-device memory budget, on one device and on C `seq`
devices: `python tools/capacity.py [--budget-mib 64] [--devices 8]`.

For each mesh 1xC it compiles the prefill program at growing prompt lengths and reads
XLA's per-device memory analysis (weights + KV cache + activations and temporaries),
keeps the longest prompt that fits the budget, then runs that prefill for real and
reports its time. KV and activation memory per device fall as 1/C (attention scores
of a ring step fall as 1/C^2), so C devices hold a prompt about C times longer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from qwen3_spmd.run.flags import size_cpu_threads


# One measurement read top to bottom: its flags, then per mesh the largest prompt that
# compiles within the budget (bisection), then the table.
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/capacity.py")
    p.add_argument("--budget-mib", type=float, default=64.0)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--model", default="tiny")
    p.add_argument("--no-run", action="store_true", help="only compile, do not run the prefill")
    args = p.parse_args(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        size_cpu_threads(args.devices)
        import jax

        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax
    import numpy as np

    from qwen3_spmd.pipeline.runtime.engine import Engine
    from qwen3_spmd.pipeline.scheduling import static_batch
    from qwen3_spmd.run.models import open_model
    from qwen3_spmd.sharding.mesh import make_mesh

    spec = open_model(args.model)
    if spec.random:  # random weights: let the preset's RoPE run past its trained window
        spec.cfg = dataclasses.replace(spec.cfg, max_position_embeddings=1 << 22)
    budget = int(args.budget_mib * 2**20)
    rows = []
    for C in sorted({1, args.devices}):
        mesh = make_mesh(1, C, jax.devices()[:C])

        def footprint(T, mesh=mesh, C=C):
            eng = Engine(spec.cfg, spec.source, mesh, max_seq_len=T + 2 * C)
            return eng, eng.prefill_memory(1, T)

        # Double while it fits, then bisect the last doubling in steps of `grain` tokens.
        grain, T, best, over = 256, 256, None, None
        while T <= spec.cfg.max_position_embeddings - 2 * C:
            eng, mem = footprint(T)
            if mem["total"] > budget:
                over = T
                break
            best = (T, eng, mem)
            T *= 2
        while best is not None and over is not None and over - best[0] > grain:
            T = (best[0] + over) // 2 // grain * grain
            eng, mem = footprint(T)
            if mem["total"] > budget:
                over = T
            else:
                best = (T, eng, mem)
        if best is None:
            rows.append({"devices": C, "longest_prompt": 0})
            continue
        T, eng, mem = best
        row = {
            "devices": C,
            "longest_prompt": T,
            "bytes_per_device": mem,
            "kv_bytes_per_device": eng.plan.padded_layers
            * 2
            * eng.slots_per_device
            * spec.cfg.K
            * spec.cfg.H
            * eng.dtype.itemsize,
        }
        if not args.no_run:
            prompt = np.random.default_rng(0).integers(0, spec.cfg.V, T).tolist()
            t0 = time.perf_counter()
            out = static_batch.generate(eng, [prompt], 1)
            row["prefill_s"] = out.timing["prefill_s"]
            row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
    print(
        json.dumps(
            {"model": spec.label, "budget_bytes_per_device": budget, "meshes": rows}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
