"""The context-parallel cost model (pipeline.runtime.cp_cost): bytes per device per layer for
the ring and Ulysses, counted by hand for the 0.6B shape; the `auto` choice; and
`generate --cp` on the command line."""

import json

import jax.numpy as jnp
import pytest

from qwen3_spmd.model.config import PRESETS, Qwen3Config
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.runtime import cp_cost
from qwen3_spmd.run.cli import main

# Qwen3-0.6B's attention shape: N=16 query heads, K=8 KV heads, H=128, 28 layers.
Q06 = Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)


def test_bytes_per_layer_by_hand():
    f32 = 4
    # ring, C=4, P=2048: 3 steps, each a K and a V block [512, 8, 128] and 512 positions
    assert cp_cost.bytes_per_layer("ring", Q06, 4, 1, 2048, f32) == 3 * (
        2 * 512 * 8 * 128 * 4 + 512 * 4
    )
    # ulysses, C=4: q and o [512, 16, 128] and k, v [512, 8, 128], 3/4 of each received;
    # 3 other devices' 512 query and 512 key positions
    per = 512 * (2 * 16 + 2 * 8) * 128 * 4
    assert cp_cost.bytes_per_layer("ulysses", Q06, 4, 1, 2048, f32) == per * 3 // 4 + 3 * 512 * 8
    # C=16 > K=8: each KV head goes to 2 devices, 16 KV heads travel instead of 8
    per16 = 128 * (2 * 16 + 2 * 16) * 128 * 4
    assert (
        cp_cost.bytes_per_layer("ulysses", Q06, 16, 1, 2048, f32) == per16 * 15 // 16 + 15 * 128 * 8
    )
    # one device moves nothing; batch scales linearly
    assert cp_cost.bytes_per_layer("ring", Q06, 1, 1, 2048, f32) == 0
    assert cp_cost.bytes_per_layer("ulysses", Q06, 1, 1, 2048, f32) == 0
    assert cp_cost.bytes_per_layer("ring", Q06, 8, 3, 2048, 2) == 3 * cp_cost.bytes_per_layer(
        "ring", Q06, 8, 1, 2048, 2
    )


def test_ring_bytes_grow_with_c_and_ulysses_bytes_do_not():
    """Per device, the ring receives (C-1) blocks of T/C tokens: about 2*P*K*H values
    whatever C is, while Ulysses receives (C-1)/C of 2*(N+K)*H*P/C: shrinking with C."""
    ring = [cp_cost.bytes_per_layer("ring", Q06, c, 1, 8192, 4) for c in (2, 4, 8)]
    uly = [cp_cost.bytes_per_layer("ulysses", Q06, c, 1, 8192, 4) for c in (2, 4, 8)]
    assert ring[0] < ring[1] < ring[2] and uly[0] > uly[1] > uly[2]
    assert uly[0] > ring[0] and uly[2] < ring[2]


def test_hybrid_figures_reduce_to_either_strategy():
    """ulysses:C,ring:1 is Ulysses and ulysses:1,ring:C is the ring; on one uniform link
    the hybrid of C = 8 moves more than Ulysses alone (0.6B, P = 8192, float32)."""
    for c in (2, 4, 8):
        assert cp_cost.hybrid_bytes_per_layer(Q06, c, 1, 1, 8192, 4)[
            "total"
        ] == cp_cost.bytes_per_layer("ulysses", Q06, c, 1, 8192, 4)
        assert cp_cost.hybrid_bytes_per_layer(Q06, 1, c, 1, 8192, 4)[
            "total"
        ] == cp_cost.bytes_per_layer("ring", Q06, c, 1, 8192, 4)
    h = cp_cost.hybrid_bytes_per_layer(Q06, 2, 4, 1, 8192, 4)
    # inside pairs: 1/2 of q, k, v, o [1024, 16+8+8+16 heads, 128]; then 3 steps of a
    # pair's K/V block [2048, 4 + 4 heads, 128] and its positions
    assert h["ulysses"] == 1024 * 48 * 128 * 4 // 2 + 1024 * 8
    assert h["ring"] == 3 * 2048 * (2 * 4 * 128 * 4 + 4)
    assert (
        cp_cost.bytes_per_layer("ulysses", Q06, 8, 1, 8192, 4)
        < h["total"]
        < cp_cost.bytes_per_layer("ring", Q06, 8, 1, 8192, 4)
    )


def _prefill(seq, stages=1, microbatches=1, batch=1, padded_len=8192):
    """A float32 prefill of Qwen3-0.6B's shape."""
    return cp_cost.Prefill(
        cfg=Q06,
        seq=seq,
        stages=stages,
        microbatches=microbatches,
        batch=batch,
        padded_len=padded_len,
        itemsize=4,
    )


def _rates(link, flops):
    return cp_cost.Rates(link_bytes_per_s=link, flops_per_s=flops)


def test_predict_counts_every_tick_and_layer():
    prefill = _prefill(4, stages=2, microbatches=2, batch=4, padded_len=2048)
    p = cp_cost.predict("ulysses", prefill, _rates(1e10, 1e11))
    # M + S - 1 = 3 ticks of 14 layers, each at the microbatch of 2 requests
    assert p["bytes_per_device"] == 3 * 14 * cp_cost.bytes_per_layer("ulysses", Q06, 4, 2, 2048, 4)
    assert p["predicted_s"] > 0 and p["attention_s_per_layer"] > 0


def test_a_link_figure_per_collective():
    """The ring's transfers run at the ppermute figure, Ulysses' at the all-to-all one."""
    links = {"ppermute": 1e10, "all_to_all": 1e8}
    assert cp_cost.link_rate(links, "ring") == 1e10
    assert cp_cost.link_rate(links, "ulysses") == 1e8 and cp_cost.link_rate(3.0, "ring") == 3.0
    slow_a2a = cp_cost.predict("ulysses", _prefill(4, padded_len=2048), _rates(links, 1e11))
    fast_a2a = cp_cost.predict("ulysses", _prefill(4, padded_len=2048), _rates(1e10, 1e11))
    per_layer = cp_cost.bytes_per_layer("ulysses", Q06, 4, 1, 2048, 4)
    assert slow_a2a["attention_s_per_layer"] - fast_a2a["attention_s_per_layer"] == pytest.approx(
        per_layer / 1e8 - per_layer / 1e10
    )


def test_auto_picks_the_smaller_prediction_and_only_what_fits():
    slow_link = cp_cost.choose("auto", _prefill(8), _rates(1e8, 1e14))
    assert slow_link[0] == "ulysses"  # the ring's 7 steps of K/V blocks cannot hide
    fast_link = cp_cost.choose("auto", _prefill(2), _rates(1e13, 1e11))
    assert fast_link[0] == "ring"  # transfers hide behind the compute; all-to-alls cannot
    for strategy, preds in (slow_link, fast_link):
        assert preds[strategy]["predicted_s"] == min(p["predicted_s"] for p in preds.values())
    only_ring = cp_cost.choose("auto", _prefill(3), _rates(1e8, 1e14))
    assert only_ring[0] == "ring" and set(only_ring[1]) == {"ring"}
    assert cp_cost.choose("auto", _prefill(1, padded_len=64), _rates(1e8, 1e14))[0] == "ring"
    with pytest.raises(RequestError, match="16 query heads cannot be shared equally by 3"):
        cp_cost.choose("ulysses", _prefill(3), _rates(1e8, 1e14))


def test_generate_cp_ulysses_json_and_bad_split(capsys):
    assert (
        main(
            [
                "generate",
                "--mesh",
                "1x2",
                "--cp",
                "ulysses",
                "--check",
                "--max-new-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["cp_strategy"] == "ulysses" and out["matches_single_device"] is True
    assert out["max_error_vs_single_device"] < 1e-4
    assert out["cp_bytes_per_device"] == out["layout"]["cp"]["ulysses"]["bytes_per_device"] > 0
    assert out["cp_predicted_prefill_s"] > 0 and out["cp_measured_prefill_s"] > 0
    assert main(["generate", "--mesh", "1x3", "--cp", "ulysses"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: ulysses: 4 query heads cannot be shared equally by 3 seq "
        "devices; use --cp ring, or a seq size that divides 4 (1, 2, 4)"
    )


# ---- the mesh's cost model (run.plan.mesh_cost, `plan`) ------------------------------------


def test_the_seeds_worked_exercise():
    """PP = 4, 5 ms a stage per decode step, 0.2 ms a transfer: 20.8 ms a token for one
    request; with 4 groups in flight a step every 5.2 ms (the shift follows the layers
    in the same tick, so it does not hide behind them)."""
    from qwen3_spmd.run.plan.mesh_cost import pipeline_decode

    token_s, steps = pipeline_decode(5e-3, 0.2e-3, stages=4, groups=1)
    assert token_s == pytest.approx(20.8e-3)
    assert steps == pytest.approx(1 / 20.8e-3)
    assert pipeline_decode(5e-3, 0.2e-3, stages=4, groups=4)[1] == pytest.approx(1 / 5.2e-3)


def test_plan_ranks_every_factorisation(capsys):
    """32B on 8 H200s in one host: every S x C x X the heads allow, tensor first for
    latency (a token waits for one stage, not eight), the bytes those of the shardings;
    on two hosts the tensor axis stays inside one (X <= 4)."""
    import json

    from qwen3_spmd.run.cli import main
    from qwen3_spmd.sharding.footprint import bytes_per_device

    assert main(["plan", "--model", "32B", "--devices", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["meshes"]
    shapes = {(r["data"], r["stage"], r["seq"], r["tensor"]) for r in rows}
    assert len(shapes) == len(rows) and all(d * s * c * x == 8 for d, s, c, x in shapes)
    assert {x for *_, x in shapes} == {1, 2, 4, 8} and {d for d, *_ in shapes} == {1, 2, 4, 8}
    assert rows[0]["mesh"] == "1x1x8"
    times = [r["decode_token_s"] for r in rows if r["fits"]]
    assert times == sorted(times)
    eight = next(r for r in rows if r["mesh"] == "8x1")
    assert eight["decode_token_s"] > 4 * rows[0]["decode_token_s"]
    cfg = PRESETS["32B"]
    want = bytes_per_device(cfg, 2, 1, jnp.bfloat16, 8, 4096, tensor=4)
    two = next(r for r in rows if r["mesh"] == "2x1x4")
    assert (two["weight_bytes_per_device"], two["kv_bytes_per_device"]) == (
        want["weights"],
        want["kv"],
    )
    assert main(["plan", "--model", "32B", "--devices", "8", "--hosts", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["meshes"]
    assert max(r["tensor"] for r in rows) == 4


def test_replicas_in_the_plan_share_nothing():
    """D replicas of a mesh: each device holds its weights as one replica's would and
    KV for its replica's rows; a token takes one replica's time; the throughput is D
    replicas' at batch / D each; replicas are whole hosts or shares of one."""
    from qwen3_spmd.run.plan.machines import GPUS
    from qwen3_spmd.run.plan.mesh_cost import Load, factorisations, predict
    from qwen3_spmd.sharding.mesh import MeshShape

    cfg, h200 = PRESETS["8B"], GPUS["h200"]
    two = predict(cfg, MeshShape(1, 1, 4, data=2), h200, Load(batch=16))
    one = predict(cfg, MeshShape(1, 1, 4), h200, Load(batch=8))
    assert two["weight_bytes_per_device"] == one["weight_bytes_per_device"]
    assert two["kv_bytes_per_device"] == one["kv_bytes_per_device"]
    assert two["decode_token_s"] == one["decode_token_s"]
    assert two["decode_tokens_per_s"] == pytest.approx(2 * one["decode_tokens_per_s"])
    assert two["cache_tokens"] == 2 * one["cache_tokens"]
    on_two_hosts = {m.data for m in factorisations(cfg, 12, 2)}
    assert on_two_hosts == {1, 2, 4, 6, 12}  # 3 replicas would split a host's 6 devices


def test_moe_replicas_in_the_plan_split_experts_and_pay_all_to_alls():
    """Qwen3-MoE over replicas splits its experts over data x tensor by default ("a2a"):
    a device holds fewer expert bytes than a replica holding them all over `tensor`,
    and a step pays the all-to-alls (across the hosts when the replicas are), which
    the tp split does not."""
    from qwen3_spmd.run.plan.machines import GPUS
    from qwen3_spmd.run.plan.mesh_cost import Load, predict
    from qwen3_spmd.sharding.mesh import MeshShape

    cfg, h200, load, mesh = PRESETS["30B-A3B"], GPUS["h200"], Load(batch=16), MeshShape(1, 1, 4, 2)
    a2a, tp = (predict(cfg, mesh, h200, load, 2, experts) for experts in (None, "tp"))
    assert a2a["weight_bytes_per_device"] < tp["weight_bytes_per_device"]
    assert a2a["step_parts_s"]["all-to-alls"] > 0 and "all-to-alls" not in tp["step_parts_s"]
    one_host = predict(cfg, mesh, h200, load, 1)
    assert one_host["step_parts_s"]["all-to-alls"] < a2a["step_parts_s"]["all-to-alls"]
