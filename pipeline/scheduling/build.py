"""An engine and its scheduler built from settings: the Engine, its Speculator (a draft
model's own Engine on the same mesh), the prefix cache's pool sized from the device's
memory, the Scheduler over them. Every door builds through here
(run.engine_args says its settings in these terms, and these errors in its own words);
it sits in the last room because it needs the engine, speculation and the scheduler."""

from __future__ import annotations

import dataclasses
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
class PrefixPool:
    """The prefix cache's pool as asked. enabled: None turns it on with one seq device
    and off with several (a mesh for long prompts would pay the block layout on every
    prompt). size: each device's bytes (None: `bytes_per_device` sizes it)."""

    enabled: bool | None = None
    size: int | None = None

    def bytes_per_device(self, engine, max_batch: int, many: bool = False, speculator=None) -> int:
        """The pool's bytes on each device of `engine` with `max_batch` rows: `size`, else
        half the memory free after the weights and every row's cache (`speculator`'s
        draft model's too) where the device tells its memory on one process, and as much as the rows'
        own KV cache where it does not (CPU) or with several processes (`many`: their
        pools must hold the same blocks, and their free memory may differ)."""
        if self.enabled is False:
            return 0
        if self.size is not None:
            return self.size
        if engine.C > 1 and not self.enabled:
            return 0  # long prompts: the block layout would cost the ring's skipped pairs
        rows = engine.copies.cache_bytes_per_device(max_batch)
        stats = None if many else engine.mesh.devices.flat[0].memory_stats()
        if stats and "bytes_limit" in stats:
            drafter = getattr(speculator, "drafter", None)
            draft_rows = 0  # made at its first proposal, after the pool: set aside now
            if drafter is not None:
                draft_rows = drafter.engine.copies.cache_bytes_per_device(max_batch)
            free = stats["bytes_limit"] - stats["bytes_in_use"] - rows - draft_rows
            return max(0, free // 2)
        return rows


def scheduler(
    engine,
    max_batch: int,
    pool: PrefixPool = PrefixPool(),
    many: bool = False,
    speculator: Speculator | None = None,
    **kwargs,
) -> Scheduler:
    """The continuous-batching Scheduler over `engine` with `max_batch` rows, the prefix
    cache's `pool` (many: several processes) and `speculator`; kwargs: Scheduler's
    (prefill_tokens, max_queue, decisions, grammars, ...)."""
    pool_bytes = pool.bytes_per_device(engine, max_batch, many, speculator)
    return Scheduler(
        engine, max_batch, prefix_cache_bytes=pool_bytes, speculator=speculator, **kwargs
    )
