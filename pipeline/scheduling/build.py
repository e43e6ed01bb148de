"""An engine and its scheduler built from settings: the Engine, its Speculator (a draft
model's own Engine on the same mesh), the pool of KV pages sized from the device's
memory, whether the prefix cache is on, the Scheduler over them. Every door builds
through here (run.engine_args says its settings in these terms, and these errors in its
own words);
it sits in the last room because it needs the engine, speculation and the scheduler."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig
from qwen3_spmd.pipeline.speculative.speculator import Speculator, make_speculator


class DraftError(ValueError):
    """A draft model that cannot draft for the model (another vocabulary, or a mesh its
    heads or layers do not fit); the message names it."""


def engine(cfg, source, mesh, **kwargs) -> Engine:
    """The Engine of `cfg`'s weights from `source` on `mesh` (kwargs: Engine's settings)."""
    return Engine(cfg, source, mesh, **kwargs)


def speculator(
    main: Engine,
    speculative=None,
    open_draft: Callable[[str], tuple] | None = None,
    **kwargs,
) -> Speculator | None:
    """The Speculator over `main` that decodes as `speculative` asks (a
    SpeculativeConfig, its JSON or mapping; None: plain decoding, None back).
    open_draft(name) -> (cfg, source): the draft model of method draft_model; its own
    Engine takes `main`'s mesh and the settings `kwargs`."""
    spec = SpeculativeConfig.parse(speculative)
    draft = None
    if spec is not None and spec.method == "draft_model":
        draft = _draft(main, spec.model, *open_draft(spec.model), kwargs)
    return make_speculator(main, spec, draft)


def _draft(main: Engine, name: str, cfg, source, kwargs: dict) -> Engine:
    if cfg.V != main.cfg.V:
        raise DraftError(
            f"model {name}: its vocabulary has {cfg.V} tokens and the model's "
            f"{main.cfg.V}: a drafter must share the model's tokenizer"
        )
    try:
        return Engine(cfg, source, main.mesh, **kwargs)
    except ValueError as e:  # a mesh the draft model cannot take (heads, layers)
        raise DraftError(f"model {name}: {e}") from None


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """Each device's bytes for the pool of KV pages (None: every row's most) and how
    they were found, in words for the start-up line."""

    bytes: int | None
    how: str


def pool_size(
    engine,
    max_batch: int,
    asked: int | None = None,
    utilization: float = 0.9,
    many: bool = False,
    speculator: Speculator | None = None,
    prefill_tokens: int = 4096,
) -> PoolSize:
    """The pool of KV pages on each device of `engine` (vLLM's sizing): `asked`
    (--kv-cache-memory-bytes) where given; else, on a device that tells its memory (a
    GPU) in one process, `utilization` (--gpu-memory-utilization) of it less what is in
    use (the weights placed), a draft model's cache for `max_batch` rows, and the
    temporaries of the largest prefill (`prefill_tokens` a microbatch; XLA's memory
    analysis, compiled, not run). Else every row's most (max_batch rows of max_seq_len:
    no request waits for pages): with several processes, whose pools must hold the same
    pages while their free memory may differ; and on CPU, which tells no memory, within
    `utilization` of the host's available memory over its devices."""
    if asked is not None:
        return PoolSize(asked, "--kv-cache-memory-bytes")
    if many:
        return PoolSize(None, "every row's --max-model-len: several processes hold one pool")
    device = engine.mesh.devices.flat[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        drafter = getattr(speculator, "drafter", None)
        draft = drafter.engine.copies.cache_bytes_per_device(max_batch) if drafter else 0
        tokens = min(prefill_tokens, engine.max_seq_len)
        temp = engine.prefill_memory(engine.M, tokens)["temp"]
        limit = int(utilization * stats["bytes_limit"])
        free = limit - stats["bytes_in_use"] - draft - temp
        return PoolSize(
            max(free, 0),
            f"--gpu-memory-utilization {utilization}: {limit / 2**30:.2f} GiB of the "
            f"device less {stats['bytes_in_use'] / 2**30:.2f} in use, "
            f"{draft / 2**30:.2f} of draft cache, {temp / 2**30:.2f} of prefill temporaries",
        )
    rows = engine.copies.cache_bytes_per_device(engine.D * max_batch)  # max_batch a replica
    share = int(utilization * host_available_bytes()) // engine.mesh.devices.size
    if share < rows:
        return PoolSize(
            share,
            f"no memory stats on {device.platform}: --gpu-memory-utilization "
            f"{utilization} of the host's available memory over its "
            f"{engine.mesh.devices.size} devices, under every row's --max-model-len",
        )
    return PoolSize(None, f"no memory stats on {device.platform}: every row's --max-model-len")


def host_available_bytes() -> int:
    """The host's memory available to a new allocation (Linux's MemAvailable; else its
    free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def prefix_caching(enabled: bool | None, engine) -> bool:
    """Whether the prefix cache is on: as asked (--enable-prefix-caching), and by
    default with one seq device only: with several, the cache lays every prompt out
    block by block (`pipeline.batch.prefix`), each device holding a part of every
    block, so the ring could skip no device pair of a long prompt's causal attention."""
    return engine.C == 1 if enabled is None else enabled


def scheduler(
    engine,
    max_batch: int,
    pool: PoolSize = PoolSize(None, ""),
    enable_prefix_caching: bool | None = None,
    speculator: Speculator | None = None,
    **kwargs,
) -> Scheduler:
    """The continuous-batching Scheduler over `engine` with `max_batch` rows, a `pool` of
    KV pages (`pool_size`), its prefix cache as asked (`prefix_caching`) and
    `speculator`; kwargs: Scheduler's (prefill_tokens, max_queue, decisions, grammars,
    ...)."""
    return Scheduler(
        engine,
        max_batch,
        prefix_caching=prefix_caching(enable_prefix_caching, engine),
        speculator=speculator,
        kv_cache_memory_bytes=pool.bytes,
        kv_sizing=pool.how,
        **kwargs,
    )
