"""vLLM's `speculative_config`: which drafter, how many drafts a row, checked in words.

No JAX here: the command line checks the flag before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from qwen3_spmd.pipeline.speculative import ngram

METHODS = ("ngram", "draft_model")
KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
)
INTS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
# The keys of one method only (the others' keys are refused with it, not ignored).
ONLY = {"prompt_lookup_max": "ngram", "prompt_lookup_min": "ngram", "model": "draft_model"}
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


class SpeculativeConfigError(ValueError):
    """A speculative_config that cannot run, in one line: `problem` says what is wrong
    and what to write instead; each door prefixes the name it knows the setting by
    (`speculative_config`, `--speculative-config`)."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"speculative_config: {problem}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: up to num_speculative_tokens drafts a row.

    method "ngram" (prompt lookup): the drafts follow the longest n-gram of
    prompt_lookup_max .. prompt_lookup_min tokens that occurred before. A missing
    bound takes the other's value (5 when both are missing). method "draft_model": a
    smaller Qwen3 with the same vocabulary drafts (`model`: its folder, hub id or
    preset, opened as the main model is; `pipeline.speculative.draft_model`). disable_by_batch_size:
    while more requests than this hold rows, rounds decode without drafts (a pass of
    k + 1 positions over many rows can cost more than the tokens it saves: the
    benchmarks' batch-8 figures); None: always speculate."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None
    model: str | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A config from JSON text, a mapping, a config, or None/"" (no speculation);
        SpeculativeConfigError, one line naming the problem and the fix, otherwise."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(
                    f"not JSON ({e.msg} at character {e.pos}): write an object, e.g. {EXAMPLE}"
                ) from None
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError(
                f"{type(value).__name__} is not an object of keys: write e.g. {EXAMPLE}"
            )
        unknown = [k for k in value if k not in KEYS]
        if unknown:
            raise SpeculativeConfigError(
                f"unknown key {unknown[0]!r}: the keys taken are {', '.join(KEYS)}"
            )
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise SpeculativeConfigError(f"method {method!r} is not one of {', '.join(METHODS)}")
        if "num_speculative_tokens" not in value:
            raise SpeculativeConfigError("num_speculative_tokens is missing: add it, e.g. 4")
        for key, owner in ONLY.items():
            if key in value and owner != method:
                raise SpeculativeConfigError(
                    f"{key} is a key of method {owner!r}, not of {method!r}: remove it"
                )
        model = value.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model.strip()):
            raise SpeculativeConfigError(
                "method 'draft_model' needs model, the drafter's folder or hub id, e.g. "
                '{"method": "draft_model", "model": "Qwen/Qwen3-0.6B", '
                '"num_speculative_tokens": 4}'
            )
        ints = {}
        for key in INTS:
            if key in value:
                v = value[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise SpeculativeConfigError(f"{key} {v!r} must be an integer >= 1")
                ints[key] = v
        hi = ints.get("prompt_lookup_max", ints.get("prompt_lookup_min", 5))
        lo = ints.get("prompt_lookup_min", ints.get("prompt_lookup_max", 5))
        if lo > hi:
            raise SpeculativeConfigError(
                f"prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}: make min <= max"
            )
        return cls(
            ints["num_speculative_tokens"],
            method,
            hi,
            lo,
            ints.get("disable_by_batch_size"),
            model,
        )

    def propose(self, context, k: int) -> list[int]:
        """Up to k (<= num_speculative_tokens) drafts after `context` (ngram's; a draft
        model proposes for all rows at once: `pipeline.speculative.draft_model`)."""
        return ngram.propose(context, k, self.prompt_lookup_max, self.prompt_lookup_min)
