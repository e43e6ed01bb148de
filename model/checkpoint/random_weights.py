"""Seeded random weights with the same reading interface as a checkpoint.

Used by the built-in demo and by benchmarks of a preset shape: each tensor (each
layer of a stacked one) comes from its own generator seeded by (seed, name, layer),
so any subset reads the same values wherever it is read, on any mesh or host.
"""

from __future__ import annotations

import concurrent.futures
import os
import zlib
from collections.abc import Sequence

import numpy as np

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import ParamPath, Part, abstract_model, map_params


class RandomWeights:
    """Reads like `HFCheckpoint`: read(path, dtype, layers) -> numpy array in our layout."""

    def __init__(self, cfg: Qwen3Config, seed: int = 0, std: float = 0.02):
        self.cfg, self.seed, self.std = cfg, seed, std
        _, abstract = abstract_model(cfg, np.float32)
        self.shapes = {}
        map_params(lambda path, x: self.shapes.__setitem__(path, x.shape), abstract)
        self.bytes_read = 0

    def _one(self, path: ParamPath, layer: int, out: np.ndarray) -> None:
        """Fills `out` (float32) in place: a 0.6B model's 2.4 GB take one pass each."""
        key = zlib.crc32(".".join(path).encode())
        rng = np.random.default_rng([self.seed, key, layer + 1])  # non-layer tensors: -1
        if "bias" in path[-1]:
            out[...] = 0
            return
        rng.standard_normal(out.shape, np.float32, out=out)
        if path[-1] == "scale":  # norms: around one, so activations keep their size
            out *= np.float32(0.1)
            out += np.float32(1.0)
        else:
            out *= np.float32(self.std)

    def read(
        self,
        path: ParamPath,
        dtype,
        layers: Sequence[int] | None = None,
        part: Part | None = None,
    ) -> np.ndarray:
        """Like `HFCheckpoint.read`; a part is cut from the whole tensor (its values come
        from one generator), so every host generates every row of what it reads."""
        if part is not None:
            return np.ascontiguousarray(part.of(self.read(path, dtype, layers)))
        shape = self.shapes[path]
        ids = [-1] if path[0] != "layers" else list(range(self.cfg.L) if layers is None else layers)
        out = np.empty((len(ids), *shape[path[0] == "layers" :]), np.float32)
        # The generators release the GIL: each core fills its own layers.
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(lambda n: self._one(path, ids[n], out[n]), range(len(ids))))
        out = out if path[0] == "layers" else out[0]
        return out if np.dtype(dtype) == np.float32 else out.astype(dtype)
