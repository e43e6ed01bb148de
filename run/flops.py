"""A prefill's floating-point operations, from the config alone: the one count that
bench's roofline fractions (`run.bench.jobs`) and plan's predicted prefill
(`run.plan.mesh_cost`) both read.
"""

from __future__ import annotations

from qwen3_spmd.model.config import Qwen3Config


def non_embedding_params(cfg: Qwen3Config, active: bool = True) -> int:
    """Parameters a token's hidden state meets in the decoder layers and final norm (of a
    mixture of experts, the A experts it is routed to; active=False: all of them)."""
    embed = cfg.V * cfg.D * (1 if cfg.tie_word_embeddings else 2)
    return cfg.param_count(active=active) - embed


def dense_flops(cfg: Qwen3Config, T: int, B: int = 1) -> float:
    """The products of B prompts of T tokens with the layers' weights (and the final
    norm's): 2 * non-embedding params * tokens."""
    return 2.0 * non_embedding_params(cfg) * T * B


def attention_flops(cfg: Qwen3Config, T: int) -> float:
    """One layer's causal attention over one prompt of T tokens: QK^T and PV over the
    lower triangle, 4 * T^2/2 * N * H."""
    return 4.0 * (T * T / 2) * cfg.N * cfg.H


def prefill_flops(cfg: Qwen3Config, T: int, B: int) -> float:
    """B prompts of T tokens through every layer (`dense_flops`, `attention_flops`) and
    lm_head on each request's last token."""
    head = 2.0 * cfg.D * cfg.V * B
    return dense_flops(cfg, T, B) + attention_flops(cfg, T) * cfg.L * B + head
