"""Seeded random weights with the same reading interface as a checkpoint.

Used by the built-in demo and by benchmarks of a preset shape: each tensor (each
layer of a stacked one) comes from its own generator seeded by (seed, name, layer),
so any subset reads the same values wherever it is read, on any mesh or host.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import ParamPath, abstract_model, map_params


class RandomWeights:
    """Reads like `HFCheckpoint`: read(path, dtype, layers) -> numpy array in our layout."""

    def __init__(self, cfg: Qwen3Config, seed: int = 0, std: float = 0.02):
        self.cfg, self.seed, self.std = cfg, seed, std
        _, abstract = abstract_model(cfg, np.float32)
        self.shapes = {}
        map_params(lambda path, x: self.shapes.__setitem__(path, x.shape), abstract)
        self.bytes_read = 0

    def _one(self, path: ParamPath, layer: int, shape) -> np.ndarray:
        key = zlib.crc32(".".join(path).encode())
        rng = np.random.default_rng([self.seed, key, layer + 1])  # non-layer tensors: -1
        if path[-1] == "scale":  # norms: around one, so activations keep their size
            return (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
        if "bias" in path[-1]:
            return np.zeros(shape, np.float32)
        return (self.std * rng.standard_normal(shape, np.float32)).astype(np.float32)

    def read(self, path: ParamPath, dtype, layers: Sequence[int] | None = None) -> np.ndarray:
        shape = self.shapes[path]
        if path[0] != "layers":
            return self._one(path, -1, shape).astype(dtype)
        ids = range(self.cfg.L) if layers is None else layers
        out = np.empty((len(ids), *shape[1:]), dtype)
        for n, i in enumerate(ids):
            out[n] = self._one(path, i, shape[1:])
        return out
