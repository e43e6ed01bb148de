"""Parameters by path: the model's NNX state without allocating it, and maps over it.

A parameter is named by its path in the NNX state, e.g. `("layers", "q_nhd")` (layer
parameters stacked `[L, ...]`) or `("embed_vd",)`; weight sources read by that path and
`sharding` chooses a PartitionSpec by it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.layers import Qwen3
from qwen3_spmd.model.split import TensorSplit

ParamPath = tuple[str, ...]


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
