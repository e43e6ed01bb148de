"""Writing FP8 checkpoints: a float32/bfloat16 Hugging Face folder -> the same model in
Qwen3's published FP8 format (model.fp8), so users can make their own and tests have
fixtures.

    quantize_fp8(src, dst)   # dst: config.json with quantization_config, safetensors

Every linear weight of attention, the dense MLP and the experts becomes float8_e4m3fn
beside its `weight_scale_inv` (transformers' `Fp8Quantize` rule: a block's scale_inv is
absmax / 448); the embedding, norms, lm_head and the router are copied as they are.
Files beside the weights (tokenizer, generation_config.json) are copied. The weights go
out in shards as transformers writes them (`checkpoint.shards`), a shard at a time: the
host holds one shard and the tensor being read, not the model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from qwen3_spmd.model import fp8
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.checkpoint.shards import DEFAULT_MAX_BYTES, ShardWriter
from qwen3_spmd.model.config import Qwen3Config

BLOCK = (128, 128)  # weight_block_size of every published Qwen3 FP8 checkpoint


def quantization_config(block: tuple[int, int]) -> dict:
    """config.json's quantization_config of an FP8 checkpoint, as Qwen publishes it."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }


def quantize_fp8(
    src: str | Path,
    dst: str | Path,
    block: tuple[int, int] = BLOCK,
    max_shard_bytes: int = DEFAULT_MAX_BYTES,
) -> dict:
    """Writes `dst`, the FP8 form of checkpoint folder `src` (which must be unquantized),
    its weights in safetensors shards of at most `max_shard_bytes`.

    Returns {"quantized": linear weights quantized, "bytes": the weights' bytes written,
    "files": the weight files' names}.
    """
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    if "quantization_config" in raw:
        raise ValueError(
            f"{src} is already quantized (config.json has quantization_config): "
            "quantize an unquantized checkpoint"
        )
    cfg = Qwen3Config.from_hf(raw)
    ckpt = HFCheckpoint(src, cfg)  # checks every tensor first
    blocks = fp8.FP8Blocks(*block)
    quantized = 0
    dst.mkdir(parents=True)
    out = ShardWriter(dst, max_shard_bytes)
    for name, e in _tensor_names(ckpt, cfg):
        x = ckpt._read_tensor(name)
        if e.path[-1] not in fp8.D_AXIS:
            out.add(name, x)
            continue
        w8, scale_inv = fp8.quantize_blocks(x, blocks)
        out.add(name, w8)
        out.add(name + "_scale_inv", scale_inv)
        quantized += 1
    files = out.close()
    (dst / "config.json").write_text(
        json.dumps({**raw, "quantization_config": quantization_config(block)}, indent=2) + "\n"
    )
    _copy_side_files(src, dst)
    return {"quantized": quantized, "bytes": out.total_bytes, "files": files}


def _tensor_names(ckpt: HFCheckpoint, cfg: Qwen3Config):
    """(checkpoint tensor name, its table entry) of every weight the model reads, each
    once (a fused tensor that two entries read comes with the first); an FP8 weight's
    scales are not listed (the caller reads them with their weight)."""
    seen = set()
    for e in (e for e in ckpt.table.values() if e.weight is None):
        layers = [i for i in range(cfg.L) if e.holds(cfg, i)] if e.stacked else [None]
        for name in (n for i in layers for n in e.names(cfg, i)):
            if name not in seen:
                seen.add(name)
                yield name, e


def _copy_side_files(src: Path, dst: Path) -> None:
    """The tokenizer, generation_config.json and the like: every file but the weights
    and config.json."""
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy2(f, dst / f.name)


def dequantize_fp8(src: str | Path, dst: str | Path) -> None:
    """Writes `dst`, the float32 checkpoint an FP8 folder `src` stands for (each weight
    times its block scales, in numpy): the reference FP8 runs are compared against."""
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    cfg = Qwen3Config.from_hf(raw)
    if cfg.fp8_block is None:
        raise ValueError(f"{src} is not an FP8 checkpoint (no quantization_config)")
    blocks = fp8.FP8Blocks(*cfg.fp8_block)
    ckpt = HFCheckpoint(src, cfg)
    dst.mkdir(parents=True)
    out = ShardWriter(dst)
    for name, e in _tensor_names(ckpt, cfg):
        x = ckpt._read_tensor(name)
        if e.path[-1] in fp8.D_AXIS:
            x = fp8.dequantize_blocks(x, ckpt._read_tensor(name + "_scale_inv"), blocks)
        out.add(name, x.astype(np.float32))
    out.close()
    plain = {k: v for k, v in raw.items() if k != "quantization_config"}
    (dst / "config.json").write_text(json.dumps({**plain, "dtype": "float32"}, indent=2) + "\n")
    _copy_side_files(src, dst)
