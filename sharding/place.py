"""Placing parameters onto the mesh straight from a weight source.

A host reads only the layers of the stages its devices hold, and each device's shard is
cut from them by a callback (`jax.make_array_from_callback`), so no host ever
materialises the full stacked weights unless it holds all stages. Identity slots of
the stage plan are zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qwen3_spmd.model.params import map_params
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.sharding.plan import StagePlan
from qwen3_spmd.sharding.specs import param_spec


class WeightSource(Protocol):
    def read(
        self, path: tuple[str, ...], dtype, layers: Sequence[int] | None = None
    ) -> np.ndarray: ...


def place_state(
    abstract_state: Any,
    plan: StagePlan,
    mesh: Mesh,
    source: WeightSource,
    split: TensorSplit = TensorSplit(),
):
    """The model state on `mesh` from a weight source: `place_params`, unless the source
    holds a state already placed on this mesh and places itself (`place`)."""
    place = getattr(source, "place", None)
    if place is not None:
        return place(abstract_state, plan, mesh)
    return place_params(abstract_state, plan, mesh, source, split)


def place_params(
    abstract_state: Any,
    plan: StagePlan,
    mesh: Mesh,
    source: WeightSource,
    split: TensorSplit = TensorSplit(),
):
    """The model state with every leaf a global jax.Array on `mesh`.

    One parameter at a time: the source reads the layers of this host's stages (one
    call, so a checkpoint reader can fetch them in parallel), and each device's shard
    is cut from them; the host copy is dropped before the next parameter.

    Args:
      abstract_state: state of ShapeDtypeStructs with stacked layers [L, ...].
      plan: the stage plan; each layer leaf becomes a tuple of L_pad / S per-slot arrays
        [S, ...] sharded P('stage') (slot j of every stage: see pipeline.stage.run_stage),
        zeros in identity slots.
      split: the tensor split (model.split): each parameter's `tensor` axis (by
        sharding.specs.param_spec) and the checkpoint arrays fitted to the placed
        shapes (KV heads repeated, widths and vocabulary padded).
    """
    slots = plan.layer_of_slot
    per = plan.per_stage

    def place(path, x):
        sharding = NamedSharding(mesh, param_spec(path, split.experts))
        if path[0] != "layers":
            whole = split.fit(path, source.read(path, x.dtype), x.shape)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: whole[index])
        shape = (plan.stages, *x.shape[1:])  # one slot of every stage
        stages = sorted(
            {
                s
                for index in sharding.addressable_devices_indices_map(shape).values()
                for s in range(*index[0].indices(plan.stages)[:2])
            }
        )
        mine = [i for s in stages for i in slots[s * per : (s + 1) * per] if i is not None]
        row = {layer: r for r, layer in enumerate(mine)}
        read = split.fit(path, source.read(path, x.dtype, mine), (len(mine), *x.shape[1:]))
        zeros = np.zeros(x.shape[1:], x.dtype)

        def slot(j: int) -> jax.Array:
            def shard(index):
                start, stop, _ = index[0].indices(plan.stages)
                ids = (slots[s * per + j] for s in range(start, stop))
                return np.stack([zeros if i is None else read[row[i]] for i in ids])[
                    (slice(None), *index[1:])
                ]

            return jax.make_array_from_callback(shape, sharding, shard)

        return tuple(slot(j) for j in range(per))

    return map_params(place, abstract_state)
