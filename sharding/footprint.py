"""Bytes each device holds for a model on a stage x seq x tensor mesh, read from the
shardings the engine places with (no devices needed: an abstract mesh gives the shard
shapes).

Weights: every stage slot of a layer parameter is one [S, ...] buffer sharded
P('stage', ...) (sharding.place), so a device holds L_pad / S layers of each, identity
slots included, and of each its `tensor` share (sharding.specs.param_spec: heads,
columns, vocabulary rows or experts; norms and the router whole). KV cache: k and v
[L_pad, B, K', S_cap, H] sharded P('stage', None, 'tensor', 'seq', None), K' the KV
heads as placed (repeats counted: model.split).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.fp8 import D_AXIS, weight_name
from qwen3_spmd.model.params import abstract_model, map_params
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.sharding.mesh import AXES, parse_mesh
from qwen3_spmd.sharding.specs import SPECS, param_spec
from qwen3_spmd.sharding.stages import StagePlan


def _shard_bytes(mesh: AbstractMesh, spec, shape, dtype) -> int:
    return math.prod(NamedSharding(mesh, spec).shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def bytes_per_device(
    cfg: Qwen3Config,
    stages: int,
    seq: int,
    dtype,
    batch: int = 1,
    max_seq_len: int = 0,
    tensor: int = 1,
    experts: str | None = None,
    block_size: int = 16,
    data: int = 1,
) -> dict[str, int]:
    """{'weights', 'linear', 'kv', 'total'}: bytes on one device (every device holds the
    same); 'linear' is the part of 'weights' in the attention and MLP projections (the
    weights an FP8 config, `cfg.fp8_block`, holds in one byte plus scales: model.fp8);
    'kv' a pool of KV pages of `block_size` slots that gives `batch` requests of
    `max_seq_len` tokens their pages (each `seq` device ceil(max_seq_len / seq) slots of
    each, in whole pages), ceil(batch / data) of them on each of `data` replicas (whose
    weights are each a whole copy)."""
    mesh = AbstractMesh((data, stages, seq, tensor), AXES)
    plan = StagePlan(cfg.L, stages)
    split = TensorSplit.of(tensor, data, experts)
    split.check(cfg)
    experts = split.experts
    _, abstract = abstract_model(cfg, dtype, split)
    sizes, linear = [], []

    def leaf(path, x):
        spec = param_spec(path, experts)
        if path[0] == "layers":  # per_stage slot buffers of [S, ...]
            one = _shard_bytes(mesh, spec, (stages, *x.shape[1:]), x.dtype)
            sizes.append(plan.per_stage * one)
        else:
            sizes.append(_shard_bytes(mesh, spec, x.shape, x.dtype))
        if weight_name(path[-1]) in D_AXIS:
            linear.append(sizes[-1])
        return x

    map_params(leaf, abstract)
    slots = math.ceil(math.ceil(max_seq_len / seq) / block_size) * block_size  # in pages
    rows = -(-batch // data) * data  # each replica's share, whole
    kv_shape = (plan.padded_layers, rows, split.kv_heads(cfg), seq * slots, cfg.H)
    kv = 2 * _shard_bytes(mesh, SPECS.cache_lbksh, kv_shape, dtype) if max_seq_len else 0
    weights = sum(sizes)
    return {"weights": weights, "linear": sum(linear), "kv": kv, "total": weights + kv}


def _cli():
    import argparse

    from qwen3_spmd.model.config import PRESETS

    p = argparse.ArgumentParser(prog="python -m qwen3_spmd.sharding.footprint")
    p.add_argument("--model", default="235B-A22B", choices=list(PRESETS))
    p.add_argument("--meshes", default="4x2,8x2,8x1x8,2x1x8")
    p.add_argument("--expert-split", choices=("ep", "tp", "a2a"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=32768)
    a = p.parse_args()
    cfg = PRESETS[a.model]
    dtype = jax.numpy.dtype(a.dtype)
    print(
        f"{a.model}: {cfg.param_count() / 1e9:.1f}B parameters, "
        f"{cfg.param_count(active=True) / 1e9:.2f}B active; {a.dtype}, batch {a.batch}, "
        f"{a.max_seq_len} cache slots per request"
    )
    for m in a.meshes.split(","):
        shape = parse_mesh(m)
        b = bytes_per_device(
            cfg,
            *shape[:2],
            dtype,
            a.batch,
            a.max_seq_len,
            shape.tensor,
            a.expert_split,
            data=shape.data,
        )
        print(
            f"  {shape}: weights {b['weights'] / 1e9:6.1f} GB + KV {b['kv'] / 1e9:5.1f} GB "
            f"= {b['total'] / 1e9:6.1f} GB per device"
        )


if __name__ == "__main__":
    _cli()
