"""The stage plan: which decoder layers each pipeline stage owns.

The stacked layer axis is padded to L_pad = S * ceil(L / S) slots so that it shards
evenly over S stages. Real layers are spread as evenly as possible (the first L mod S
stages get one more), each stage's real layers first in its slots, and the padding
slots are identity layers that the stage loop skips.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


class PlanError(ValueError):
    """A layer count that cannot be split over the stages."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    num_layers: int  # L
    stages: int  # S

    def __post_init__(self):
        if self.stages > self.num_layers:
            raise PlanError(
                f"{self.stages} pipeline stages but the model has only {self.num_layers} layers: "
                f"use at most {self.num_layers} stages"
            )

    @property
    def per_stage(self) -> int:
        """Slots per stage, L_pad / S."""
        return math.ceil(self.num_layers / self.stages)

    @property
    def padded_layers(self) -> int:
        """L_pad."""
        return self.per_stage * self.stages

    @property
    def counts(self) -> list[int]:
        """Real layers on each stage."""
        base, extra = divmod(self.num_layers, self.stages)
        return [base + (s < extra) for s in range(self.stages)]

    @property
    def stage_layers(self) -> list[list[int]]:
        """[[first, last], ...] real layer indices per stage (inclusive)."""
        out, first = [], 0
        for n in self.counts:
            out.append([first, first + n - 1])
            first += n
        return out

    @property
    def layer_of_slot(self) -> list[int | None]:
        """Slot in [0, L_pad) -> real layer index, or None for an identity slot."""
        slots: list[int | None] = []
        for first, last in self.stage_layers:
            ids = list(range(first, last + 1))
            slots += ids + [None] * (self.per_stage - len(ids))
        return slots

    @property
    def real_slots(self) -> np.ndarray:
        """[L_pad] bool: False marks an identity (padding) slot."""
        return np.array([i is not None for i in self.layer_of_slot])
