"""Context parallelism over the `seq` mesh axis: sequence partitions and their work
accounting, the LSE merge, ring and Ulysses attention for prefill and sharded-cache decode
attention. Depends on JAX and numpy only."""

from qwen3_spmd.ring.attention import (
    block_attention,
    fused_attention_available,
    heads_major,
    prompt_attention,
    ring_attention,
)
from qwen3_spmd.ring.decode import context_attention, decode_attention, decode_slot
from qwen3_spmd.ring.merge import merge
from qwen3_spmd.ring.partition import (
    PAD,
    causal_work,
    contiguous,
    device_positions,
    from_device_order,
    padded_length,
    slots_per_device,
    to_device_order,
    zigzag,
    zigzag_blocks,
)
from qwen3_spmd.ring.ulysses import HeadSplit, head_split, ulysses_attention

__all__ = [
    "HeadSplit",
    "PAD",
    "block_attention",
    "causal_work",
    "contiguous",
    "context_attention",
    "decode_attention",
    "decode_slot",
    "device_positions",
    "from_device_order",
    "fused_attention_available",
    "head_split",
    "heads_major",
    "merge",
    "padded_length",
    "prompt_attention",
    "ring_attention",
    "slots_per_device",
    "to_device_order",
    "ulysses_attention",
    "zigzag",
    "zigzag_blocks",
]
