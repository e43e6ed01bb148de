"""The jobs of one mesh shape: prefill per prompt length, decode per batch size, and the
memory each left behind (see run.bench.command for the scenarios, run.bench.measure for how
each figure is taken)."""

from __future__ import annotations

import gc

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.programs.schedule import decode_grid, prefill_grid
from qwen3_spmd.pipeline.requests import fitting_seq_len
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.run import traffic
from qwen3_spmd.run.bench.measure import (
    PlacedSource,
    all_reduce_time,
    decode_bytes_per_step,
    decode_cache_len,
    program_memory,
    prompts_for,
    ring_bytes,
    run_once,
    spread,
)
from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flops import prefill_flops
from qwen3_spmd.sharding.mesh import MeshShape


class MeshEngines:
    """Engines on one mesh that share one placement of the weights; one per cache size
    (each compiles its own programs)."""

    def __init__(self, cfg, source, mesh, dtype, settings, cp: str = "ring", roof=None):
        self.cfg, self.source, self.mesh, self.dtype, self.s = cfg, source, mesh, dtype, settings
        self.cp, self.roof = cp, roof
        self.state, self.engines = None, {}

    def get(self, max_seq_len: int, runner: str = "generate") -> Engine:
        """The engine for this cache size (and runner), made (and placed) on first use."""
        key = (max_seq_len, runner)
        if key not in self.engines:
            src = self.source if self.state is None else PlacedSource(self.state)
            rates = measured_rates(self.roof, self.mesh.shape["seq"])
            e = engine_args(self.s, self.cp, self.dtype.name).engine(
                self.cfg, src, self.mesh, max_seq_len, runner=runner, **rates
            )
            self.state = e.weights.state
            self.engines[key] = e
        return self.engines[key]


def engine_args(settings: dict, cp: str, dtype: str) -> EngineArgs:
    """The engine's settings of bench's jobs (a mesh's and a cp strategy's runs)."""
    return EngineArgs(
        dtype=dtype,
        microbatches=settings["microbatches"],
        groups=settings["groups"],
        chunk=settings["chunk"],
        cp=cp,
        expert_split=settings["expert_split"],
        block_size=settings.get("block_size", EngineArgs.block_size),
    )


def time_job(engine, prompts, new_tokens: int, settings) -> dict:
    """Compiles (first call), warms up, then times `repeats` calls."""
    first = run_once(engine, prompts, new_tokens)
    first["out"].cache = None
    for _ in range(settings["warmup"]):
        run_once(engine, prompts, new_tokens)
    runs = []
    for _ in range(settings["repeats"]):
        if runs:  # one cache on the devices at a time: keep only the last run's
            runs[-1]["out"].cache = None
        runs.append(run_once(engine, prompts, new_tokens))
    return {
        "compile_s": first["compile_s"],
        "runs": runs,
        "layout": runs[-1]["out"].layout,
        "cache": runs[-1]["out"].cache,
    }


def prefill_job(engines: MeshEngines, T: int, roof, say) -> dict:
    cfg, s, dtype = engines.cfg, engines.s, engines.dtype
    S, C = engines.mesh.shape["stage"], engines.mesh.shape["seq"]
    B = s["prefill_batch"]
    engine = engines.get(fitting_seq_len(T, 1, C))
    engine.check(prompts_for(cfg, B, T, s["seed"]), 1)
    job = time_job(engine, prompts_for(cfg, B, T, s["seed"]), 1, s)
    t = spread([r["prefill_s"] for r in job["runs"]])
    layout = job["layout"]
    sent = traffic.bytes_sent(cfg, S, C, {**layout, "chunks": 0}, dtype.itemsize)
    X = engines.mesh.shape["tensor"]
    D = engines.mesh.shape["data"]
    reduced = traffic.bytes_all_reduced(cfg, S, C, X, layout, dtype.itemsize, D)
    flops = prefill_flops(cfg, T, B)
    out = {
        "prompt_len": T,
        "batch": B,
        "padded_prompt": layout["padded_prompt"],
        "time_s": t,
        "tokens_per_s": spread([B * T / r["prefill_s"] for r in job["runs"]]),
        "program_time_s": spread([r["program_prefill_s"] for r in job["runs"]]),
        "compile_s": job["compile_s"],
        "flops": flops,
        "idle_fraction": engine.schedules(layout)["prefill"]["idle_fraction"],
        "stage_bytes": sent["prefill"],
        "stage_bytes_per_token": sent["prefill"] / (B * T),
        "all_reduce_bytes_per_tick": reduced["prefill_per_tick"],
        "all_reduce_s_per_tick": _all_reduces(
            engines, (B // layout["microbatches"]) * (layout["padded_prompt"] // C)
        ),
        "ring_bytes": ring_bytes(cfg, C, layout["batch"], layout["padded_prompt"], dtype.itemsize)[
            "prefill"
        ],
        "programs": program_memory(engine),
    }
    out["ring_bytes_per_token"] = out["ring_bytes"] / (B * T)
    chosen = layout["cp"][layout["cp_strategy"]]
    out.update(
        cp_strategy=layout["cp_strategy"],
        cp_bytes_per_device=chosen["bytes_per_device"],
        cp_bytes_per_device_per_layer=chosen["bytes_per_layer"],
        cp_predicted_s=chosen["predicted_s"],
        cp_model=layout["cp"],
    )
    if roof is not None:
        ideal = flops / roof["matmul_flops_per_s"]["median"]
        out["compute_roofline_s"] = ideal
        out["compute_roofline_fraction"] = ideal / t["median"]
    say(
        f"  prefill T={T} B={B}: {out['tokens_per_s']['median']:.1f} tok/s "
        f"({t['median']:.3f} s, min {t['min']:.3f}, max {t['max']:.3f}; {out['cp_strategy']} "
        f"predicted {out['cp_predicted_s']:.3f} s, {out['cp_bytes_per_device']:,} bytes per "
        f"device along seq); compile {job['compile_s']:.1f} s"
    )
    return out


def _all_reduces(engines: MeshEngines, rows: int) -> dict | None:
    """The measured time of one tick's `tensor` all-reduces of [rows, D], alone in a
    program without the layers around them (None without a `tensor` axis)."""
    if engines.mesh.shape["tensor"] == 1:
        return None
    count = traffic.all_reduces_per_tick(engines.cfg, engines.mesh.shape["stage"])
    return all_reduce_time(
        engines.mesh, rows, count, engines.cfg.D, engines.dtype, engines.s["repeats"]
    )


def decode_job(engines: MeshEngines, B: int, roof, say) -> tuple[dict, tuple[Engine, KVCache]]:
    cfg, s, dtype = engines.cfg, engines.s, engines.dtype
    S, C = engines.mesh.shape["stage"], engines.mesh.shape["seq"]
    T, N = s["decode_prompt_len"], s["decode_steps"]
    cache_len = decode_cache_len(s, C)
    engine = engines.get(cache_len)
    job = time_job(engine, prompts_for(cfg, B, T, s["seed"]), N + 1, s)
    t = spread([r["decode_s"] for r in job["runs"]])
    layout = job["layout"]
    sent = traffic.bytes_sent(cfg, S, C, layout, dtype.itemsize)
    X = engines.mesh.shape["tensor"]
    D = engines.mesh.shape["data"]
    reduced = traffic.bytes_all_reduced(cfg, S, C, X, layout, dtype.itemsize, D)
    to_all = traffic.bytes_all_to_all(cfg, engine.split, S, C, layout, dtype.itemsize)
    ring = ring_bytes(cfg, C, layout["batch"], layout["padded_prompt"], dtype.itemsize)
    # Context attended, averaged over the steps: the prompt plus the tokens so far.
    read = decode_bytes_per_step(cfg, B, T + (N - 1) / 2, dtype.itemsize)
    # A `data` replica decodes its share of the rows and reads every weight for them.
    replica_rows = layout["batch"] // D
    replica_read = decode_bytes_per_step(cfg, replica_rows, T + (N - 1) / 2, dtype.itemsize)
    out = {
        "batch": B,
        "padded_batch": layout["batch"],
        "groups": layout["groups"],
        "prompt_len": T,
        "steps": N,
        "cache_len": cache_len,
        "chunks": layout["chunks"],
        "time_s": t,
        "time_per_output_token_s": spread([r["decode_s"] / N for r in job["runs"]]),
        "tokens_per_s": spread([B * N / r["decode_s"] for r in job["runs"]]),
        "program_time_s": spread([r["program_decode_s"] for r in job["runs"]]),
        "host_overhead_fraction": spread(
            [1 - r["program_decode_s"] / r["decode_s"] for r in job["runs"]]
        ),
        "compile_s": job["compile_s"],
        "bytes_read_per_step": read,
        "replicas": D,
        "rows_per_replica": replica_rows,  # padded rows each replica decodes
        "bytes_read_per_replica_step": replica_read,
        "idle_fraction": engine.schedules(layout)["decode"]["idle_fraction"],
        "steady_idle_fraction": engine.schedules(layout)["decode"]["steady_idle_fraction"],
        "stage_bytes": sent["decode"],
        "stage_bytes_per_token": sent["decode"] / (B * N),
        "ring_bytes_per_token": ring["decode_per_step"] * layout["decode_steps"] / (B * N),
        "all_reduce_bytes_per_step": reduced["decode_per_step"],
        # Qwen3-MoE's "a2a" split: what its all-to-alls send, and the part tokens needed
        "all_to_all_bytes_per_step": to_all["decode_per_step"],
        "all_to_all_useful_bytes_per_step": to_all["decode_useful"],
        "all_to_all_sparse_layers": to_all["sparse_layers"],  # the two above cover them
        "all_reduce_s_per_step": _all_reduces(engines, layout["batch"] // layout["groups"]),
        "programs": program_memory(engine),
    }
    if roof is not None:
        ideal = read["total"] / roof["bandwidth_bytes_per_s"]["median"]
        out["bandwidth_roofline_s_per_step"] = ideal
        out["bandwidth_roofline_fraction"] = ideal / out["time_per_output_token_s"]["median"]
    tp = out["time_per_output_token_s"]
    reduces = out["all_reduce_s_per_step"]
    say(
        f"  decode B={B}: {out['tokens_per_s']['median']:.1f} tok/s, "
        f"{tp['median'] * 1e3:.1f} ms/token (min {tp['min'] * 1e3:.1f}, max {tp['max'] * 1e3:.1f})"
        + (f", its all-reduces alone {reduces['median'] * 1e3:.1f} ms" if reduces else "")
        + f"; compile {job['compile_s']:.1f} s"
    )
    return out, (engine, job["cache"])


def memory_of(engine: Engine, cache: KVCache) -> dict:
    """Bytes per device of the weights and of a cache the engine left, and of its programs."""
    weights = traffic.bytes_per_device(engine.weights.state)
    kv = traffic.bytes_per_device((cache.k, cache.v))
    return {
        "weight_bytes_per_device": weights,
        "kv_bytes_per_device": kv,
        "max_weight_bytes": max(weights),
        "max_kv_bytes": max(kv),
        "programs": program_memory(engine),
    }


def measured_rates(roof, seq: int) -> dict:
    """The link bandwidth among `seq` devices and the matmul throughput bench measured,
    as Engine takes them (for the cost model); {} where they were not measured."""
    if not roof:
        return {}
    link = next((x for x in roof["links"] if x["devices"] == seq), None)
    return {
        "link_bytes_per_s": {k: link[k]["median"] for k in ("ppermute", "all_to_all")}
        if link
        else None,
        "flops_per_s": roof["matmul_flops_per_s"]["median"],
    }


def run_mesh(
    cfg,
    source,
    mesh,
    dtype,
    settings,
    scenarios,
    roof,
    say,
    engines: MeshEngines | None = None,
    cp: str = "ring",
    *,
    grammars=None,
) -> dict:
    """Every job of the scenarios on one mesh, prefill's attention along seq split as
    `cp` says. `engines` (kept by the caller to reuse the compiled programs later, as
    the peer does with 1x1) defaults to fresh ones. A strategy other than the ring is
    named in the entry's mesh label ("1x4 ulysses"). grammars: the model's
    (`pipeline.structured.constraints.Grammars`) for the structured scenario; None: skipped."""
    shape = MeshShape.of(mesh)
    label = str(shape) if cp == "ring" else f"{shape} {cp}"
    say(f"mesh {label}:")
    engines = engines or MeshEngines(cfg, source, mesh, dtype, settings, cp, roof)
    entry = {
        "mesh": label,
        "data": shape.data,
        "stage": shape.stage,
        "seq": shape.seq,
        "tensor": shape.tensor,
        "devices": shape.devices,
        "cp": cp,
    }
    last = None
    # Over replicas the scheduler serves (paged), speculation runs one replica, and the
    # other served loads compare with one replica's static batches and rows.
    one_replica = {"speculative", "structured", "embed", "serve"} & set(scenarios)
    if shape.data > 1 and one_replica:
        say(
            f"  {', '.join(sorted(one_replica))}: not on {label} (speculation runs one "
            "replica; the other loads are sized for one replica's rows)"
        )
        scenarios = [s for s in scenarios if s not in one_replica]
    if "prefill" in scenarios:
        entry["prefill"] = [prefill_job(engines, T, roof, say) for T in settings["prompt_lens"]]
    if "decode" in scenarios:
        entry["decode"] = []
        for B in settings["batches"]:
            job, last = decode_job(engines, B, roof, say)
            entry["decode"].append(job)
    if "prompt_logprobs" in scenarios:
        from qwen3_spmd.run.bench.scoring import prompt_logprobs_job

        entry["prompt_logprobs"] = [
            prompt_logprobs_job(engines, T, say) for T in settings["prompt_lens"]
        ]
    if "speculative" in scenarios:
        from qwen3_spmd.run.bench.speculative import speculative_job

        entry["speculative"] = [speculative_job(engines, B, say) for B in settings["batches"]]
    if "structured" in scenarios:
        from qwen3_spmd.run.bench.serve import structured_scenario

        entry["structured"] = structured_scenario(engines, settings, grammars, say)
    if "embed" in scenarios:
        from qwen3_spmd.run.bench.embed import embed_job

        entry["embed"] = embed_job(engines, settings, say)
    if "paged" in scenarios:
        from qwen3_spmd.run.bench.paged import paged_job

        entry["paged"] = paged_job(engines, settings, say)
    if "serve" in scenarios:
        from qwen3_spmd.run.bench.serve import serve_job

        entry["serve"] = serve_job(engines, settings, say)
    if "memory" in scenarios:
        if last is None:  # memory alone: one small decode job leaves a cache to measure
            _, last = decode_job(engines, max(settings["batches"]), None, say)
        entry["memory"] = {**memory_of(*last), "after": f"decode batch {last[1].k.shape[1]}"}
        m = entry["memory"]
        say(
            f"  memory: weights {m['max_weight_bytes'] / 2**20:.1f} MiB, KV "
            f"{m['max_kv_bytes'] / 2**20:.1f} MiB per device"
        )
    steps = min(settings["chunk"], settings["decode_steps"])
    G = shape.stage if settings["groups"] is None else settings["groups"]
    entry["timeline"] = {
        "prefill": prefill_grid(settings["microbatches"], shape.stage),
        "decode": decode_grid(G, shape.stage, steps),
    }
    compiles = [j["compile_s"] for k in ("prefill", "decode") for j in entry.get(k, [])]
    entry["compile_s_max"] = max(compiles) if compiles else 0.0
    del engines, last
    gc.collect()
    return entry
