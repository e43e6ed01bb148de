"""A module's linear weights, plain or FP8 (model.fp8): one place makes and reads them.

With an FP8 config (`cfg.fp8_block`) weight `name` is a float8 param beside its float32
scales `name_scale`, and reading it dequantizes in the product's operand; otherwise it
is a plain param in the model's dtype. The layers read either the same way, so there is
one decoder layer and one MoE, not a quantized copy of each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from qwen3_spmd.model import fp8
from qwen3_spmd.model.config import Qwen3Config


@dataclasses.dataclass(frozen=True)
class Linear:
    """How a module holds its linear weights: `blocks` None (plain, in `dtype`) or an
    FP8 checkpoint's block size. Hashable: it is static in the module's graphdef."""

    dtype: jnp.dtype
    blocks: fp8.FP8Blocks | None = None

    @classmethod
    def of(cls, cfg: Qwen3Config, dtype) -> Linear:
        blocks = None if cfg.fp8_block is None else fp8.FP8Blocks(*cfg.fp8_block)
        return cls(jnp.dtype(dtype), blocks)

    def make(self, module: nnx.Module, name: str, rngs: nnx.Rngs, shape, std: float = 0.02):
        """Sets module.name (and module.name_scale, FP8) to a random param of `shape`."""
        w = std * jax.random.normal(rngs.params(), shape, jnp.float32)
        if self.blocks is None:
            setattr(module, name, nnx.Param(w.astype(self.dtype)))
            return
        setattr(module, name, nnx.Param(w.astype(fp8.FP8)))
        scales = fp8.scale_shape(name, shape, self.blocks)
        setattr(module, name + fp8.SCALE_SUFFIX, nnx.Param(jnp.ones(scales, jnp.float32)))

    def read(self, module: nnx.Module, name: str) -> jax.Array:
        """module.name as the product takes it, in the activations' dtype."""
        return self.product(name, *self.stored(module, name))

    def stored(self, module: nnx.Module, name: str) -> tuple[jax.Array, jax.Array | None]:
        """(module.name as held, its FP8 scales or None): for a reader that takes part
        of it (some experts) before `product`."""
        w = getattr(module, name)[...]
        if self.blocks is None:
            return w, None
        return w, getattr(module, name + fp8.SCALE_SUFFIX)[...]

    def product(self, name: str, w: jax.Array, scale: jax.Array | None) -> jax.Array:
        """Weight `name` (all of it, or a part with the same part of its scales) as the
        product takes it: plain as it is, FP8 dequantized."""
        if scale is None:
            return w
        return fp8.dequantize(w, scale, name, self.blocks, self.dtype)
