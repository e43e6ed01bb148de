"""Traffic and memory (run.traffic), derived from configs without building big models."""

import collections
import math

import jax
import numpy as np
import pytest

from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.run import traffic
from qwen3_spmd.sharding.stages import StagePlan

# The example: a Qwen3 chat prompt, 20 new tokens, 2 stages.
CHAT_PROMPT = [
    151644,
    872,
    198,
    105043,
    100165,
    11319,
    151645,
    198,
    151644,
    77091,
    198,
    151667,
    271,
    151668,
    271,
]


def test_qwen3_0_6b_two_stages_plan_and_bytes():
    cfg = PRESETS["0.6B"]
    assert StagePlan(cfg.L, 2).stage_layers == [[0, 13], [14, 27]]
    # 15 prompt tokens and 19 fed-back tokens (the first of 20 comes from the prefill)
    # each cross one boundary as a [1024] hidden state, at 4 bytes per value in float32
    # (and 2 in bfloat16).
    n = traffic.bytes_between_stages(cfg, 2, [len(CHAT_PROMPT)], [20 - 1], 4)
    assert n == 139264 == (15 + 19) * 1024 * 4
    assert traffic.bytes_between_stages(cfg, 2, [len(CHAT_PROMPT)], [20 - 1], 2) == 69632


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_bytes_between_stages_scales_with_boundaries(stages):
    cfg = PRESETS["tiny"]
    n = traffic.bytes_between_stages(cfg, stages, [3, 5], [2, 0], 4)
    assert n == (3 + 5 + 2) * cfg.D * 4 * (stages - 1)


def test_bytes_sent_counts_padding_and_bubbles():
    cfg = PRESETS["tiny"]
    layout = {"batch": 4, "microbatches": 2, "groups": 2, "padded_prompt": 8, "decode_ticks": 7}
    sent = traffic.bytes_sent(cfg, 2, 2, layout, 4)
    # prefill: 3 ticks x 1 sender stage x 2 seq devices x [2, 4, D] float32
    assert sent["prefill"] == 3 * 1 * 2 * (2 * 4 * cfg.D * 4)
    # decode: 7 ticks (3 steps of 2 groups + 1 to drain) x 2 stages x 2 seq x [2, 1, D]
    # float32 + 2 int32 tokens
    assert sent["decode"] == 7 * 2 * 2 * (2 * (cfg.D * 4 + 4))
    assert traffic.bytes_sent(cfg, 1, 2, layout, 4)["total"] == 0
    # Speculative decoding: 4 of the 7 ticks were two verify passes of 2 ticks over 3
    # positions a row, each tick one sender stage x 2 seq x [2, 3, D] float32.
    spec = {**layout, "verify_ticks": 4, "verify_positions": 4 * 3}
    want = 3 * 2 * 2 * (2 * (cfg.D * 4 + 4)) + 4 * 1 * 2 * (2 * 3 * cfg.D * 4)
    assert traffic.bytes_sent(cfg, 2, 2, spec, 4)["decode"] == want


def test_a_device_all_reduces_its_replicas_rows():
    """Over `tensor` a device all-reduces the hidden states of its replica's rows: with 2
    replicas of a batch of 8, a decode group's 4 rows and a microbatch's 4 prompts."""
    cfg = PRESETS["tiny"]
    layout = {"batch": 8, "microbatches": 1, "groups": 1, "padded_prompt": 8}
    one, two = (traffic.bytes_all_reduced(cfg, 1, 1, 2, layout, 4, D) for D in (1, 2))
    per_row = (2 * cfg.L + 1) * cfg.D * 4 * 2 * (2 - 1) // 2  # a ring over 2 devices
    assert one["decode_per_step"] == 8 * per_row and two["decode_per_step"] == 4 * per_row
    assert two["prefill_per_tick"] == 4 * 8 * per_row


@pytest.mark.parametrize("spec", [("stage", "seq"), ("stage",), ("seq", None), ()])
def test_bytes_per_device_counts_each_devices_shard(spec):
    """From the sharding alone, the bytes of the shard each device holds."""
    mesh = jax.make_mesh((2, 2), ("stage", "seq"), devices=jax.devices()[:4])
    x = jax.device_put(
        np.zeros((4, 6), np.float32),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)),
    )
    y = jax.device_put(np.zeros((3,), np.int32), jax.devices()[5])
    want = collections.Counter()
    for a in (x, y):
        for shard in a.addressable_shards:
            want[shard.device.id] += shard.data.nbytes
    assert traffic.bytes_per_device({"x": x, "y": y}) == [want[d] for d in sorted(want)]
    assert (
        sum(want.values()) == 4 * 6 * 4 * 4 // math.prod(mesh.shape[a] for a in spec if a) + 3 * 4
    )
