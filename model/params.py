"""Parameters by path: the model's NNX state without allocating it, and maps over it.

A parameter is named by its path in the NNX state, e.g. `("layers", "q_nhd")` (layer
parameters stacked `[L, ...]`) or `("embed_vd",)`; weight sources read by that path and
`sharding` chooses a PartitionSpec by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.layers import Qwen3
from qwen3_spmd.model.split import TensorSplit

ParamPath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows `start` to `stop` of one axis of a parameter, in the checkpoint's sizes (no
    padding or repeated heads): what a host reads when its devices hold only some of the
    `tensor` axis (sharding.place). `axis` counts as the stored layout does: [L, ...]
    for a layer parameter (so never 0 there), [V, D] outside the layers."""

    axis: int
    start: int
    stop: int

    def of(self, x: np.ndarray) -> np.ndarray:
        """This part of x, an array of the whole parameter (its layer axis any subset)."""
        return x[(slice(None),) * self.axis + (slice(self.start, self.stop),)]


def param_path(keypath) -> ParamPath:
    """A jax key path into the NNX state -> the parameter's path of names."""
    return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def map_params(fn: Callable[[ParamPath, jax.ShapeDtypeStruct], jax.Array], state: nnx.State):
    """Builds a state whose leaves are fn(path, abstract leaf), e.g. read from a checkpoint."""
    return jax.tree_util.tree_map_with_path(lambda keypath, x: fn(param_path(keypath), x), state)


def abstract_model(
    cfg: Qwen3Config, dtype, split: TensorSplit = TensorSplit()
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs) of the model, without allocating it; with
    a tensor split, the placed (global) shapes (model.split)."""
    return nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0), split=split)))
