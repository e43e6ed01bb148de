"""Context parallelism over the `seq` mesh axis: sequence partitions and their work
accounting, the LSE merge, ring attention for prefill and sharded-cache decode
attention. Depends on JAX and numpy only."""

from ring.attention import (block_attention, fused_attention_available, heads_major,
                            prompt_attention, ring_attention)
from ring.decode import decode_attention, decode_slot
from ring.merge import merge
from ring.partition import (
    PAD,
    causal_work,
    contiguous,
    device_positions,
    from_device_order,
    padded_length,
    slots_per_device,
    to_device_order,
    zigzag,
)

__all__ = [
    "PAD",
    "block_attention",
    "causal_work",
    "contiguous",
    "decode_attention",
    "decode_slot",
    "device_positions",
    "from_device_order",
    "fused_attention_available",
    "heads_major",
    "merge",
    "padded_length",
    "prompt_attention",
    "ring_attention",
    "slots_per_device",
    "to_device_order",
    "zigzag",
]
