"""Hugging Face safetensors checkpoints: strict checks against the name table, lazy reads.

`HFCheckpoint` opens a checkpoint folder (a single `model.safetensors` or shards listed
in `model.safetensors.index.json`), checks every tensor name and shape against the
config before anything is read, and then reads parameters on demand through
`safe_open` slices: a stacked layer parameter is read only for the layers asked for,
so each stage (and later each host) reads only what it keeps.

Parameters are named by their path in the model's NNX state, e.g.
`("layers", "q_nhd")`; layer parameters come back stacked `[len(layers), ...]`. The
checkpoint's names and shapes for each are the name table's (`checkpoint.hf_names`).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from qwen3_spmd.model import fp8
from qwen3_spmd.model.checkpoint.hf_names import (
    FUSED_MARK,
    LAYER_PREFIX,
    Entry,
    LoadError,
    name_table,
)
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.layers import Qwen3
from qwen3_spmd.model.params import ParamPath, Part, abstract_model, map_params

# safetensors dtype names of the weights a Qwen3 checkpoint may hold (an FP8 one's
# linear weights: FP8_DTYPE, float8_e4m3fn).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
FP8_DTYPE = "F8_E4M3"


@contextlib.contextmanager
def _opened(file: Path):
    """safe_open(file), with a damaged file (truncated, not safetensors, a tensor missing
    where the index puts it) a LoadError naming it."""
    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise LoadError(
            f"{file} is not a readable safetensors file, or lacks a tensor its "
            f"index puts there ({e}): re-download it"
        ) from None


def _header(file: Path) -> tuple[int, dict]:
    """(offset of the data, JSON header) of a safetensors file: the format is an 8-byte
    little-endian header length, the header, then the tensors' bytes."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def _read_fp8(file: Path, name: str, index) -> np.ndarray:
    """tensor[index] of an F8_E4M3 tensor, which safetensors' numpy reader cannot make
    (numpy has no float8): the file mapped, viewed as ml_dtypes' float8_e4m3fn, and only
    the indexed bytes copied out."""
    start, header = _header(file)
    meta = header[name]
    lo, hi = meta["data_offsets"]
    raw = np.memmap(file, np.uint8, "r", offset=start + lo, shape=(hi - lo,))
    x = raw.view(fp8.FP8).reshape(meta["shape"])
    return np.array(x[... if index is None else index])


def tensor_files(folder: Path) -> dict[str, Path]:
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
            "pass a Hugging Face checkpoint folder with safetensors weights"
        )
    with _opened(single) as f:
        return {name: single for name in f.keys()}


DECODER_PREFIX = "model."


def bare_decoder(names) -> bool:
    """Whether a checkpoint's tensor names are the bare decoder's (`Qwen3Model` saved on
    its own, as Qwen3-Embedding is published: `embed_tokens.weight`, `layers.{i}...`,
    `norm.weight`, no `model.` prefix and no lm_head)."""
    return "embed_tokens.weight" in names and not any(n.startswith(DECODER_PREFIX) for n in names)


class HFCheckpoint:
    """A checked, lazily read Hugging Face Qwen3 checkpoint.

    `bytes_read` counts the bytes read from the safetensors files so far (a test and
    the multi-host loader use it to show each host reads only its own shards).
    """

    def __init__(self, folder: str | Path, cfg: Qwen3Config):
        self.folder = Path(folder)
        self.cfg = cfg
        files = tensor_files(self.folder)
        # Our name table's names (the causal LM's) -> the file's own names.
        prefix = DECODER_PREFIX if bare_decoder(files) else ""
        self.stored = {prefix + name: name for name in files}
        self.files = {prefix + name: file for name, file in files.items()}
        self.fused = any(name.endswith(FUSED_MARK) for name in self.files)
        self.table = {e.path: e for e in name_table(cfg, self.fused)}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._check()

    def _expected(self) -> dict[str, tuple[tuple[int, ...], Entry]]:
        out = {}
        for e in self.table.values():
            layers = [i for i in range(self.cfg.L) if e.holds(self.cfg, i)] if e.stacked else [None]
            for name in (n for i in layers for n in e.names(self.cfg, i)):
                out[name] = (e.hf_shape(self.cfg), e)
        return out

    def _check_experts(self) -> None:
        """Per-expert tensors of an expert the config does not have, or too few experts:
        one line that names the count (the generic checks would name one tensor)."""
        if not self.cfg.has_sparse or self.fused:
            return
        for i in (i for i in range(self.cfg.L) if self.cfg.is_sparse(i)):
            prefix = LAYER_PREFIX.format(i=i) + "mlp.experts."
            found = {
                int(n[len(prefix) :].split(".")[0])
                for n in self.files
                if n.startswith(prefix) and n[len(prefix) :].split(".")[0].isdigit()
            }
            if found and max(found) + 1 != self.cfg.E:
                raise LoadError(
                    f"checkpoint {self.folder} has {max(found) + 1} experts in layer {i} "
                    f"({prefix}*), but config.json says num_experts={self.cfg.E}: the weights "
                    "and config.json do not belong together"
                )

    def _check(self) -> None:
        self._check_experts()
        expected = self._expected()
        present = set(self.files)
        missing = [n for n in expected if n not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            if missing[0].endswith("weight_scale_inv"):
                raise LoadError(
                    f"checkpoint {self.folder} lacks tensor {missing[0]}{more}, the FP8 "
                    "scales that config.json's quantization_config implies: re-export the "
                    "checkpoint (convert --quantize fp8) or re-download it"
                )
            raise LoadError(
                f"checkpoint {self.folder} lacks tensor {missing[0]}{more}, which config.json "
                "implies: the weights and config.json do not belong together"
            )
        # A tied checkpoint may still carry lm_head.weight (some exporters write it); the
        # config says to use the embedding, so it is ignored rather than refused.
        ignorable = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        unexpected = sorted(present - set(expected) - ignorable)
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            if unexpected[0].endswith("weight_scale_inv"):
                raise LoadError(
                    f"checkpoint {self.folder} has FP8 scales {unexpected[0]}{more}, but "
                    "config.json has no quantization_config: restore the checkpoint's own "
                    "config.json (quant_method fp8)"
                )
            raise LoadError(
                f"checkpoint {self.folder} has unexpected tensor {unexpected[0]}{more}: not a "
                "weight of the Qwen3 that config.json describes"
            )
        by_file: dict[Path, list[str]] = {}
        for name in expected:
            by_file.setdefault(self.files[name], []).append(name)
        for file, names in by_file.items():
            with _opened(file) as f:
                for name in names:
                    tensor = f.get_slice(self.stored[name])
                    shape, want = tuple(tensor.get_shape()), expected[name][0]
                    e = expected[name][1]
                    if (
                        shape != want
                        and e.stacked
                        and "experts" in e.hf
                        and len(shape) == 3
                        and shape[1:] == want[1:]
                    ):
                        raise LoadError(
                            f"tensor {name} in {file.name} holds {shape[0]} experts, but "
                            f"config.json says num_experts={self.cfg.E}: the weights and "
                            "config.json do not belong together"
                        )
                    if shape != want and e.weight is not None:
                        raise LoadError(
                            f"tensor {name} in {file.name} has shape {list(shape)}, but "
                            f"config.json's weight_block_size {list(self.cfg.fp8_block)} "
                            f"implies {list(want)}: the scales and quantization_config do "
                            "not match"
                        )
                    if shape != want:
                        raise LoadError(
                            f"tensor {name} in {file.name} has shape {list(shape)}, but config.json "
                            f"implies {list(want)}: the weights and config.json do not match"
                        )
                    quantized = self.cfg.fp8_block is not None and e.path[-1] in fp8.D_AXIS
                    if quantized and tensor.get_dtype() != FP8_DTYPE:
                        raise LoadError(
                            f"tensor {name} in {file.name} holds {tensor.get_dtype()}, but "
                            f"config.json's quantization_config says FP8 ({FP8_DTYPE}): "
                            "quantize it (convert --quantize fp8) or drop quantization_config"
                        )
                    if not quantized and tensor.get_dtype() not in FLOAT_DTYPES:
                        raise LoadError(
                            f"tensor {name} in {file.name} holds {tensor.get_dtype()}, not floating "
                            f"point ({', '.join(FLOAT_DTYPES)}): quantized or foreign weights are "
                            "not supported"
                        )

    def _read_tensor(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor `name`, or tensor[index]: only those bytes copied out of the file."""
        stored = self.stored[name]
        with _opened(self.files[name]) as f:
            tensor = f.get_slice(stored)
            if tensor.get_dtype() == FP8_DTYPE:
                x = _read_fp8(self.files[name], stored, index)
            else:
                x = tensor[... if index is None else index]
        with self._lock:
            self.bytes_read += x.nbytes
        return x

    def read(
        self,
        path: ParamPath,
        dtype,
        layers: Sequence[int] | None = None,
        part: Part | None = None,
    ) -> np.ndarray:
        """One parameter in our layout, cast to `dtype`.

        Args:
          path: NNX state path, e.g. ("layers", "q_nhd").
          layers: for a stacked layer parameter, which layers (default all) -> [len, ...].
          part: only these rows of one axis: only their bytes are copied out of the
            files (`bytes_read` counts them); none at all for an empty part (a host whose
            rows are all padding).
        """
        e = self.table.get(path)
        if e is None:
            raise KeyError(f"no checkpoint tensor for parameter {'.'.join(path)}")
        if e.weight is not None:
            return self._read_scales(e, dtype, layers, part)
        shape = list(e.our_shape(self.cfg))
        axis, rows = 0, None
        if part is not None:
            axis, rows = part.axis - e.stacked, (part.start, part.stop)
            shape[axis] = part.stop - part.start
        ids = range(self.cfg.L) if layers is None else layers
        nothing = rows is not None and rows[0] == rows[1]
        if not e.stacked:
            if nothing:
                return np.zeros(shape, dtype)
            x = self._read_tensor(e.hf, e.hf_index(self.cfg, axis, rows))
            return x.reshape(shape).astype(dtype)
        out = np.zeros((len(ids), *shape), dtype)
        for n, i in enumerate(ids):
            if nothing or not e.holds(self.cfg, i):
                continue  # an empty part, or the other MLP kind's parameter of a mixed config: zeros
            if not e.per_expert:
                index = e.hf_index(self.cfg, axis, rows)
                out[n] = self._read_tensor(e.names(self.cfg, i)[0], index).reshape(shape)
                continue
            names = e.names(self.cfg, i)
            if axis == 0 and rows is not None:  # whole experts: only these experts' tensors
                names, index = names[rows[0] : rows[1]], e.hf_index(self.cfg)
            else:
                index = e.hf_index(self.cfg, axis - 1, rows)
            for x, name in enumerate(names):
                out[n, x] = self._read_tensor(name, index).reshape(shape[1:])
        return out

    def _read_scales(
        self, e: Entry, dtype, layers: Sequence[int] | None, part: Part | None
    ) -> np.ndarray:
        """An FP8 weight's scales in our layout [len(layers), (E,) ...] (model.fp8), or
        `part`'s rows of them. Each scale tensor is read whole: it is 1/16384 of its
        weight's values (128 x 128 blocks), so a host reading a part of it costs nothing
        worth cutting, and cutting our expanded rows is exact at any row."""
        cfg = self.cfg
        blocks = fp8.FP8Blocks(*cfg.fp8_block)
        weight = e.weight.hf_shape(cfg)
        one = e.our_shape(cfg)[1:] if e.per_expert else e.our_shape(cfg)

        def ours(tensor: str) -> np.ndarray:
            x = fp8.expand_scales(self._read_tensor(tensor), weight, e.weight.path[-1], blocks)
            return x.reshape(one)

        ids = range(cfg.L) if layers is None else layers
        out = []
        for i in ids:
            if not e.holds(cfg, i):
                out.append(np.zeros(e.our_shape(cfg), dtype))
                continue
            names = e.names(cfg, i)
            x = np.stack([ours(n) for n in names]) if e.per_expert else ours(names[0])
            out.append(x.astype(dtype))
        x = np.stack(out)
        return x if part is None else part.of(x)


def load_model(folder: str | Path, cfg: Qwen3Config, dtype) -> Qwen3:
    """The whole model on the default device (single-device use and tests)."""
    ckpt = HFCheckpoint(folder, cfg)
    graphdef, abstract = abstract_model(cfg, dtype)
    state = map_params(lambda path, x: jnp.asarray(ckpt.read(path, x.dtype)), abstract)
    return nnx.merge(graphdef, state)
