"""One PartitionSpec per tensor role: sharding as data.

Letters: L_pad stacked layer slots, B batch, S cache slots, T tokens, K KV heads,
H head dim. Rows (B) and the pool's pages split over `data`: each replica its own.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from qwen3_spmd.model.fp8 import weight_name
from qwen3_spmd.model.split import EXPERT_AXIS, TENSOR_AXIS


@dataclasses.dataclass(frozen=True)
class Specs:
    layers: P = P("stage")  # layer weights: stacked [L_pad, ...] as placed, then per slot [S, ...]
    replicated: P = P()  # final norm, router, scalars
    rows: P = P("data")  # one per row [B, ...]: each replica its own rows
    # KV cache k, v [L_pad, pages, K, C bs, H] (heads-major): each replica its own pages
    cache_lbksh: P = P("stage", "data", "tensor", "seq", None)
    slots_bs: P = P("data", "seq")  # cache slot positions, -1 = empty
    tokens_bt: P = P("data", "seq")  # prompt tokens and positions, zigzag order


SPECS = Specs()


def replica_of(i, n: int, replicas: int):
    """The `data` replica that holds item i (an int or an array of them) of n split over
    `replicas` as `rows` and the pool's pages are: equal blocks, in order."""
    return i // (n // replicas)


def tensor_axis(path: tuple[str, ...], experts: str = "tp") -> int | None:
    """The axis of a parameter (as stored) that `tensor` splits; None for norms and the
    router. An FP8 weight's scales split on its weight's axis (model.fp8 keeps that axis
    whole in them)."""
    return {**TENSOR_AXIS, **EXPERT_AXIS[experts]}.get(weight_name(path[-1]))


def param_spec(path: tuple[str, ...], experts: str = "tp") -> P:
    """The spec of a parameter by its NNX state path: layers over `stage`, and the axis
    `tensor` splits (none for norms and the router; an "a2a" split's experts over
    `data` x `tensor`)."""
    names: list = ["stage"] if path[0] == "layers" else []
    at = tensor_axis(path, experts)
    if at is not None:
        # "a2a": whole experts over data x tensor (model.split)
        whole = experts == "a2a" and weight_name(path[-1]) in EXPERT_AXIS["a2a"]
        names += [None] * (at - len(names)) + [("data", "tensor") if whole else "tensor"]
    return P(*names)
