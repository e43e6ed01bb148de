"""The Qwen3 network in Flax NNX: embedding, one decoder layer stacked `[L, ...]`, final
norm and lm_head.

Dimension letters (used in every name and einsum string of the project):
    B batch, T query tokens, S key/cache slots, D model width, N query heads,
    K KV heads, G = N / K query heads per KV head, H head dim, F MLP width, V vocab,
    L layers, E experts, A experts chosen per token (model.moe).

The decoder layer does not know how attention is computed or where the KV cache
lives: it takes an `attend` function,

    attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H], state) -> (o [B, T, N, H], state)

and threads its opaque `state` (the cache) through. A dense position-masked
reference runs on one device; ring attention and sharded-KV decode attention run
under a mesh; the layer is the same Flax code in every case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.linear import Linear
from qwen3_spmd.model.moe import MoE
from qwen3_spmd.model.rope import apply_rope
from qwen3_spmd.model.split import TensorSplit, masked_vocab
from qwen3_spmd.ops.matmul import few_rows, turned_product

Attend = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def _param(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def dense(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [B, T, I] times w [O, I] (stored [out, in]) -> [B, T, O]; a decode step's few
    rows as w @ h^T on CPU (`ops.matmul`)."""
    B, T, I = h.shape
    if not few_rows(B * T):
        return jnp.einsum("BTI,OI->BTO", h, w)
    return turned_product("OI,RI->OR", w, h.reshape(B * T, I)).reshape(B, T, w.shape[0])


def _project(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [B, T, D] times w [heads, H, D] -> [B, T, heads, H], as one [heads*H, D] matrix
    (with the head axes apart, XLA transposes the weight on every call)."""
    heads, H, D = w.shape
    return dense(h, w.reshape(heads * H, D)).reshape(*h.shape[:2], heads, H)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm attention (per-head RMSNorm on q and k, RoPE, grouped-query heads) and a
    SwiGLU MLP (or Qwen3-MoE's experts, model.moe), each added to the residual stream.

    Layers are stacked, so each holds the parameters of every MLP kind its config has:
    a config that mixes dense and sparse layers gives every layer both (the unused kind
    zeros), and the caller says which one runs (`sparse`, per layer).

    Under a mesh with a `tensor` axis each device holds its share of the heads and the
    MLP's columns (`split`, model.split), and the two partial outputs are summed there."""

    def __init__(self, cfg: Qwen3Config, *, dtype, rngs: nnx.Rngs, split=TensorSplit()):
        D, N, H = cfg.D, cfg.N, cfg.H
        K, F = split.kv_heads(cfg), split.width(cfg)
        self.split = split
        self.input_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        # Projections are stored [out, in], as the checkpoint has them: a decode step
        # (one token against the weights) then reads each row contiguously, which is
        # what XLA's CPU matrix-vector product runs fastest on; prefill does not mind.
        self.linear = linear = Linear.of(cfg, dtype)
        linear.make(self, "q_nhd", rngs, (N, H, D))
        linear.make(self, "k_khd", rngs, (K, H, D))
        linear.make(self, "v_khd", rngs, (K, H, D))
        linear.make(self, "o_dnh", rngs, (D, N, H))
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((N, H), dtype))
            self.k_bias = nnx.Param(jnp.zeros((K, H), dtype))
            self.v_bias = nnx.Param(jnp.zeros((K, H), dtype))
            self.o_bias = nnx.Param(jnp.zeros((D,), dtype))
        self.attention_bias = cfg.attention_bias
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.post_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.dense_mlp, self.sparse_mlp = cfg.has_dense, cfg.has_sparse
        if self.dense_mlp:
            linear.make(self, "gate_fd", rngs, (F, D))
            linear.make(self, "up_fd", rngs, (F, D))
            linear.make(self, "down_df", rngs, (D, F))
        if self.sparse_mlp:
            self.moe = MoE(cfg, dtype=dtype, rngs=rngs, split=split)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        state: Any,
        attend: Attend,
        sparse: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """x [B, T, D], rope = (cos, sin) [B, T, H] -> (x [B, T, D], state).

        sparse: bool scalar (may be traced), whether this layer is a mixture of experts;
        needed only when the config mixes dense and sparse layers."""
        o, state = attend(*self.attention_inputs(x, rope), state)
        return self.finish(x, o, sparse), state

    def attention_inputs(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]):
        """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H]: normed, projected, rotated.

        The layer's work before attention; with `finish`, all of its work that needs no
        other device (so a pipeline bubble can skip both and still join the ring)."""
        h = self.input_norm(x)
        q, k, v = (_project(h, self.linear.read(self, w)) for w in ("q_nhd", "k_khd", "v_khd"))
        if self.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(k), *rope)
        return q, k, v

    def finish(self, x: jax.Array, o: jax.Array, sparse: jax.Array | None = None) -> jax.Array:
        """The residual x [B, T, D] and attention output o [B, T, N, H] -> the layer's
        output [B, T, D] (output projection, then the MLP; sparse as in __call__)."""
        # As one [D, N*H] matrix: with the head axes apart XLA transposes the weight.
        o_dnh = self.linear.read(self, "o_dnh")
        o_2d = o_dnh.reshape(o_dnh.shape[0], -1)
        attn = self.split.sum(dense(o.reshape(*o.shape[:2], -1), o_2d))
        if self.attention_bias:
            attn = attn + self.o_bias[...]
        x = x + attn
        return x + self.split.sum(self._mlp(self.post_norm(x), sparse))

    def _mlp(self, h: jax.Array, sparse: jax.Array | None) -> jax.Array:
        """The MLP's output [B, T, D] (this device's part of it, under a tensor split)."""
        if not self.sparse_mlp:
            return self._dense(h)
        if not self.dense_mlp:
            return self.moe(h)
        if sparse is None:
            raise ValueError("this config mixes dense and sparse layers: pass `sparse`")
        return jax.lax.cond(sparse, lambda h: self.moe(h), self._dense, h)

    def _dense(self, h: jax.Array) -> jax.Array:
        w = functools.partial(self.linear.read, self)
        gate, up = dense(h, w("gate_fd")), dense(h, w("up_fd"))
        return dense(jax.nn.silu(gate) * up, w("down_df"))


class Qwen3(nnx.Module):
    """Embedding, L decoder layers stored stacked on a leading axis, final norm, lm_head
    (the embedding's transpose when the config ties them).

    `split` (model.split) cuts every layer, the embedding and lm_head over a mesh's
    `tensor` axis; the default, one device, is the checkpoint's layout."""

    def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs, split=TensorSplit()):
        V = split.vocab(cfg)
        self.split, self.vocab_size = split, cfg.V
        self.embed_vd = _param(rngs, (V, cfg.D), dtype)

        @nnx.split_rngs(splits=cfg.L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype=dtype, rngs=rngs, split=split)

        self.layers = stacked(rngs)
        self.norm = RMSNorm(cfg.D, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head_vd = None if cfg.tie_word_embeddings else _param(rngs, (V, cfg.D), dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int32 -> x [B, T, D]. Under a tensor split each device looks up
        the tokens of its own vocabulary rows (zeros for the others) and the sum over
        `tensor` gives every device the whole lookup (exact: one term is not zero)."""
        table = self.embed_vd[...]
        if self.split.size == 1:
            return jnp.take(table, tokens, axis=0)
        rows = table.shape[0]
        local = tokens - self.split.first(rows)
        mine = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
        return self.split.sum(jnp.where(mine[..., None], x, jnp.zeros_like(x)))

    def logits(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> logits [B, T, V] float32 (final norm, then lm_head); under a
        tensor split, this device's V'/X vocabulary rows, padding ids at -inf."""
        h = self.norm(x)
        head = self.embed_vd if self.lm_head_vd is None else self.lm_head_vd
        return masked_vocab(dense(h, head[...]).astype(jnp.float32), self.split, self.vocab_size)
