"""An engine and its scheduler built from settings: the Engine, its Speculator (a draft
model's own Engine on the same mesh), whether the prefix cache is on, the Scheduler
over them. Every door builds through here
(run.engine_args says its settings in these terms, and these errors in its own words);
it sits in the last room because it needs the engine, speculation and the scheduler."""

from __future__ import annotations

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


def prefix_caching(enabled: bool | None, engine) -> bool:
    """Whether the prefix cache is on: as asked (--enable-prefix-caching), and by
    default with one seq device only: with several, the cache lays every prompt out
    block by block (`pipeline.batch.prefix`), each device holding a part of every
    block, so the ring could skip no device pair of a long prompt's causal attention."""
    return engine.C == 1 if enabled is None else enabled


def scheduler(
    engine,
    max_batch: int,
    enable_prefix_caching: bool | None = None,
    speculator: Speculator | None = None,
    **kwargs,
) -> Scheduler:
    """The continuous-batching Scheduler over `engine` with `max_batch` rows, its prefix
    cache as asked (`prefix_caching`) and `speculator`; kwargs: Scheduler's
    (prefill_tokens, max_queue, decisions, grammars, kv_cache_memory_bytes, ...)."""
    return Scheduler(
        engine,
        max_batch,
        prefix_caching=prefix_caching(enable_prefix_caching, engine),
        speculator=speculator,
        **kwargs,
    )
