"""Times the expert formulations of model.moe on one sparse layer of a preset's widths,
for the rows of a decode step and of a prefill, on this machine's default backend:

    python tools/moe_measure.py --model 30B-A3B --rows 1,8,128,512

Prints one line per (rows, formulation): median milliseconds over --repeat calls and
the expert bytes the call must read (all E experts, or the distinct experts chosen).
The prefill choice per platform (model.moe.PREFILL) comes from such measurements.
--fp8 times the whole layer (`model.moe.MoE`, router included) with FP8 experts (float8
and 128-block scales, as Qwen's FP8 checkpoints hold them); --how picks formulations.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen3_spmd.model import moe
from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.run.bench.measure import timed


def _median_ms(fn, args, repeat: int) -> float:
    """Median milliseconds of fn(*args) over `repeat` calls after one that compiles."""
    return 1e3 * statistics.median(timed(lambda: jax.block_until_ready(fn(*args)), repeat, 1))


def measure_fp8(preset: str, rows: list[int], repeat: int, experts: int | None, hows):
    """One MoE layer with FP8 experts (float32 activations), each formulation of `hows`."""
    cfg = dataclasses.replace(
        PRESETS[preset], num_experts=experts or PRESETS[preset].E, fp8_block=(128, 128)
    )
    gd, state = nnx.split(moe.MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    per_expert = 3 * cfg.D * cfg.moe_intermediate_size  # one byte a weight
    for R in rows:
        h = jax.random.normal(jax.random.key(R), (R, 1, cfg.D))
        for how in hows:
            fn = jax.jit(lambda state, h, how=how: nnx.merge(gd, state)(h, how))
            ms = _median_ms(fn, (state, h), repeat)
            print(
                f"rows {R:5d}  {how:9s} {ms:9.2f} ms  FP8, {cfg.E} experts of "
                f"{per_expert / 1e6:.1f} MB (default at these rows: "
                f"{moe.formulation(R, cfg.E, cfg.A)})",
                flush=True,
            )


def measure(preset: str, rows: list[int], dtype: str, repeat: int, experts: int | None):
    cfg = PRESETS[preset]
    E = experts or cfg.E
    D, F, A = cfg.D, cfg.moe_intermediate_size, cfg.A
    dt = jnp.dtype(dtype)
    keys = jax.random.split(jax.random.key(0), 5)
    router = jax.random.normal(keys[1], (E, D), dt)
    gate = (0.02 * jax.random.normal(keys[2], (E, F, D), jnp.float32)).astype(dt)
    up = (0.02 * jax.random.normal(keys[3], (E, F, D), jnp.float32)).astype(dt)
    down = (0.02 * jax.random.normal(keys[4], (E, D, F), jnp.float32)).astype(dt)
    per_expert = 3 * D * F * dt.itemsize
    out = []
    for R in rows:
        x = jax.random.normal(jax.random.fold_in(keys[0], R), (R, D), dt)
        weights, ids, _ = moe.route(x, router, A, True)
        distinct = len(np.unique(np.asarray(ids)))
        for how, f in moe.FORMULATIONS.items():
            # far past their use: gathered copies R * A experts' weights, grouped runs
            # all E experts, looped reads R * A experts
            if (
                (how == "gathered" and R * A > 4 * E)
                or (how == "grouped" and R > 64)
                or (how == "looped" and R * A > 16 * E)
            ):
                continue
            fn = jax.jit(lambda x, w, i, *g, f=f: f(x, w, i, *map(moe.Stacked, g)))
            ms = _median_ms(fn, (x, weights, ids, gate, up, down), repeat)
            need = (distinct if how in ("gathered", "looped") else E) * per_expert
            out.append(
                dict(rows=R, how=how, ms=ms, bytes=need, gbps=need / ms / 1e6, distinct=distinct)
            )
            print(
                f"rows {R:5d}  {how:9s} {ms:9.2f} ms  reads {need / 1e6:8.1f} MB "
                f"({distinct} distinct experts chosen)  {need / ms / 1e6:6.1f} GB/s",
                flush=True,
            )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="30B-A3B", choices=[n for n, c in PRESETS.items() if c.E])
    p.add_argument("--rows", default="1,8,128,512")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--experts", type=int, default=None, help="fewer experts than the preset's")
    p.add_argument("--fp8", action="store_true", help="the layer with FP8 experts")
    p.add_argument("--how", default=",".join(moe.FORMULATIONS), help="formulations (--fp8)")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    if a.fp8:
        print(f"backend {jax.default_backend()}, {a.model} widths, FP8 experts")
        measure_fp8(a.model, rows, a.repeat, a.experts, a.how.split(","))
        return
    print(f"backend {jax.default_backend()}, {a.model} widths, {a.dtype}")
    measure(a.model, rows, a.dtype, a.repeat, a.experts)


if __name__ == "__main__":
    main()
