"""Sequence partitions, their work accounting and the device-order helpers."""

import jax.numpy as jnp
import numpy as np
import pytest

from qwen3_spmd import ring


def test_design_work_counts():
    assert ring.causal_work(ring.contiguous(64, 4)) == [136, 392, 648, 904]
    assert ring.causal_work(ring.zigzag(64, 4)) == [520, 520, 520, 520]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_partition_covers_every_position_once(kind, n):
    seq_len = 6 * n
    partition = getattr(ring, kind)(seq_len, n)
    assert len(partition) == n
    assert all(p.dtype == np.int32 and p.size == seq_len // n for p in partition)
    assert np.array_equal(np.sort(np.concatenate(partition)), np.arange(seq_len))
    assert sum(ring.causal_work(partition)) == seq_len * (seq_len + 1) // 2


def test_zigzag_chunks():
    assert [p.tolist() for p in ring.zigzag(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [p.tolist() for p in ring.contiguous(8, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_zigzag_balances_work(n):
    assert len(set(ring.causal_work(ring.zigzag(4 * n, n)))) == 1


def test_padded_length():
    assert [ring.padded_length(t, 4) for t in (0, 1, 7, 8, 9, 64, 65)] == [
        0,
        8,
        8,
        8,
        16,
        64,
        72,
    ]
    assert ring.padded_length(5, 1) == 6
    with pytest.raises(ValueError, match="n=0"):
        ring.padded_length(5, 0)


def test_padding_positions_are_minus_one():
    # 5 tokens on 2 devices pad to 8: chunks [0 1] [2 3] [4 -1] [-1 -1].
    assert [p.tolist() for p in ring.zigzag(5, 2)] == [[0, 1, -1, -1], [2, 3, 4, -1]]
    assert [p.tolist() for p in ring.contiguous(5, 2)] == [
        [0, 1, 2, 3],
        [4, -1, -1, -1],
    ]
    assert ring.causal_work(ring.zigzag(5, 2)) == [3, 12]


@pytest.mark.parametrize("as_jax", [False, True])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("seq_len, n", [(16, 4), (13, 4), (7, 1), (24, 3)])
def test_device_order_round_trip_rank_coded(kind, seq_len, n, as_jax):
    partition = getattr(ring, kind)(seq_len, n)
    # Rank-coded: entry [b, t, j] = 1000 b + 10 t + j, so any misplaced row shows.
    b, t, j = np.meshgrid(np.arange(2), np.arange(seq_len), np.arange(3), indexing="ij")
    x = (1000 * b + 10 * t + j).astype(np.int32)
    arr = jnp.asarray(x) if as_jax else x

    ordered = ring.to_device_order(arr, partition)
    positions = ring.device_positions(partition)
    assert ordered.shape == (2, ring.padded_length(seq_len, n), 3)
    assert isinstance(ordered, type(arr))
    expected = np.where(
        positions[None, :, None] >= 0,
        1000 * b[:, :1] + 10 * positions[None, :, None] + j[:, :1],
        0,
    )
    assert np.array_equal(np.asarray(ordered), expected)

    back = ring.from_device_order(ordered, partition)
    assert isinstance(back, type(arr))
    assert np.array_equal(np.asarray(back), x)


def test_device_order_shape_errors():
    partition = ring.zigzag(8, 2)
    with pytest.raises(ValueError, match=r"\[B, 8, \.\.\.\].*\(1, 7\)"):
        ring.to_device_order(np.zeros((1, 7)), partition)
    with pytest.raises(ValueError, match=r"\[B, 8, \.\.\.\].*\(1, 9\)"):
        ring.from_device_order(np.zeros((1, 9)), partition)


def test_slots_per_device():
    """The padded prompt's share, then one slot per fed-back token, round-robin."""
    assert ring.slots_per_device(64, 1, 4) == 16  # one new token: only the prompt
    assert ring.slots_per_device(60, 17, 4) == 16 + 4  # 16 steps write, 4 per device
    assert ring.slots_per_device(60, 18, 4) == 16 + 5  # the 17th step opens a fifth
    assert ring.slots_per_device(65, 1, 4) == 72 // 4  # padded to a multiple of 2C = 8
    assert ring.slots_per_device(5, 3, 1) == 6 + 2  # C = 1 still pads to even


def test_decode_slot_balances_devices():
    """Step j goes to device j mod C, after the prompt's slots, so every device's cache
    fills at the same rate."""
    placed = [ring.decode_slot(j, prompt_slots=3, n=4) for j in range(9)]
    assert placed == [(0, 3), (1, 3), (2, 3), (3, 3), (0, 4), (1, 4), (2, 4), (3, 4), (0, 5)]
    # the slots steps 0..J-1 take on their devices fit slots_per_device's count
    for J in range(1, 12):
        slots = max(ring.decode_slot(j, 6, 4)[1] for j in range(J)) + 1
        assert slots == ring.slots_per_device(24, J + 1, 4) == 6 + -(-J // 4)
