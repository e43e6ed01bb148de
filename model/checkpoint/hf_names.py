"""Hugging Face's tensor names for Qwen3: the one name table.

Each `Entry` ties a parameter's path in the model's NNX state (`("layers", "q_nhd")`)
to its checkpoint name (`model.layers.{i}.self_attn.q_proj.weight`), the shape the
checkpoint must hold and ours (a reshape of it), and which layers hold it. `name_table`
lists every tensor a checkpoint of a config holds: the reader (`checkpoint.hf`), the
converter and the transformers peer all go by it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from qwen3_spmd.model import fp8
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import ParamPath


class LoadError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor (the
    table's refusals and the reader's, `checkpoint.hf`)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the name table.

    path: the parameter's path in the NNX state.
    hf: the Hugging Face tensor name ({i} = layer index for stacked layer parameters).
    hf_shape: config -> the shape the checkpoint must have.
    our_shape: config -> our shape of one tensor (a reshape of the checkpoint's: we keep
      torch's [out, in] order and only split the head axes).
    kind: which layers hold the tensor: "all", "dense" (a dense MLP) or "sparse"
      (Qwen3-MoE's router and experts); in the other layers our parameter is zeros.
    part: (k, n): ours is the k-th of n equal pieces of the checkpoint's axis 1 (the
      fused gate_up_proj holds gate, then up).

    An hf name with {e} is one tensor per expert; ours stacks them on a leading E axis.
    """

    path: ParamPath
    hf: str
    hf_shape: Callable[[Qwen3Config], tuple[int, ...]]
    our_shape: Callable[[Qwen3Config], tuple[int, ...]]
    kind: str = "all"
    part: tuple[int, int] | None = None
    weight: Entry | None = None  # an FP8 weight's scales: the weight's entry (model.fp8)

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf

    def holds(self, cfg: Qwen3Config, layer: int) -> bool:
        """Whether layer `layer`'s checkpoint tensors include this entry's."""
        return self.kind == "all" or (self.kind == "sparse") == cfg.is_sparse(layer)

    def names(self, cfg: Qwen3Config, layer: int | None = None) -> list[str]:
        """The checkpoint tensor names of this entry (of one layer, for a stacked one)."""
        experts = range(cfg.E) if self.per_expert else [None]
        return [self.hf.format(i=layer, e=e) for e in experts]

    def to_ours(self, x: np.ndarray, cfg: Qwen3Config) -> np.ndarray:
        return x.reshape(self.our_shape(cfg))

    def hf_index(
        self, cfg: Qwen3Config, axis: int = 0, rows: tuple[int, int] | None = None
    ) -> tuple[slice, ...]:
        """The index into one checkpoint tensor (one expert's, for a per-expert entry)
        that reads ours, or only rows rows[0]..rows[1] of our `axis` (an axis of one
        layer's, one expert's tensor). Our head axes lead the checkpoint axis they are
        merged into (q_proj's rows are head-major), so a run of heads is a run of rows."""
        hf, ours = list(self.hf_shape(cfg)), list(self.our_shape(cfg))
        if self.per_expert:
            ours = ours[1:]
        index = [slice(None)] * len(hf)
        if self.part is not None:
            k, n = self.part
            hf[1] //= n
            index[1] = slice(k * hf[1], (k + 1) * hf[1])
        if rows is not None:
            # The last checkpoint axis with our axis's outer size before it (a leading
            # size-1 axis, one expert, matches at two places: the later is ours).
            before = math.prod(ours[:axis])
            j = max(j for j in range(len(hf)) if math.prod(hf[:j]) == before)
            per_row = hf[j] // ours[axis]
            base = index[j].start or 0
            index[j] = slice(base + rows[0] * per_row, base + rows[1] * per_row)
        return tuple(index)

    def to_hf(self, x: np.ndarray, cfg: Qwen3Config) -> np.ndarray:
        return x.reshape(self.hf_shape(cfg))

    def hf_tensors(
        self, x: np.ndarray, cfg: Qwen3Config, layer: int | None = None
    ) -> dict[str, np.ndarray]:
        """Our tensor (one layer's, for a stacked entry) -> {checkpoint name: tensor} in
        the hub's layout (the inverse of reading; fused entries are read-only)."""
        if self.part is not None:
            raise ValueError(f"{self.hf} is a fused layout, which is only read")
        if self.stacked and not self.holds(cfg, layer):
            return {}
        if self.per_expert:
            return {name: self.to_hf(x[e], cfg) for e, name in enumerate(self.names(cfg, layer))}
        return {self.names(cfg, layer)[0]: self.to_hf(x, cfg)}


def _vec(n: Callable[[Qwen3Config], int]):
    return lambda c: (n(c),)


LAYER_PREFIX = "model.layers.{i}."  # a layer's tensors' names begin so
_P = LAYER_PREFIX
_LAYER = [
    Entry(
        ("layers", "input_norm", "scale"),
        _P + "input_layernorm.weight",
        _vec(lambda c: c.D),
        _vec(lambda c: c.D),
    ),
    Entry(
        ("layers", "q_nhd"),
        _P + "self_attn.q_proj.weight",
        lambda c: (c.N * c.H, c.D),
        lambda c: (c.N, c.H, c.D),
    ),
    Entry(
        ("layers", "k_khd"),
        _P + "self_attn.k_proj.weight",
        lambda c: (c.K * c.H, c.D),
        lambda c: (c.K, c.H, c.D),
    ),
    Entry(
        ("layers", "v_khd"),
        _P + "self_attn.v_proj.weight",
        lambda c: (c.K * c.H, c.D),
        lambda c: (c.K, c.H, c.D),
    ),
    Entry(
        ("layers", "o_dnh"),
        _P + "self_attn.o_proj.weight",
        lambda c: (c.D, c.N * c.H),
        lambda c: (c.D, c.N, c.H),
    ),
    Entry(
        ("layers", "q_norm", "scale"),
        _P + "self_attn.q_norm.weight",
        _vec(lambda c: c.H),
        _vec(lambda c: c.H),
    ),
    Entry(
        ("layers", "k_norm", "scale"),
        _P + "self_attn.k_norm.weight",
        _vec(lambda c: c.H),
        _vec(lambda c: c.H),
    ),
    Entry(
        ("layers", "post_norm", "scale"),
        _P + "post_attention_layernorm.weight",
        _vec(lambda c: c.D),
        _vec(lambda c: c.D),
    ),
]
_DENSE = [
    Entry(
        ("layers", "gate_fd"),
        _P + "mlp.gate_proj.weight",
        lambda c: (c.F, c.D),
        lambda c: (c.F, c.D),
        kind="dense",
    ),
    Entry(
        ("layers", "up_fd"),
        _P + "mlp.up_proj.weight",
        lambda c: (c.F, c.D),
        lambda c: (c.F, c.D),
        kind="dense",
    ),
    Entry(
        ("layers", "down_df"),
        _P + "mlp.down_proj.weight",
        lambda c: (c.D, c.F),
        lambda c: (c.D, c.F),
        kind="dense",
    ),
]


def _experts(c: Qwen3Config, *shape: int) -> tuple[int, ...]:
    return (c.E, *shape)


_ROUTER = Entry(
    ("layers", "moe", "router_ed"),
    _P + "mlp.gate.weight",
    lambda c: (c.E, c.D),
    lambda c: (c.E, c.D),
    kind="sparse",
)
# The hub's layout: one tensor per expert and projection.
_EXPERTS = [
    Entry(
        ("layers", "moe", "gate_efd"),
        _P + "mlp.experts.{e}.gate_proj.weight",
        lambda c: (c.moe_intermediate_size, c.D),
        lambda c: _experts(c, c.moe_intermediate_size, c.D),
        kind="sparse",
    ),
    Entry(
        ("layers", "moe", "up_efd"),
        _P + "mlp.experts.{e}.up_proj.weight",
        lambda c: (c.moe_intermediate_size, c.D),
        lambda c: _experts(c, c.moe_intermediate_size, c.D),
        kind="sparse",
    ),
    Entry(
        ("layers", "moe", "down_edf"),
        _P + "mlp.experts.{e}.down_proj.weight",
        lambda c: (c.D, c.moe_intermediate_size),
        lambda c: _experts(c, c.D, c.moe_intermediate_size),
        kind="sparse",
    ),
]
# transformers 5.x's in-memory layout (Qwen3MoeExperts): gate_up_proj [E, 2F, D] (gate
# rows first), down_proj [E, D, F].
_FUSED = [
    Entry(
        ("layers", "moe", "gate_efd"),
        _P + "mlp.experts.gate_up_proj",
        lambda c: _experts(c, 2 * c.moe_intermediate_size, c.D),
        lambda c: _experts(c, c.moe_intermediate_size, c.D),
        kind="sparse",
        part=(0, 2),
    ),
    Entry(
        ("layers", "moe", "up_efd"),
        _P + "mlp.experts.gate_up_proj",
        lambda c: _experts(c, 2 * c.moe_intermediate_size, c.D),
        lambda c: _experts(c, c.moe_intermediate_size, c.D),
        kind="sparse",
        part=(1, 2),
    ),
    Entry(
        ("layers", "moe", "down_edf"),
        _P + "mlp.experts.down_proj",
        lambda c: _experts(c, c.D, c.moe_intermediate_size),
        lambda c: _experts(c, c.D, c.moe_intermediate_size),
        kind="sparse",
    ),
]
FUSED_MARK = "mlp.experts.gate_up_proj"  # a checkpoint name ending so is the fused layout
_BIAS = [
    Entry(
        ("layers", "q_bias"),
        _P + "self_attn.q_proj.bias",
        _vec(lambda c: c.N * c.H),
        lambda c: (c.N, c.H),
    ),
    Entry(
        ("layers", "k_bias"),
        _P + "self_attn.k_proj.bias",
        _vec(lambda c: c.K * c.H),
        lambda c: (c.K, c.H),
    ),
    Entry(
        ("layers", "v_bias"),
        _P + "self_attn.v_proj.bias",
        _vec(lambda c: c.K * c.H),
        lambda c: (c.K, c.H),
    ),
    Entry(
        ("layers", "o_bias"), _P + "self_attn.o_proj.bias", _vec(lambda c: c.D), _vec(lambda c: c.D)
    ),
]
_EMBED = Entry(
    ("embed_vd",), "model.embed_tokens.weight", lambda c: (c.V, c.D), lambda c: (c.V, c.D)
)
_NORM = Entry(("norm", "scale"), "model.norm.weight", _vec(lambda c: c.D), _vec(lambda c: c.D))
_HEAD = Entry(("lm_head_vd",), "lm_head.weight", lambda c: (c.V, c.D), lambda c: (c.V, c.D))


def name_table(cfg: Qwen3Config, fused: bool = False) -> list[Entry]:
    """Every tensor a checkpoint of this config holds, in one place; fused: the experts
    as transformers 5.x holds them (else the hub's per-expert tensors). An FP8 config
    (`cfg.fp8_block`) adds each linear weight's `weight_scale_inv` (`_scales`)."""
    table = [_EMBED, *_LAYER, *(_BIAS if cfg.attention_bias else []), _NORM]
    if cfg.has_dense:
        table += _DENSE
    if cfg.has_sparse:
        table += [_ROUTER, *(_FUSED if fused else _EXPERTS)]
    if not cfg.tie_word_embeddings:
        table.append(_HEAD)
    if cfg.fp8_block is not None:
        table += [_scales(e, cfg) for e in table if e.path[-1] in fp8.D_AXIS]
    return table


def _scales(e: Entry, cfg: Qwen3Config) -> Entry:
    """The entry of FP8 weight e's `weight_scale_inv` [ceil(O/b0), ceil(I/b1)]: ours is
    one per row along every axis but D, blocked along D (model.fp8)."""
    if e.part is not None or not e.hf.endswith(".weight"):
        raise LoadError(
            f"FP8 checkpoints with fused experts ({e.hf}) are not supported: write the "
            "experts one tensor each (the hub's layout)"
        )
    blocks, name = fp8.FP8Blocks(*cfg.fp8_block), e.path[-1]

    def hf_shape(c: Qwen3Config) -> tuple[int, ...]:
        O, I = e.hf_shape(c)
        return -(-O // blocks.rows), -(-I // blocks.cols)

    return Entry(
        (*e.path[:-1], name + fp8.SCALE_SUFFIX),
        e.hf + "_scale_inv",
        hf_shape,
        lambda c: fp8.scale_shape(name, e.our_shape(c), blocks),
        kind=e.kind,
        weight=e,
    )
