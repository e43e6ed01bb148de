"""Placing parameters onto the mesh straight from a weight source.

A host reads only what its devices hold: the layers of their stages and, when the
`tensor` axis spans hosts, only their rows of each split axis (heads, columns,
vocabulary, experts). Each device's shard is cut from those by a callback
(`jax.make_array_from_callback`), so a host holds no more of a parameter than the rows
its devices hold (orbax reads whole pieces: up to one more at each end of them).
Identity slots of the stage plan are zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import Part, abstract_model, map_params
from qwen3_spmd.model.split import Cut, TensorSplit
from qwen3_spmd.sharding.specs import param_spec, tensor_axis
from qwen3_spmd.sharding.stages import StagePlan


class WeightSource(Protocol):
    """A checkpoint, or seeded random weights: a parameter in our layout (model.params),
    the checkpoint's sizes."""

    cfg: Qwen3Config

    def read(
        self,
        path: tuple[str, ...],
        dtype,
        layers: Sequence[int] | None = None,
        part: Part | None = None,
    ) -> np.ndarray: ...


def host_cut(
    path: tuple[str, ...],
    sharding: NamedSharding,
    shape: tuple[int, ...],
    split: TensorSplit,
    checkpoint: tuple[int, ...],
) -> Cut | None:
    """This process's rows of parameter `path`'s `tensor` axis, placed as `shape` under
    `sharding`, and the rows of the `checkpoint` shape they come from (None: the
    parameter has no `tensor` axis). What a host reads of it, here and in the load
    bar's total (run.generate.load)."""
    axis = tensor_axis(path, split.experts)
    if axis is None:
        return None
    spans = [
        index[axis].indices(shape[axis])[:2]
        for index in sharding.addressable_devices_indices_map(shape).values()
    ]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    return split.cut(path, axis, checkpoint[axis], shape[axis], lo, hi)


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

    One parameter at a time: the source reads the layers of this host's stages and its
    rows of the `tensor` axis (one call, so a checkpoint reader can fetch them in
    parallel), and each device's shard is cut from them; the host copy is dropped
    before the next parameter.

    Args:
      abstract_state: state of ShapeDtypeStructs with stacked layers [L, ...].
      plan: the stage plan; each layer leaf becomes a tuple of L_pad / S per-slot arrays
        [S, ...] sharded P('stage') (slot j of every stage: see pipeline.programs.stage.run_stage),
        zeros in identity slots.
      source: its `cfg` gives the checkpoint's sizes.
      split: the tensor split (model.split): each parameter's `tensor` axis (by
        sharding.specs.tensor_axis); this host reads the checkpoint rows of its devices'
        placed rows (`TensorSplit.cut`: KV heads repeated, widths and vocabulary padded).
    """
    slots = plan.layer_of_slot
    per = plan.per_stage
    _, unsplit = abstract_model(source.cfg, np.float32)
    sizes: dict[tuple[str, ...], tuple[int, ...]] = {}
    map_params(lambda path, x: sizes.__setitem__(path, x.shape), unsplit)

    def cut(path, sharding, shape) -> Cut | None:
        return host_cut(path, sharding, shape, split, sizes[path])

    def read(path, dtype, c: Cut | None, layers=None) -> np.ndarray:
        if c is None:
            return source.read(path, dtype, layers)
        rows = c.rows()
        part = None if rows == (0, c.n) else Part(c.axis, *rows)
        return c.fit(source.read(path, dtype, layers, part=part))

    def local(index: tuple[slice, ...], shape, c: Cut | None) -> tuple[slice, ...]:
        """A device's index into the global array -> into this host's rows."""
        if c is None:
            return index
        start, stop, _ = index[c.axis].indices(shape[c.axis])
        return (*index[: c.axis], slice(start - c.lo, stop - c.lo), *index[c.axis + 1 :])

    def place(path, x):
        sharding = NamedSharding(mesh, param_spec(path, split.experts))
        if path[0] != "layers":
            c = cut(path, sharding, x.shape)
            mine = read(path, x.dtype, c)
            return jax.make_array_from_callback(
                x.shape, sharding, lambda index: mine[local(index, x.shape, c)]
            )
        shape = (plan.stages, *x.shape[1:])  # one slot of every stage
        c = cut(path, sharding, shape)
        stages = sorted(
            {
                s
                for index in sharding.addressable_devices_indices_map(shape).values()
                for s in range(*index[0].indices(plan.stages)[:2])
            }
        )
        mine = [i for s in stages for i in slots[s * per : (s + 1) * per] if i is not None]
        row = {layer: r for r, layer in enumerate(mine)}
        layers = read(path, x.dtype, c, mine)
        zeros = np.zeros(layers.shape[1:], x.dtype)

        def slot(j: int) -> jax.Array:
            def shard(index):
                start, stop, _ = index[0].indices(plan.stages)
                ids = (slots[s * per + j] for s in range(start, stop))
                held = np.stack([zeros if i is None else layers[row[i]] for i in ids])
                return held[(slice(None), *local(index, shape, c)[1:])]

            return jax.make_array_from_callback(shape, sharding, shard)

        return tuple(slot(j) for j in range(per))

    return map_params(place, abstract_state)
