"""Placing parameters onto the mesh straight from a weight source.

Each device's shard is built by a callback that reads only the layers that device
holds (`jax.make_array_from_callback`), so no host ever materialises the full stacked
weights unless it holds all stages. Identity slots of the stage plan are zeros.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sharding.plan import StagePlan
from sharding.specs import SPECS, param_spec


class WeightSource(Protocol):
    def read(self, path: tuple[str, ...], dtype, layers: Sequence[int] | None = None) -> np.ndarray:
        ...


def place_state(abstract_state: Any, plan: StagePlan, mesh: Mesh, source: WeightSource):
    """The model state on `mesh` from any weight source: one that restores already
    sharded arrays (an orbax checkpoint) places itself; any other is read slice by
    slice into each device's shard (`place_params`)."""
    place = getattr(source, "place", None)
    if place is not None:
        return place(abstract_state, plan, mesh)
    return place_params(abstract_state, plan, mesh, source)


def place_params(abstract_state: Any, plan: StagePlan, mesh: Mesh, source: WeightSource):
    """The model state with every leaf a global jax.Array on `mesh`.

    Args:
      abstract_state: state of ShapeDtypeStructs with stacked layers [L, ...].
      plan: the stage plan; each layer leaf becomes a tuple of L_pad / S per-slot arrays
        [S, ...] sharded P('stage') (the layout of `to_slots`), placed straight from the
        source.
    """
    slots = plan.layer_of_slot
    per = plan.per_stage

    def place(path, x):
        sharding = NamedSharding(mesh, param_spec(path))
        if path[0] != "layers":
            whole = functools.cache(lambda: source.read(path, x.dtype))
            return jax.make_array_from_callback(x.shape, sharding, lambda index: whole()[index])

        @functools.cache
        def stage_block(stage: int) -> np.ndarray:
            """[per, ...]: the stage's slots, its real layers read once for all slots."""
            ids = slots[stage * per:(stage + 1) * per]
            real = [i for i in ids if i is not None]
            values = iter(source.read(path, x.dtype, real))
            return np.stack([next(values) if i is not None else np.zeros(x.shape[1:], x.dtype)
                             for i in ids])

        def slot(j: int) -> jax.Array:
            def shard(index):
                start, stop, _ = index[0].indices(plan.stages)
                return np.stack([stage_block(s)[j] for s in range(start, stop)])[
                    (slice(None), *index[1:])]

            return jax.make_array_from_callback((plan.stages, *x.shape[1:]), sharding, shard)

        return tuple(slot(j) for j in range(per))

    def leaf(keypath, x):
        path = tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))
        return place(path, x)

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


def to_slots(state: Any, plan: StagePlan, mesh: Mesh):
    """The placed state with each stacked layer leaf [L_pad, ...] (P('stage')), as a
    source that places itself restores it (orbax), turned into a tuple of L_pad / S
    per-slot arrays [S, ...] (P('stage')): element j holds slot j of every stage.
    Separate buffers let each layer's matmuls read their weights in place (see
    pipeline.stage.run_stage). Done leaf by leaf on the devices, each stacked leaf
    deleted once split, so the extra memory is at most one leaf; leaves already split
    (as `place_params` places them) pass.
    """
    S, per = plan.stages, plan.per_stage
    sharding = NamedSharding(mesh, SPECS.layers)
    split = jax.jit(lambda a: tuple(a.reshape(S, per, *a.shape[1:])[:, j] for j in range(per)),
                    out_shardings=(sharding,) * per)

    def leaf(keypath, x):
        if isinstance(x, tuple) or str(keypath[0].key) != "layers":
            return x
        slots = split(x)
        x.delete()  # no output can alias it (other shapes), so donating would not free it
        return slots

    return jax.tree_util.tree_map_with_path(leaf, state, is_leaf=lambda x: isinstance(x, tuple))
