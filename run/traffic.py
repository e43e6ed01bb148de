"""Traffic and memory for the JSON report: bytes sent between devices, bytes per device.

bytes_between_stages counts the hidden-state bytes of real tokens crossing stage
boundaries, at the run's dtype (4 bytes a value in float32, 2 in bfloat16); bytes_sent
counts what the compiled programs move between stages: every tick's payload, padding
and bubbles included, at the same dtype.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

from qwen3_spmd.model.config import Qwen3Config


def bytes_between_stages(
    cfg: Qwen3Config, stages: int, prompt_lens: list[int], decode_steps: list[int], itemsize: int
) -> int:
    """Each prompt token and each decoded token's hidden state [D], `itemsize` bytes per
    value (the run's dtype), crosses S - 1 boundaries; decode_steps[b] = tokens request b
    fed back (generated tokens - 1)."""
    tokens = sum(prompt_lens) + sum(decode_steps)
    return tokens * cfg.D * itemsize * (stages - 1)


def bytes_sent(cfg: Qwen3Config, stages: int, seq: int, layout: dict, itemsize: int) -> dict:
    """Bytes the prefill and decode programs send along `stage`, over all devices."""
    if stages == 1:
        return {"prefill": 0, "decode": 0, "total": 0}
    B, M, G, P_len = (
        layout["batch"],
        layout["microbatches"],
        layout["groups"],
        layout["padded_prompt"],
    )
    # Prefill: M + S - 1 ticks, S - 1 senders per seq column, [B/M, P/C, D] each.
    prefill = (M + stages - 1) * (stages - 1) * seq * (B // M) * (P_len // seq) * cfg.D * itemsize
    # Decode: every tick of a decode chunk, a cyclic send from every device of the
    # hidden state [B/G, 1, D] and the sampled tokens [B/G] int32; every tick of a verify
    # pass (speculative decoding), S - 1 senders per seq column of [B/G, k + 1, D].
    verify_ticks = layout.get("verify_ticks", 0)
    per_tick = stages * seq * (B // G) * (cfg.D * itemsize + 4)
    per_position = (stages - 1) * seq * (B // G) * cfg.D * itemsize
    decode = (layout["decode_ticks"] - verify_ticks) * per_tick
    decode += layout.get("verify_positions", 0) * per_position
    return {"prefill": prefill, "decode": decode, "total": prefill + decode}


def all_reduces_per_tick(cfg: Qwen3Config, stages: int) -> int:
    """The `tensor` all-reduces of the hidden state a device runs in one tick of a
    program: two per layer slot of its stage and the embedding's (model.split)."""
    return 2 * math.ceil(cfg.L / stages) + 1


def bytes_all_reduced(
    cfg: Qwen3Config,
    stages: int,
    seq: int,
    tensor: int,
    layout: dict,
    itemsize: int,
    data: int = 1,
) -> dict:
    """Bytes one device sends in the `tensor` all-reduces of the hidden state (model.split:
    the embedding's and two per layer slot), per active tick of each program, as a ring
    all-reduce moves them: 2 (X - 1) / X of the payload.

    prefill_per_tick: a microbatch of its replica's rows [B/(D M), P/C, D] through a
    stage's L_pad / S slots; decode_per_step: a group's new tokens [B/(D G), 1, D]
    through them (D `data` replicas, each its B/D rows)."""
    if tensor == 1:
        return {"prefill_per_tick": 0, "decode_per_step": 0}
    reduces = all_reduces_per_tick(cfg, stages)
    per_value = 2 * (tensor - 1) / tensor * itemsize * cfg.D * reduces
    B, M, G, P_len = (
        layout["batch"] // data,
        layout["microbatches"],
        layout["groups"],
        layout["padded_prompt"],
    )
    return {
        "prefill_per_tick": int(per_value * (B // M) * (P_len // seq)),
        "decode_per_step": int(per_value * (B // G)),
    }


def all_to_all_per_layer(cfg: Qwen3Config, split, tokens: int, itemsize: int) -> tuple:
    """(bytes one device sends, the part its tokens needed at most) in one sparse layer's
    two all-to-alls of the "a2a" expert split (model.moe, `split` a
    model.split.TensorSplit) for `tokens` tokens of its replica. Each of the replica's X
    tensor devices dispatches R_x = ceil(tokens / X) of them in n = D X rows of R_x
    slots (a slot: the hidden state, and the A weights and int32 expert ids beside
    it), keeps its own row and sends n - 1; the sums come back in the same rows of
    hidden states. Needed at most: each hidden state to the other devices of its A
    experts (min(A, n - 1)) and back. (0, 0) without that split."""
    n = split.expert_devices
    if not split.exchanges or not cfg.has_sparse:
        return 0, 0
    hidden, slot = cfg.D * itemsize, cfg.D * itemsize + cfg.A * (itemsize + 4)
    R_x = -(-tokens // split.size)
    return (n - 1) * R_x * (slot + hidden), 2 * R_x * min(cfg.A, n - 1) * hidden


def bytes_all_to_all(
    cfg: Qwen3Config, split, stages: int, seq: int, layout: dict, itemsize: int
) -> dict:
    """Bytes one device sends in the all-to-alls of the "a2a" expert split per active
    tick of each program, through a stage's sparse layers (the most any stage holds),
    `all_to_all_per_layer` of each; `_useful`: the part its tokens needed at most. All
    zero without that split.

    prefill_per_tick: a replica's microbatch [B/(D M), P/C] tokens; decode_per_step: a
    replica's group [B/(D G)] of new tokens; sparse_layers: a stage's, over which the
    figures above are (each an equal part)."""
    layers = -(-sum(cfg.sparse_layers) // stages) if split.exchanges else 0
    B = layout["batch"] // split.data  # a replica's rows
    prefill = all_to_all_per_layer(
        cfg, split, B // layout["microbatches"] * (layout["padded_prompt"] // seq), itemsize
    )
    decode = all_to_all_per_layer(cfg, split, B // layout["groups"], itemsize)
    return {
        "prefill_per_tick": prefill[0] * layers,
        "decode_per_step": decode[0] * layers,
        "prefill_useful": prefill[1] * layers,
        "decode_useful": decode[1] * layers,
        "sparse_layers": layers,
    }


def bytes_per_device(tree) -> list[int]:
    """Bytes every array in `tree` keeps on each device of its sharding, per device (in
    device id order, devices holding nothing omitted). Counted from the shardings, so
    in a job of several processes every device is counted, not only this process's."""
    per = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
                elements = math.prod(len(range(*i.indices(n))) for i, n in zip(index, leaf.shape))
                per[device.id] += elements * leaf.dtype.itemsize
    return [per[d] for d in sorted(per)]


def max_abs_error(a: np.ndarray, b: np.ndarray) -> float:
    n = min(len(a), len(b))
    return float(np.max(np.abs(a[:n] - b[:n]))) if n else 0.0
