"""How the model is cut over the mesh's `tensor` axis: X devices share every layer
(Megatron's split), and Qwen3-MoE's experts.

- Attention: each device holds N/X query heads and K'/X KV heads (q, k, v split by
  heads; q_norm, k_norm and RoPE are per head), and the output projection's columns
  for its heads; one `psum` over `tensor` adds the partial outputs.
- MLP: gate and up split by columns (F'/X), down by rows; one `psum`.
- Embedding and lm_head by vocabulary rows (V'/X): the lookup takes a device's own
  rows (zeros elsewhere) and a `psum`; the logits stay split (pipeline.programs.sampling gathers
  what its rule needs).
- Experts: "tp" (the default without `data` replicas) splits every expert's columns as
  the dense MLP's, so every device does 1/X of each chosen expert's work; "ep" gives
  each device E/X whole experts (each device computes the routed pairs of its own
  experts, the rest weigh zero, which only the looped decode formulation skips). Either
  ends in the MLP's one `psum`. "a2a" (the default with D > 1 replicas) gives each of
  the D X devices of `data` x `tensor` E/(D X) whole experts: each tensor device
  takes 1/X of its replica's tokens, one `all_to_all` sends each token to the devices
  of the experts it chose, a second brings their weighted sum back, and the MLP's
  `psum` over `tensor` puts the replica's tokens together again (model.moe).

The placed model's sizes are the checkpoint's where they divide evenly and are padded
otherwise (`TensorSplit.cut` names the checkpoint rows a host reads for its devices'
placed rows, and `Cut.fit` makes those placed rows from them):
- K' = K when X divides K; when K divides X, each KV head repeated X/K times
  contiguously (device i holds head i // (X/K)), so a device's query heads all read
  the one KV head it holds;
- F' and the experts' width rounded up to a multiple of X with zero columns (a zero
  gate column gives silu(0) * 0 = 0, and a zero down row adds nothing);
- V' rounded up with zero rows, whose logits are masked to -inf (never sampled).
With X = 1 every size is the checkpoint's and nothing is summed: the single-device
reference is the same code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.fp8 import weight_name

EXPERT_SPLITS = ("ep", "tp", "a2a")

# The axis of each parameter that `tensor` splits (Megatron's split, above), counted in the array
# as stored: [V, D] outside the layers, [L, ...] inside them.
TENSOR_AXIS = {
    "embed_vd": 0,
    "lm_head_vd": 0,
    "q_nhd": 1,
    "k_khd": 1,
    "v_khd": 1,
    "q_bias": 1,
    "k_bias": 1,
    "v_bias": 1,
    "o_dnh": 2,
    "gate_fd": 1,
    "up_fd": 1,
    "down_df": 2,
}
# Qwen3-MoE's experts [L, E, F, D] and [L, E, D, F]: whole experts ("ep" over
# `tensor`, "a2a" over `data` x `tensor`), or every expert's columns ("tp").
EXPERT_AXIS = {
    "ep": {"gate_efd": 1, "up_efd": 1, "down_edf": 1},
    "tp": {"gate_efd": 2, "up_efd": 2, "down_edf": 3},
    "a2a": {"gate_efd": 1, "up_efd": 1, "down_edf": 1},
}


class TensorError(ValueError):
    """A model that cannot be split over the tensor size asked for: the message names
    the sizes and the tensor sizes that would fit."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """The `tensor` axis as the model sees it: its size X and its name in the mesh; and,
    for the "a2a" expert split, the `data` axis's size D and name (the experts' devices
    are data x tensor)."""

    size: int = 1  # X
    # Qwen3-MoE: "tp" each expert split by columns, "ep" whole experts over tensor, "a2a"
    # whole experts over data x tensor, reached by all-to-alls
    experts: str = "tp"
    axis: str = "tensor"
    data: int = 1  # D
    data_axis: str = "data"

    @classmethod
    def of(cls, tensor: int, data: int = 1, experts: str | None = None) -> TensorSplit:
        """The split of a mesh of `tensor` X and `data` D devices, experts as asked
        (None: the default, all-to-all over replicas, columns over `tensor` alone)."""
        return cls(tensor, experts or ("a2a" if data > 1 else "tp"), data=data)

    def __post_init__(self):
        if self.size < 1:
            raise TensorError(f"tensor size {self.size} must be at least 1")
        if self.experts not in EXPERT_SPLITS:
            raise TensorError(
                f"expert split {self.experts!r} is not one of {', '.join(EXPERT_SPLITS)}"
            )

    # ---- the placed sizes ----------------------------------------------------------

    def kv_heads(self, cfg: Qwen3Config) -> int:
        """K': the KV heads placed, repeats included."""
        return max(cfg.K, self.size)

    def width(self, cfg: Qwen3Config) -> int:
        """F': the dense MLP's width, padded to a multiple of X."""
        return _round_up(cfg.F, self.size)

    def expert_width(self, cfg: Qwen3Config) -> int:
        """One expert's width as placed (padded when the experts are split by columns)."""
        F = cfg.moe_intermediate_size
        return _round_up(F, self.size) if self.experts == "tp" else F

    @property
    def expert_devices(self) -> int:
        """The devices whole experts split over: X ("ep"), D X ("a2a"), 1 ("tp")."""
        return {"ep": self.size, "a2a": self.data * self.size}.get(self.experts, 1)

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The mesh axes whole experts split over ("a2a": data, then tensor)."""
        return (self.data_axis, self.axis) if self.experts == "a2a" else (self.axis,)

    @property
    def exchanges(self) -> bool:
        """Whether a MoE layer sends its tokens to their experts' devices and back by
        all-to-alls: "a2a" over more than one device (model.moe)."""
        return self.experts == "a2a" and self.expert_devices > 1

    def vocab(self, cfg: Qwen3Config) -> int:
        """V': the vocabulary rows placed, padded to a multiple of X."""
        return _round_up(cfg.V, self.size)

    def local(self, cfg: Qwen3Config) -> Qwen3Config:
        """The model as one device of the split sees it: N/X query heads, K'/X KV heads,
        F'/X columns, V'/X vocabulary rows, E/X experts ("ep") or the experts' F/X
        columns ("tp"); for per-device costs (pipeline.runtime.cp_cost)."""
        X, n = self.size, self.expert_devices
        moe = {}
        if cfg.has_sparse:
            if self.experts == "tp":
                moe = {"moe_intermediate_size": self.expert_width(cfg) // X}
            else:
                moe = {"num_experts": cfg.E // n, "num_experts_per_tok": min(cfg.A, cfg.E // n)}
        return dataclasses.replace(
            cfg,
            num_attention_heads=cfg.N // X,
            num_key_value_heads=self.kv_heads(cfg) // X,
            intermediate_size=self.width(cfg) // X,
            vocab_size=self.vocab(cfg) // X,
            **moe,
        )

    # ---- the refusals --------------------------------------------------------------

    def fits(self, cfg: Qwen3Config, x: int) -> bool:
        """Whether the model splits over x tensor devices with this expert split."""
        heads = cfg.N % x == 0 and (cfg.K % x == 0 or x % cfg.K == 0)
        whole = dataclasses.replace(self, size=x).expert_devices
        return heads and (not cfg.has_sparse or cfg.E % whole == 0)

    def check(self, cfg: Qwen3Config) -> None:
        """A TensorError in one line, naming the sizes that would fit, unless the model
        splits over X devices."""
        X = self.size
        if self.fits(cfg, X):
            return
        fits = ", ".join(str(x) for x in range(1, cfg.N + 1) if self.fits(cfg, x))
        if cfg.N % X:
            why = f"its {cfg.N} query heads cannot be shared equally by {X} tensor devices"
        elif cfg.K % X and X % cfg.K:
            why = (
                f"its {cfg.K} KV heads neither divide over {X} tensor devices nor repeat "
                f"evenly on them"
            )
        elif self.experts == "a2a":
            why = (
                f"its {cfg.E} experts cannot be shared equally by {self.data} x {X} data x "
                f"tensor devices (or split each expert's columns: expert split 'tp')"
            )
        else:
            why = (
                f"its {cfg.E} experts cannot be shared equally by {X} tensor devices "
                f"(or split each expert's columns: expert split 'tp')"
            )
        fix = f"use a tensor size of {fits}" if fits else "use a data size that divides them"
        raise TensorError(f"tensor {X}: {why}; {fix}")

    # ---- inside the mesh -----------------------------------------------------------

    def sum(self, x: jax.Array) -> jax.Array:
        """The partial products of the devices summed over `tensor` (X = 1: x)."""
        return jax.lax.psum(x, self.axis) if self.size > 1 else x

    def first(self, rows: int) -> jax.Array | int:
        """The first global row of this device's block of `rows` rows (vocabulary or,
        "ep", experts)."""
        return jax.lax.axis_index(self.axis) * rows if self.size > 1 else 0

    # ---- checkpoint arrays to placed shapes -----------------------------------------

    def cut(self, path: tuple[str, ...], axis: int, n: int, placed: int, lo: int, hi: int) -> Cut:
        """Placed rows lo..hi of parameter `path`'s `tensor` axis (`axis`, of `placed`
        rows), made from the checkpoint's `n` rows: KV heads repeated, the rest padded."""
        repeat = placed // n if weight_name(path[-1]) in _KV_HEADS else 1
        return Cut(axis=axis, lo=lo, hi=hi, n=n, repeat=repeat)


@dataclasses.dataclass(frozen=True)
class Cut:
    """Rows lo..hi of one parameter's `tensor` axis as placed (the rows a host's devices
    hold), and the checkpoint rows they come from: each of the checkpoint's n rows
    placed `repeat` times in a row (KV heads, device i holding head i // repeat), or once
    with zero rows after the n-th (a width or vocabulary that X does not divide)."""

    axis: int
    lo: int
    hi: int
    n: int
    repeat: int = 1

    def rows(self) -> tuple[int, int]:
        """The checkpoint rows to read."""
        if self.repeat > 1:
            return self.lo // self.repeat, -(-self.hi // self.repeat)
        return min(self.lo, self.n), min(self.hi, self.n)

    def fit(self, x: np.ndarray) -> np.ndarray:
        """The placed rows lo..hi from x, which holds the checkpoint's rows `rows()` on
        `axis` (every other axis as placed)."""
        start = self.rows()[0] * self.repeat
        if self.repeat > 1:
            x = np.repeat(x, self.repeat, axis=self.axis)
        x = x[(slice(None),) * self.axis + (slice(self.lo - start, self.hi - start),)]
        pad = [(0, 0)] * x.ndim
        pad[self.axis] = (0, self.hi - self.lo - x.shape[self.axis])
        return np.pad(x, pad) if pad[self.axis][1] else x


_KV_HEADS = ("k_khd", "v_khd", "k_bias", "v_bias")


def masked_vocab(logits: jax.Array, split: TensorSplit, vocab: int) -> jax.Array:
    """logits [..., V'/X] of this device's vocabulary rows with the padding ids (>= the
    model's `vocab`) at -inf."""
    rows = logits.shape[-1]
    if rows * split.size == vocab:
        return logits
    ids = split.first(rows) + jnp.arange(rows)
    return jnp.where(ids < vocab, logits, -jnp.inf)
