"""Sequence partitions, their work accounting and the device-order helpers."""

import jax.numpy as jnp
import numpy as np
import pytest

import ring


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


def test_check_fits():
    ring.check_fits(64, 4, capacity=64)
    ring.check_fits(60, 4, capacity=80, new_tokens=16)  # 16 + 4 slots per device of 20
    with pytest.raises(
        ValueError, match="65 tokens padded to 72.*needs 18 slots per device.*holds 16"
    ):
        ring.check_fits(65, 4, capacity=64)
    with pytest.raises(ValueError, match="needs 21 slots per device"):
        ring.check_fits(60, 4, capacity=80, new_tokens=17)
    with pytest.raises(ValueError, match="capacity 10 does not split evenly over 4"):
        ring.check_fits(8, 4, capacity=10)
