"""Measurements behind `qwen3-spmd bench`: the machine, rooflines, timed engine jobs,
memory, traffic.

Every timed figure is the median of `repeats` runs after `warmup` runs (which also
compile), with the spread (min, max) kept next to it. Times are wall-clock as a caller
of `static_batch.generate` sees them, split at the engine's own streaming callback:

    call ──prefill (host layout, cache allocation, prefill, first sample)──> 1st on_tokens
         ──decode (every chunk, host work between chunks included)──────────> last on_tokens

so host round trips between decode chunks count against us, as they would for a user.
The engine's own program-only times (`timing["prefill_s"]`, `["decode_s"]`) are kept too.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.requests import fitting_seq_len
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.run.flags import CLIError
from qwen3_spmd.run.flops import non_embedding_params


def spread(samples: Sequence[float]) -> dict:
    """{"median", "min", "max", "n"} of timing samples (seconds or rates)."""
    xs = [float(x) for x in samples]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def timed(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Seconds per call of fn(), which must block until its result is ready."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---- the machine ----------------------------------------------------------------------


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


# ---- rooflines ------------------------------------------------------------------------


def _stacked_matvec(stack, v):
    """stack [n, N, K], v [K] -> [n, N]: v @ stack[i]^T for each i, in a loop."""

    def one(i):
        return v @ jax.lax.dynamic_index_in_dim(stack, i, keepdims=False).T

    return jax.lax.map(one, jnp.arange(stack.shape[0]))


def rooflines(dtype, repeats: int, warmup: int, smoke: bool) -> dict:
    """Memory bandwidth and matmul throughput, both on the first device.

    Bandwidth is the fastest of four jitted kernels that read a large float32 array
    once: a sum, a matrix-vector product, sums of one part per CPU core, and a loop of
    v @ w^T over the matrices (rows of 2048) of a stack (XLA CPU runs a reduction on one
    thread, its matvecs on all of them, independent reductions side by side, and the
    last as one fused loop that reads each matrix in place, as MoE decode reads its
    experts; any one alone can understate what the memory gives).
    Throughput is a jitted square matmul in `dtype`. An accelerator gets a larger array
    and matmul (2 GiB, 8192^2) than a CPU (256 MiB, 2048^2): each must take
    milliseconds there, so launch and dispatch stay out of it."""
    dev = jax.devices()[0]
    big = dev.platform != "cpu"
    n_bytes = (32 if smoke else 2048 if big else 256) * 2**20
    cols = 4096
    a = jax.device_put(jnp.ones((n_bytes // 4 // cols, cols), jnp.float32), dev)
    v = jax.device_put(jnp.ones((cols,), jnp.float32), dev)
    n_parts = max(2, os.cpu_count() or 1)
    parts = [
        jax.device_put(jnp.ones((a.shape[0] // n_parts, cols), jnp.float32), dev)
        for _ in range(n_parts)
    ]
    # name -> (kernel, its arguments, the bytes it reads)
    kernels = {
        "sum": (jax.jit(jnp.sum), (a,), a.nbytes),
        "matvec": (jax.jit(jnp.matmul), (a, v), a.nbytes),
        "split_sum": (
            jax.jit(lambda ps: [p.sum() for p in ps]),
            (parts,),
            sum(p.nbytes for p in parts),
        ),
        "stacked_matvec": (jax.jit(_stacked_matvec), (a.reshape(8, -1, 2048), v[:2048]), a.nbytes),
    }
    per_kernel = {}
    for name, (fn, args, read) in kernels.items():
        times = timed(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), repeats, warmup)
        per_kernel[name] = spread([read / t for t in times])
    del a, v, parts
    best = max(per_kernel, key=lambda k: per_kernel[k]["median"])

    n = 512 if smoke else 8192 if big else 2048
    a = jax.device_put(jnp.ones((n, n), dtype) * 0.5, dev)
    b = jax.device_put(jnp.ones((n, n), dtype) * 0.25, dev)
    mm = jax.jit(lambda a, b: a @ b)
    t_mm = timed(lambda: mm(a, b).block_until_ready(), repeats, warmup)
    fl = [2 * n**3 / t for t in t_mm]
    return {
        "bandwidth_bytes_per_s": per_kernel[best],
        "bandwidth_kernel": best,
        "bandwidth_by_kernel": per_kernel,
        "bandwidth_array_bytes": n_bytes,
        "matmul_flops_per_s": spread(fl),
        "matmul_size": n,
        "dtype": jnp.dtype(dtype).name,
    }


def link_bandwidth(devices, smoke: bool, repeats: int = 3) -> dict:
    """Bytes per second each device receives over `devices` (a `seq` axis of
    len(devices)) in the two collectives the strategies use: "ppermute" (the ring: a
    16 MiB float32 buffer (1 MiB with smoke) to the next device) and "all_to_all"
    (Ulysses: every device sends (C-1)/C of the buffer and keeps the rest)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    C = len(devices)
    mesh = jax.make_mesh((C,), ("seq",), devices=devices)
    rows = (1 if smoke else 16) * 2**20 // 4 // 1024 // C * C
    x = jax.device_put(jnp.ones((C * rows, 1024), jnp.float32), NamedSharding(mesh, P("seq")))
    ops = {
        "ppermute": (
            lambda a: jax.lax.ppermute(a, "seq", [(i, (i + 1) % C) for i in range(C)]),
            rows * 1024 * 4,
        ),
        "all_to_all": (
            lambda a: jax.lax.all_to_all(a, "seq", 0, 0, tiled=True),
            rows * 1024 * 4 * (C - 1) // C,
        ),
    }
    out = {"devices": C}
    for name, (op, received) in ops.items():
        fn = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("seq"), out_specs=P("seq")))
        times = timed(lambda fn=fn: fn(x).block_until_ready(), repeats, 1)
        out[name] = {**spread([received / t for t in times]), "bytes_received": received}
    return out


def all_reduce_time(mesh, rows: int, count: int, width: int, dtype, repeats: int) -> dict:
    """Seconds a program of only `count` all-reduces of a [rows, width] array over the
    mesh's `tensor` axis takes, each waiting on the one before as a stage's layers do:
    the all-reduces of one tick (`accounting.all_reduces_per_tick`) without the layers
    around them."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    X = mesh.shape["tensor"]

    def reduce(_, a):
        # Each device's [rows, width] block summed; scaled back and marked varying
        # again, so every turn sums the same values as a layer's partial products.
        return jax.lax.pcast(jax.lax.psum(a, "tensor") / X, ("tensor",), to="varying")

    def body(x):
        return jax.lax.fori_loop(0, count, reduce, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor")))
    x = jax.device_put(jnp.ones((X * rows, width), dtype), NamedSharding(mesh, P("tensor")))
    return spread(timed(lambda: fn(x).block_until_ready(), repeats, 1))


# ---- model arithmetic ------------------------------------------------------------------


def distinct_experts(cfg: Qwen3Config, B: int) -> float:
    """Experts B tokens reach in one sparse layer, expected under uniform routing:
    E * (1 - (1 - A/E)^B) (exactly A for one token)."""
    return cfg.E * (1 - (1 - cfg.A / cfg.E) ** B) if cfg.E else 0.0


def _projections(cfg: Qwen3Config, B: int) -> tuple[float, float]:
    """(weights whose input is D, weights whose output is D) of the layers' projections
    a decode step of B tokens reads: q, k, v, gate and up; o and down (of a sparse
    layer, the experts the B tokens reach)."""
    dense = sum(not s for s in cfg.sparse_layers)
    experts = sum(cfg.sparse_layers) * distinct_experts(cfg, B)
    attention_in = cfg.L * cfg.D * (cfg.N + 2 * cfg.K) * cfg.H
    attention_out = cfg.L * cfg.N * cfg.H * cfg.D
    mlp_in = dense * 2 * cfg.D * cfg.F + experts * 2 * cfg.D * cfg.moe_intermediate_size
    mlp_out = dense * cfg.F * cfg.D + experts * cfg.moe_intermediate_size * cfg.D
    return attention_in + mlp_in, attention_out + mlp_out


def decode_bytes_per_step(cfg: Qwen3Config, B: int, context: float, itemsize: int) -> dict:
    """Bytes a decode step must read: every weight once (layers, final norm, lm_head or
    the tied embedding as lm_head, B embedding rows) and the K/V of `context` tokens of
    every request in every layer. Of a sparse layer's experts only those the B tokens
    reach are needed (`distinct_experts`). An FP8 checkpoint's projections are one byte
    a weight plus a float32 scale per block along D (`model.fp8`); the rest is in
    `itemsize`."""
    expert = 3 * cfg.D * cfg.moe_intermediate_size
    sparse = sum(cfg.sparse_layers)
    needed = (
        non_embedding_params(cfg, active=False)
        - sparse * cfg.E * expert
        + sparse * distinct_experts(cfg, B) * expert
    )
    weights = (needed + cfg.V * cfg.D + B * cfg.D) * itemsize
    if cfg.fp8_block is not None:
        d_in, d_out = _projections(cfg, B)
        rows, cols = cfg.fp8_block  # D is a weight's input: blocks of `cols` along it
        scales = 4 * (d_in * -(-cfg.D // cols) + d_out * -(-cfg.D // rows)) / cfg.D
        weights += (d_in + d_out) * (1 - itemsize) + scales
    kv = 2 * cfg.L * B * context * cfg.K * cfg.H * itemsize
    return {"weights": int(weights), "kv": int(kv), "total": int(weights + kv)}


def ring_bytes(cfg: Qwen3Config, C: int, B: int, P_len: int, itemsize: int) -> dict:
    """Bytes moved along `seq` (all devices together).

    Prefill: in every layer each of the C devices passes its K and V block
    [B, P/C, K, H] and their positions [B, P/C] int32 on C - 1 hops.
    Decode (per step): in every layer the partial results merge with a pmax of the
    lse [B, N], a psum of the weights [B, N] and a psum of o [B, N, H] (float32); a
    ring all-reduce moves 2 (C - 1) / C of the buffer per device.
    """
    if C == 1:
        return {
            "prefill": 0,
            "prefill_per_token": 0.0,
            "decode_per_step": 0,
            "decode_per_token": 0.0,
        }
    blk = B * (P_len // C)
    prefill = cfg.L * C * (C - 1) * (2 * blk * cfg.K * cfg.H * itemsize + blk * 4)
    merged = B * cfg.N * (cfg.H + 2) * 4
    decode = int(cfg.L * C * 2 * (C - 1) / C * merged)
    return {
        "prefill": int(prefill),
        "prefill_per_token": prefill / (B * P_len),
        "decode_per_step": decode,
        "decode_per_token": decode / B,
    }


# ---- the engine, timed --------------------------------------------------------------------


def prompts_for(cfg: Qwen3Config, B: int, T: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng([seed, B, T])
    return rng.integers(0, cfg.V, size=(B, T)).tolist()


def decode_cache_len(s: dict, C: int) -> int:
    """Cache slots per request of the decode jobs on C `seq` devices: --decode-cache-len
    rounded up to a multiple of C, or just enough for the prompt and the steps."""
    T, N = s["decode_prompt_len"], s["decode_steps"]
    need = fitting_seq_len(T, N + 1, C)
    asked = s.get("decode_cache_len")
    if asked is None:
        return need
    if asked < need:
        raise CLIError(
            f"--decode-cache-len {asked} is below the {need} slots a decode job of "
            f"{T} prompt tokens and {N} steps needs with seq={C}; give at least {need}"
        )
    return C * -(-asked // C)


def run_once(engine, prompts, new_tokens: int) -> dict:
    """One generate call, split at the streaming callbacks (see the module docstring)."""
    marks = []
    t0 = time.perf_counter()
    out = static_batch.generate(
        engine,
        prompts,
        new_tokens,
        on_tokens=lambda _: marks.append(time.perf_counter()),
        with_logits=False,
    )
    end = time.perf_counter()
    return {
        "prefill_s": marks[0] - t0,
        "decode_s": marks[-1] - marks[0],
        "total_s": end - t0,
        "program_prefill_s": out.timing["prefill_s"],
        "program_decode_s": out.timing["decode_s"],
        "compile_s": out.timing["compile_s"],
        "out": out,
    }


def memory_analysis(compiled) -> dict | None:
    """XLA's per-device buffer sizes of a compiled program."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if m is None:
        return None
    keys = (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {k: int(getattr(m, k, 0)) for k in keys}


def program_memory(engine) -> dict:
    """memory_analysis() of every program the engine compiled, by name and shapes."""
    return {name: memory_analysis(compiled) for name, compiled in engine.programs.compiled.items()}


class MemoSource:
    """A weight source read once and then served from memory, so several meshes and the
    peer see the same arrays without reading (or generating) them again."""

    def __init__(self, source):
        self.source, self.cfg, self._full = source, source.cfg, {}

    def full(self, path, dtype) -> np.ndarray:
        key = (path, np.dtype(dtype).name)
        if key not in self._full:
            self._full[key] = self.source.read(path, dtype)
        return self._full[key]

    def read(self, path, dtype, layers=None, part=None) -> np.ndarray:
        x = self.full(path, dtype)
        if path[0] == "layers" and layers is not None:
            x = x[list(layers)]
        return x if part is None else part.of(x)


class PlacedSource:
    """Hands an engine weights another engine on the same mesh already placed."""

    def __init__(self, state):
        self.state = state

    def place(self, abstract, plan, mesh):
        return self.state
