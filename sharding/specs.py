"""One PartitionSpec per tensor role: sharding as data.

Letters: L_pad stacked layer slots, B batch, S cache slots, T tokens, K KV heads,
H head dim.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Specs:
    layers: P = P("stage")  # layer weights: stacked [L_pad, ...] as placed, then per slot [S, ...]
    replicated: P = P()  # embedding, final norm, lm_head; scalars
    cache_lbksh: P = P("stage", None, None, "seq", None)  # KV cache k, v (heads-major)
    slots_bs: P = P(None, "seq")  # cache slot positions, -1 = empty
    tokens_bt: P = P(None, "seq")  # prompt tokens and positions, zigzag order


SPECS = Specs()


def param_spec(path: tuple[str, ...]) -> P:
    """The spec of a parameter by its NNX state path."""
    return SPECS.layers if path[0] == "layers" else SPECS.replicated
