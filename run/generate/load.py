"""`generate`'s weights onto the mesh and its tokens generated: a progress bar while
the checkpoint is read and the programs compile (its total: the bytes this process
reads), then static_batch.generate, under the JAX profiler with --profile.
"""

from __future__ import annotations

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.generate.job import Job
from qwen3_spmd.run.generate.stream import DoneStreamer, Streamer


def load_and_generate(args, engine_args: EngineArgs, job: Job, procs, show: bool):
    """(Generation, Engine, its Speculator or None, the streamer or None): loads the
    weights onto the mesh and generates, streaming text when a person reads it."""
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
                Streamer(job.text, progress)
                if len(job.prompts) == 1
                else DoneStreamer(job.text, progress, job.prompts, args.max_new_tokens, job.eos)
            )
        out = _generate(engine, args, job.prompts, job.sampling, job.eos, stream, job, speculator)
    finally:
        progress.stop()
    if stream:
        stream.finish()
    return out, engine, speculator, stream


def _mesh_line(job: Job, procs) -> str:
    """'mesh 2x2 (stage x seq) over 4 CPU devices, float32', and what is left unused."""
    from qwen3_spmd.sharding.mesh import MeshShape

    shape = MeshShape.of(job.mesh)
    n = shape.devices
    axes = "stage x seq x tensor" if shape.tensor > 1 else "stage x seq"
    axes = f"data x {axes}" if shape.data > 1 else axes
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


def _bytes_to_read(cfg, dtype, stages: int, mesh, experts: str | None) -> int:
    """Bytes this process reads (the progress bar's total): the layers of its stages, of
    each split parameter only its rows (`sharding.place.host_cut`, as the placement
    reads them), the rest whole."""
    import math

    import jax
    from jax.sharding import NamedSharding

    from qwen3_spmd.model.params import abstract_model, map_params
    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.sharding.mesh import stage_devices
    from qwen3_spmd.sharding.place import host_cut
    from qwen3_spmd.sharding.specs import param_spec
    from qwen3_spmd.sharding.stages import StagePlan

    plan = StagePlan(cfg.L, stages)
    here = jax.process_index()
    mine = {
        s for s, row in enumerate(stage_devices(mesh)) if any(d.process_index == here for d in row)
    }
    layers = sum(plan.counts[s] for s in mine)
    split = TensorSplit.of(mesh.shape["tensor"], mesh.shape["data"], experts)
    experts = split.experts
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
