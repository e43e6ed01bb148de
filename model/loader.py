"""Hugging Face safetensors checkpoints: one explicit name table, strict checks, lazy reads.

`HFCheckpoint` opens a checkpoint folder (a single `model.safetensors` or shards listed
in `model.safetensors.index.json`), checks every tensor name and shape against the
config before anything is read, and then reads parameters on demand through
`safe_open` slices: a stacked layer parameter is read only for the layers asked for,
so each stage (and later each host) reads only what it keeps.

Parameters are named by their path in the model's NNX state, e.g.
`("layers", "q_dnh")`; layer parameters come back stacked `[len(layers), ...]`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from model.config import Qwen3Config
from model.layers import Qwen3

ParamPath = tuple[str, ...]


class LoadError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the name table.

    path: the parameter's path in the NNX state.
    hf: the Hugging Face tensor name ({i} = layer index for stacked layer parameters).
    hf_shape: config -> the shape the checkpoint must have.
    to_ours: transforms one checkpoint tensor into our layout (transpose/reshape).
    """

    path: ParamPath
    hf: str
    hf_shape: Callable[[Qwen3Config], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, Qwen3Config], np.ndarray]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf


def _same(x, c):
    return x


def _t(x, c):
    return x.T


def _proj_in(heads: Callable[[Qwen3Config], int]):
    """[heads*H, D] (torch Linear) -> [D, heads, H]."""
    return lambda x, c: x.T.reshape(c.D, heads(c), c.H)


def _heads_bias(heads: Callable[[Qwen3Config], int]):
    return lambda x, c: x.reshape(heads(c), c.H)


_P = "model.layers.{i}."
_LAYER = [
    Entry(("layers", "input_norm", "scale"), _P + "input_layernorm.weight", lambda c: (c.D,), _same),
    Entry(("layers", "q_dnh"), _P + "self_attn.q_proj.weight", lambda c: (c.N * c.H, c.D),
          _proj_in(lambda c: c.N)),
    Entry(("layers", "k_dkh"), _P + "self_attn.k_proj.weight", lambda c: (c.K * c.H, c.D),
          _proj_in(lambda c: c.K)),
    Entry(("layers", "v_dkh"), _P + "self_attn.v_proj.weight", lambda c: (c.K * c.H, c.D),
          _proj_in(lambda c: c.K)),
    Entry(("layers", "o_nhd"), _P + "self_attn.o_proj.weight", lambda c: (c.D, c.N * c.H),
          lambda x, c: x.T.reshape(c.N, c.H, c.D)),
    Entry(("layers", "q_norm", "scale"), _P + "self_attn.q_norm.weight", lambda c: (c.H,), _same),
    Entry(("layers", "k_norm", "scale"), _P + "self_attn.k_norm.weight", lambda c: (c.H,), _same),
    Entry(("layers", "post_norm", "scale"), _P + "post_attention_layernorm.weight",
          lambda c: (c.D,), _same),
    Entry(("layers", "gate_df"), _P + "mlp.gate_proj.weight", lambda c: (c.F, c.D), _t),
    Entry(("layers", "up_df"), _P + "mlp.up_proj.weight", lambda c: (c.F, c.D), _t),
    Entry(("layers", "down_fd"), _P + "mlp.down_proj.weight", lambda c: (c.D, c.F), _t),
]
_BIAS = [
    Entry(("layers", "q_bias"), _P + "self_attn.q_proj.bias", lambda c: (c.N * c.H,),
          _heads_bias(lambda c: c.N)),
    Entry(("layers", "k_bias"), _P + "self_attn.k_proj.bias", lambda c: (c.K * c.H,),
          _heads_bias(lambda c: c.K)),
    Entry(("layers", "v_bias"), _P + "self_attn.v_proj.bias", lambda c: (c.K * c.H,),
          _heads_bias(lambda c: c.K)),
    Entry(("layers", "o_bias"), _P + "self_attn.o_proj.bias", lambda c: (c.D,), _same),
]
_EMBED = Entry(("embed_vd",), "model.embed_tokens.weight", lambda c: (c.V, c.D), _same)
_NORM = Entry(("norm", "scale"), "model.norm.weight", lambda c: (c.D,), _same)
_HEAD = Entry(("lm_head_dv",), "lm_head.weight", lambda c: (c.V, c.D), _t)


def name_table(cfg: Qwen3Config) -> list[Entry]:
    """Every tensor a checkpoint of this config holds, in one place."""
    table = [_EMBED, *_LAYER, *(_BIAS if cfg.attention_bias else []), _NORM]
    if not cfg.tie_word_embeddings:
        table.append(_HEAD)
    return table


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoadError(f"{index} is not a safetensors index ({e}): re-download it") from e
        files = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise LoadError(f"{index} lists {file.name}, which is missing: re-download it")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise LoadError(
            f"no model.safetensors or model.safetensors.index.json in {folder}: "
            "pass a Hugging Face checkpoint folder with safetensors weights")
    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


class HFCheckpoint:
    """A checked, lazily read Hugging Face Qwen3 checkpoint.

    `bytes_read` counts the bytes read from the safetensors files so far (a test and
    the multi-host loader use it to show each host reads only its own shards).
    """

    def __init__(self, folder: str | Path, cfg: Qwen3Config):
        self.folder = Path(folder)
        self.cfg = cfg
        self.files = _tensor_files(self.folder)
        self.table = {e.path: e for e in name_table(cfg)}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._check()

    def _expected(self) -> dict[str, tuple[tuple[int, ...], Entry]]:
        out = {}
        for e in self.table.values():
            names = [e.hf.format(i=i) for i in range(self.cfg.L)] if e.stacked else [e.hf]
            for name in names:
                out[name] = (e.hf_shape(self.cfg), e)
        return out

    def _check(self) -> None:
        expected = self._expected()
        present = set(self.files)
        missing = [n for n in expected if n not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise LoadError(
                f"checkpoint {self.folder} lacks tensor {missing[0]}{more}, which config.json "
                "implies: the weights and config.json do not belong together")
        # A tied checkpoint may still carry lm_head.weight (some exporters write it); the
        # config says to use the embedding, so it is ignored rather than refused.
        ignorable = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        unexpected = sorted(present - set(expected) - ignorable)
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise LoadError(
                f"checkpoint {self.folder} has unexpected tensor {unexpected[0]}{more}: not a "
                "weight of the Qwen3 that config.json describes")
        by_file: dict[Path, list[str]] = {}
        for name in expected:
            by_file.setdefault(self.files[name], []).append(name)
        for file, names in by_file.items():
            with safe_open(file, framework="numpy") as f:
                for name in names:
                    shape = tuple(f.get_slice(name).get_shape())
                    want = expected[name][0]
                    if shape != want:
                        raise LoadError(
                            f"tensor {name} in {file.name} has shape {list(shape)}, but config.json "
                            f"implies {list(want)}: the weights and config.json do not match")

    def _read_tensor(self, name: str) -> np.ndarray:
        with safe_open(self.files[name], framework="numpy") as f:
            x = f.get_slice(name)[...]
        with self._lock:
            self.bytes_read += x.nbytes
        return x

    def read(self, path: ParamPath, dtype, layers: Sequence[int] | None = None) -> np.ndarray:
        """One parameter in our layout, cast to `dtype`.

        Args:
          path: NNX state path, e.g. ("layers", "q_dnh").
          layers: for a stacked layer parameter, which layers (default all) -> [len, ...].
        """
        e = self.table.get(path)
        if e is None:
            raise KeyError(f"no checkpoint tensor for parameter {'.'.join(path)}")
        if not e.stacked:
            return e.to_ours(self._read_tensor(e.hf), self.cfg).astype(dtype)
        ids = range(self.cfg.L) if layers is None else layers
        parts = [e.to_ours(self._read_tensor(e.hf.format(i=i)), self.cfg).astype(dtype) for i in ids]
        if not parts:
            shape = e.to_ours(np.zeros(e.hf_shape(self.cfg), np.float32), self.cfg).shape
            return np.zeros((0, *shape), dtype)
        return np.stack(parts)


def map_params(fn: Callable[[ParamPath, jax.ShapeDtypeStruct], jax.Array], state: nnx.State):
    """Builds a state whose leaves are fn(path, abstract leaf), e.g. read from a checkpoint."""

    def leaf(keypath, x):
        path = tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))
        return fn(path, x)

    return jax.tree_util.tree_map_with_path(leaf, state)


def abstract_model(cfg: Qwen3Config, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs) of the model, without allocating it."""
    return nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0))))


def load_model(folder: str | Path, cfg: Qwen3Config, dtype) -> Qwen3:
    """The whole model on the default device (single-device use and tests)."""
    ckpt = HFCheckpoint(folder, cfg)
    graphdef, abstract = abstract_model(cfg, dtype)
    state = map_params(lambda path, x: jnp.asarray(ckpt.read(path, x.dtype)), abstract)
    return nnx.merge(graphdef, state)
