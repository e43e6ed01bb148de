"""Context parallelism over the `seq` mesh axis: sequence partitions and their work
accounting, the LSE merge, ring and Ulysses attention for prefill and sharded-cache decode
attention. Depends on JAX and numpy only."""

from ring.attention import (block_attention, fused_attention_available, heads_major,
                            prompt_attention, ring_attention)
from ring.decode import decode_attention
from ring.merge import merge
from ring.partition import (
    PAD,
    causal_work,
    check_fits,
    contiguous,
    device_positions,
    from_device_order,
    padded_length,
    to_device_order,
    zigzag,
)
from ring.ulysses import HeadSplit, head_split, ulysses_attention

__all__ = [
    "HeadSplit",
    "PAD",
    "block_attention",
    "causal_work",
    "check_fits",
    "contiguous",
    "decode_attention",
    "device_positions",
    "from_device_order",
    "fused_attention_available",
    "head_split",
    "heads_major",
    "merge",
    "padded_length",
    "prompt_attention",
    "ring_attention",
    "to_device_order",
    "ulysses_attention",
    "zigzag",
]
