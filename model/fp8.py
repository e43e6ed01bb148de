"""Block-wise FP8 weights: Qwen3's published FP8 checkpoints (DeepSeek-V3's format).

The format, as transformers (`integrations/finegrained_fp8.py`: `Fp8Quantize`,
`Fp8Dequantize`) and vLLM (`quantization/fp8.py`, block quantization) read it:
config.json carries `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [b0, b1]}` (128 x 128 in every
published one), and each linear weight `W [O, I]` of attention and the MLP (the experts
too) is stored float8_e4m3fn beside `...weight_scale_inv [ceil(O/b0), ceil(I/b1)]`:

    W[o, i] = W8[o, i] * scale_inv[o // b0, i // b1]      (in float32)

Embeddings, norms, lm_head and the MoE router stay unquantized.

How this engine holds it on a device: the weight stays float8 in our layout (one byte a
value) and its scales are float32 *expanded to one per row along every axis but D* (the
model width, the one axis of each quantized weight that `tensor` never splits), and
blocked along D:

    q_nhd [N, H, D] -> q_nhd_scale [N, H, ceil(D/b1)]     (D is q_proj's input)
    o_dnh [D, N, H] -> o_dnh_scale [ceil(D/b0), N, H]     (D is o_proj's output)

So a scale splits over `tensor` exactly as its weight does (same axis, same rows: heads,
columns, experts, KV heads repeated, padding rows zero), whatever rows a device's share
starts or ends on: a shard that cuts a 128-block carries that block's scale for its own
rows, and no offset arithmetic is needed on the device. The cost is one float32 per 128
weights along D: 1/32 byte a weight, so 1.03 bytes a weight against bfloat16's 2
(0.516 of it).

The product dequantizes in its operand (`dequantize`, inside the jitted program):
float8 -> float32, times the scales repeated over their D-blocks, then the activations'
dtype. In float32 that is exactly the numpy dequantization (`dequantize_blocks`): a
float8 value is exact in float32 and the one product rounds the same.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
SCALE_SUFFIX = "_scale"

# Our quantized weights (the NNX name, one layer's or one expert's layout) -> the axis
# that is D, and whether D is the checkpoint's output ("out": axis 0 of [O, I], block
# b0) or input ("in": axis 1, block b1).
D_AXIS: dict[str, tuple[int, str]] = {
    "q_nhd": (2, "in"),
    "k_khd": (2, "in"),
    "v_khd": (2, "in"),
    "o_dnh": (0, "out"),
    "gate_fd": (1, "in"),
    "up_fd": (1, "in"),
    "down_df": (0, "out"),
    "gate_efd": (2, "in"),  # [E, F, D]: one expert's [F, D] behind the E axis
    "up_efd": (2, "in"),
    "down_edf": (1, "out"),
}


@dataclasses.dataclass(frozen=True)
class FP8Blocks:
    """An FP8 checkpoint's block size: b0 rows (the checkpoint's output axis) by b1
    columns (its input axis)."""

    rows: int = 128
    cols: int = 128

    def along_d(self, name: str) -> int:
        """The block size along weight `name`'s D axis."""
        return self.rows if D_AXIS[name][1] == "out" else self.cols


def weight_name(name: str) -> str:
    """The weight a parameter name belongs to: `q_nhd_scale` -> `q_nhd`."""
    return name.removesuffix(SCALE_SUFFIX)


def scale_shape(name: str, shape: tuple[int, ...], blocks: FP8Blocks) -> tuple[int, ...]:
    """The shape of weight `name`'s scales, from the weight's (one layer's, experts
    leading): D cut to ceil(D / block), every other axis whole."""
    axis = D_AXIS[name][0] + len(shape) - _rank(name)
    out = list(shape)
    out[axis] = -(-shape[axis] // blocks.along_d(name))
    return tuple(out)


def _rank(name: str) -> int:
    return (
        3 if name in ("q_nhd", "k_khd", "v_khd", "o_dnh", "gate_efd", "up_efd", "down_edf") else 2
    )


# ---- checkpoint side (numpy) ---------------------------------------------------------


def quantize_blocks(w: np.ndarray, blocks: FP8Blocks) -> tuple[np.ndarray, np.ndarray]:
    """w [..., O, I] float -> (w8 [..., O, I] float8_e4m3fn, scale_inv [..., ceil(O/b0),
    ceil(I/b1)] float32), transformers' `Fp8Quantize` rule: a block's scale is
    448 / absmax (1 for an all-zero block), w8 = clip(w * scale), scale_inv = 1 / scale.
    Edge blocks of an O or I that the block does not divide hold the rows they have."""
    w = np.asarray(w, np.float32)
    *lead, O, I = w.shape
    b0, b1 = blocks.rows, blocks.cols
    Ob, Ib = -(-O // b0), -(-I // b1)
    padded = np.zeros((*lead, Ob * b0, Ib * b1), np.float32)
    padded[..., :O, :I] = w
    tiles = padded.reshape(*lead, Ob, b0, Ib, b1)
    absmax = np.abs(tiles).max(axis=(-3, -1))  # [..., Ob, Ib]
    scale = np.where(absmax > 0, np.float32(FP8_MAX) / np.where(absmax > 0, absmax, 1), 1)
    scale = scale.astype(np.float32)
    scaled = tiles * scale[..., :, None, :, None]
    w8 = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8).reshape(*lead, Ob * b0, Ib * b1)
    return w8[..., :O, :I], (np.float32(1) / scale).astype(np.float32)


def dequantize_blocks(w8: np.ndarray, scale_inv: np.ndarray, blocks: FP8Blocks) -> np.ndarray:
    """The float32 weight [..., O, I] an FP8 checkpoint tensor stands for (the reference
    the tests compare against)."""
    O, I = w8.shape[-2:]
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), blocks.rows, -2), blocks.cols, -1)
    return w8.astype(np.float32) * s[..., :O, :I]


def expand_scales(scale_inv: np.ndarray, hf_shape: tuple[int, int], name: str, blocks: FP8Blocks):
    """A checkpoint's scale_inv [ceil(O/b0), ceil(I/b1)] -> one per row of the side that
    is not D, as [O, ceil(I/b1)] (D the input) or [ceil(O/b0), I] (D the output), float32;
    the caller reshapes it to our layout as it does the weight."""
    O, I = hf_shape
    s = np.asarray(scale_inv, np.float32)
    if D_AXIS[name][1] == "in":
        return np.repeat(s, blocks.rows, axis=0)[:O]
    return np.repeat(s, blocks.cols, axis=1)[:, :I]


# ---- device side ---------------------------------------------------------------------


def dequantize(w: jax.Array, scale: jax.Array, name: str, blocks: FP8Blocks, dtype) -> jax.Array:
    """Weight `name` for the product: w float8 (one layer's, or experts [E, ...]) times
    its scales repeated over their D-blocks, computed in float32, returned in `dtype`
    (the activations'). Inside a jitted program, so XLA can fold it into the dot."""
    axis = D_AXIS[name][0] + w.ndim - _rank(name)
    full = jnp.repeat(scale, blocks.along_d(name), axis=axis)
    full = jax.lax.slice_in_dim(full, 0, w.shape[axis], axis=axis)
    return (w.astype(jnp.float32) * full).astype(dtype)
