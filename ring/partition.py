"""Sequence partitions for context parallelism, and their causal work accounting.

A partition says which global token positions each of the C devices on the `seq`
axis owns, in the order the device holds them. Both partitions pad the sequence to
a multiple of 2C (ring attention splits every local block into two halves); padding
positions are -1, which the attention mask never lets anyone see or be seen by.

- `contiguous`: device c holds one run of P/C consecutive positions. Under a causal
  mask the last device does the most work.
- `zigzag`: the padded sequence is cut into 2C chunks and device c holds chunk c and
  chunk 2C-1-c, so every device does the same causal work.
- `zigzag_blocks`: the zigzag of each block of a fixed size on its own (a prefix cache's
  layout: a block sits at the same slots in every prompt).

`to_device_order` lays a `[B, T, ...]` array out in partition order (device 0's
positions first), ready to be sharded `P(None, 'seq')`; `from_device_order` undoes it.
"""

import jax
import jax.numpy as jnp
import numpy as np

PAD = -1
"""The position of a padding token: masked out of every attention."""


def padded_length(length: int, n: int) -> int:
    """`length` rounded up to a multiple of 2n (two equal halves per device)."""
    if length < 0 or n < 1:
        raise ValueError(f"padded_length needs length >= 0 and n >= 1, got length={length}, n={n}")
    return -(-length // (2 * n)) * (2 * n)


def _padded_positions(seq_len: int, n: int) -> np.ndarray:
    """Positions 0..seq_len-1 followed by PAD up to `padded_length(seq_len, n)`."""
    positions = np.full(padded_length(seq_len, n), PAD, dtype=np.int32)
    positions[:seq_len] = np.arange(seq_len, dtype=np.int32)
    return positions


def contiguous(seq_len: int, n: int) -> list[np.ndarray]:
    """Device c owns positions [c*P/n, (c+1)*P/n) of the sequence padded to P.

    Returns: n int32 arrays of P/n positions each; padding positions are -1.
    """
    return list(np.split(_padded_positions(seq_len, n), n))


def zigzag(seq_len: int, n: int) -> list[np.ndarray]:
    """Device c owns chunks c and 2n-1-c of the sequence padded to P, cut in 2n chunks.

    Returns: n int32 arrays of P/n positions each (chunk c, then chunk 2n-1-c);
    padding positions are -1.
    """
    chunks = np.split(_padded_positions(seq_len, n), 2 * n)
    return [np.concatenate([chunks[c], chunks[2 * n - 1 - c]]) for c in range(n)]


def zigzag_blocks(seq_len: int, n: int, block: int) -> list[np.ndarray]:
    """The sequence padded to P (a multiple of 2n) cut in blocks of `block` tokens (a
    multiple of 2n; the last block may be shorter), each block zigzagged over the n
    devices on its own: device c holds, block after block, the block's chunks c and
    2n-1-c. Every device still does the same causal work, and a block's share sits at
    the same local slots (block j: slots [j*block/n, (j+1)*block/n)) whatever the
    sequence's length, which is what lets a prefix cache copy a block's K/V between
    prompts (`pipeline.batch.prefix`). block >= P is `zigzag`.

    Returns: n int32 arrays of P/n positions each; padding positions are -1.
    """
    if block < 2 * n or block % (2 * n):
        raise ValueError(f"zigzag_blocks: block {block} must be a positive multiple of {2 * n}")
    positions = _padded_positions(seq_len, n)
    parts = [[] for _ in range(n)]
    for start in range(0, positions.size, block):
        piece = positions[start : start + block]
        chunks = np.split(piece, 2 * n)
        for c in range(n):
            parts[c] += [chunks[c], chunks[2 * n - 1 - c]]
    return [np.concatenate(p) for p in parts]


def causal_work(partition: list[np.ndarray]) -> list[int]:
    """Causal (query, key) pairs each device computes: sum of q+1 over its queries.

    Padding (-1) contributes nothing.
    """
    return [int(np.sum(np.maximum(p.astype(np.int64) + 1, 0))) for p in partition]


def device_positions(partition: list[np.ndarray]) -> np.ndarray:
    """All positions in device order, [P] int32: what `to_device_order` lays out.

    Broadcast to `[B, P]` and shard `P(None, 'seq')` to give each device its own.
    """
    return np.concatenate(partition).astype(np.int32)


def _seq_len(partition: list[np.ndarray]) -> int:
    return int(np.sum(device_positions(partition) >= 0))


def to_device_order(x, partition: list[np.ndarray]):
    """Reorders axis 1 of `x` [B, T, ...] into partition order, padding to P.

    T must be the partition's unpadded length; padding rows are zeros. Works on
    numpy arrays (returns numpy) and jax arrays (returns jax).
    """
    positions = device_positions(partition)
    seq_len = _seq_len(partition)
    if x.ndim < 2 or x.shape[1] != seq_len:
        raise ValueError(
            f"to_device_order: expected [B, {seq_len}, ...] for this partition, got shape {tuple(x.shape)}"
        )
    xp = jnp if isinstance(x, jax.Array) else np
    # One zero row after the sequence: every padding position gathers it.
    widths = [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2)
    x = xp.pad(x, widths)
    return xp.take(x, np.where(positions >= 0, positions, seq_len), axis=1)


def from_device_order(x, partition: list[np.ndarray]):
    """Inverse of `to_device_order`: axis 1 of `x` [B, P, ...] back to [B, T, ...].

    Padding rows are dropped. Works on numpy and jax arrays.
    """
    positions = device_positions(partition)
    if x.ndim < 2 or x.shape[1] != positions.size:
        raise ValueError(
            f"from_device_order: expected [B, {positions.size}, ...] for this partition, "
            f"got shape {tuple(x.shape)}"
        )
    xp = jnp if isinstance(x, jax.Array) else np
    valid = np.flatnonzero(positions >= 0)
    # valid[argsort(positions[valid])] lists, for each position 0..T-1, where it sits.
    return xp.take(x, valid[np.argsort(positions[valid])], axis=1)


def slots_per_device(prompt_len: int, new_tokens: int, n: int) -> int:
    """Cache slots each of n `seq` devices needs for a prompt of `prompt_len` tokens
    and `new_tokens` generated ones.

    The prompt is padded to `padded_length(prompt_len, n)`, so each device stores 1/n
    of it; decode step j writes to device j mod n (`ring.decode.decode_slot`), and the
    last generated token is never fed back, so new_tokens - 1 steps write.
    """
    return padded_length(prompt_len, n) // n + -(-max(new_tokens - 1, 0) // n)
