"""`qwen3-spmd bench` in smoke mode: every scenario runs on the tiny preset and its JSON
holds every field with sane values. Never a timing threshold: times are checked for
signs, finiteness and their relations to each other; the counts (FLOPs, bytes) for
their exact values, computed here from the config and the mesh."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from reference import FIXTURES

from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.model.params import abstract_model, map_params
from qwen3_spmd.pipeline.requests import fitting_seq_len
from qwen3_spmd.run.bench.report import add_ratios, print_table
from qwen3_spmd.run.cli import main
from qwen3_spmd.sharding.footprint import bytes_per_device

TINY = PRESETS["tiny"]  # bench's model without --model


def run_json(capsys, *argv, cache: bool = True) -> dict:
    """bench --smoke's report; with `cache` the session's compile cache
    (tests/conftest.py) serves the programs the earlier runs compiled (each run compiles
    its 1x1 jobs beside its mesh's); without, bench's default: no cache."""
    folder = os.environ["QWEN3_SPMD_COMPILE_CACHE"]
    flags = ["--compile-cache", folder] if cache else []
    assert main(["bench", "--smoke", *argv, *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compile_cache"] == (folder if cache else None)
    return out


def check_spread(x: dict, n: int = 2) -> None:
    """A spread of n positive samples (--smoke: 2 repeats; the rooflines and links take
    at least 3)."""
    assert set(x) == {"median", "min", "max", "n"}
    assert 0 < x["min"] <= x["median"] <= x["max"] < math.inf
    assert x["n"] == n


def param_bytes(cfg, layers_only: bool = False) -> int:
    """float32 bytes of the model's parameters, counted from the model's own shapes (not
    from the config's formulas); layers_only: without the embedding and lm_head."""
    sizes = {}
    map_params(lambda path, x: sizes.__setitem__(path, x.size), abstract_model(cfg, jnp.float32)[1])
    tables = ("embed_vd", "lm_head_vd") if layers_only else ()
    return 4 * sum(n for path, n in sizes.items() if path[0] not in tables)


def prefill_flops(cfg, T: int, B: int) -> float:
    """2 FLOPs a weight a token of the layers, causal attention's QK^T and PV over the
    lower triangle (4 * T^2/2 * N * H a layer) and lm_head on the last token."""
    dense = 2.0 * param_bytes(cfg, layers_only=True) / 4 * T * B
    return dense + 4.0 * (T * T / 2) * cfg.N * cfg.H * cfg.L * B + 2.0 * cfg.D * cfg.V * B


def in_unit(x: float) -> bool:
    return 0 < x <= 1


def check_common(out: dict, meshes: list[str]) -> None:
    m = out["machine"]
    assert m["device_count"] == 8 and m["backend"] == "cpu" and m["cpu_cores"] >= 1
    for key in ("cpu_model", "device_kind", "platform", "python", "jax", "jaxlib", "flax"):
        assert isinstance(m[key], str) and m[key]
    assert out["model"]["random_weights"] is True and out["dtype"] == "float32"
    assert [x["mesh"] for x in out["meshes"]] == meshes
    assert set(out["targets"]) == {
        "decode_b1_bandwidth_roofline_fraction",
        "decode_b1_speedup_vs_peer",
        "prefill_512_speedup_vs_peer",
        "prefill_2048_2x2_time_ratio_vs_1x1",
        "decode_b8_2x1_time_ratio_vs_1x1",
        "compile_s_max",
        "serve_c8_vs_c1_1x1",
        "serve_c8_vs_static_batch_8_1x1",
        "embed_1x1_speedup_vs_peer",
        "embed_1x4_memory_ratio_vs_1x1",
        "serve_loaded_idle_fraction_2x1",
    }
    for mesh in out["meshes"]:
        compiles = [j["compile_s"] for k in ("prefill", "decode") for j in mesh.get(k, [])]
        assert mesh["compile_s_max"] == max(compiles) > 0
    worst = max(m["compile_s_max"] for m in out["meshes"])
    assert out["targets"]["compile_s_max"]["value"] == worst
    for mesh in out["meshes"]:
        assert set(mesh["timeline"]) == {"prefill", "decode"}
        assert len(mesh["timeline"]["decode"]) == mesh["stage"]


def test_prefill_and_rooflines_on_2x2(capsys):
    out = run_json(
        capsys,
        "--scenario",
        "prefill",
        "--scenario",
        "roofline",
        "--mesh",
        "2x2",
        "--prompt-lens",
        "16",
    )
    check_common(out, ["1x1", "2x2"])
    roof = out["roofline"]
    for key in ("bandwidth_bytes_per_s", "matmul_flops_per_s"):
        check_spread(roof[key], n=3)
    kernels = roof["bandwidth_by_kernel"]  # the fastest kernel's figure is quoted
    fastest = max(kernels.values(), key=lambda x: x["median"])
    assert roof["bandwidth_bytes_per_s"] == kernels[roof["bandwidth_kernel"]] == fastest
    assert roof["bandwidth_array_bytes"] == 32 * 2**20 and roof["matmul_size"] == 512  # --smoke
    for mesh in out["meshes"]:
        assert "decode" not in mesh and "memory" not in mesh
        (job,) = mesh["prefill"]
        assert job["prompt_len"] == 16 and job["batch"] == 1 and job["padded_prompt"] >= 16
        for key in ("time_s", "tokens_per_s", "program_time_s"):
            check_spread(job[key])
        assert job["flops"] == prefill_flops(TINY, 16, 1)
        assert in_unit(job["compute_roofline_fraction"])
        assert 0 < job["time_ratio_vs_1x1"] < math.inf
        # A program's arguments hold at least the device's weights.
        weights = bytes_per_device(TINY, mesh["stage"], mesh["seq"], jnp.float32, 1, 0)["weights"]
        assert set(job["programs"]) and all(
            a is None or a["argument_size_in_bytes"] >= weights for a in job["programs"].values()
        )
    one, two = out["meshes"]
    assert one["prefill"][0]["time_ratio_vs_1x1"] == 1.0
    assert one["prefill"][0]["idle_fraction"] == 0.0
    assert one["prefill"][0]["stage_bytes_per_token"] == 0
    assert one["prefill"][0]["ring_bytes_per_token"] == 0
    job = two["prefill"][0]
    assert job["idle_fraction"] == pytest.approx(0.5)  # M=1, S=2
    # The padded prompt's hidden states [P, D] float32 (P/C from each seq device) leave
    # stage 0 on each of the M + S - 1 = 2 ticks, the bubble's included.
    P, C = job["padded_prompt"], 2
    assert job["stage_bytes_per_token"] == 2 * P * TINY.D * 4 / 16
    # Each of the C devices passes its K and V blocks [P/C, K, H] and positions [P/C]
    # int32 on C - 1 hops in every layer: C times what one device receives (cp_cost).
    ring = TINY.L * C * (C - 1) * (P // C) * (2 * TINY.K * TINY.H * 4 + 4)
    assert job["ring_bytes_per_token"] == ring / 16 == job["cp_bytes_per_device"] * C / 16
    # The table shows the measurements; the targets only when asked (--targets).
    print_table(out)
    text = capsys.readouterr().out
    assert "prefill" in text and "compile_s_max" not in text
    print_table(out, targets=True)
    assert "compile_s_max" in capsys.readouterr().out


def test_decode_on_1x1x2_times_its_all_reduces(capsys):
    """A tensor mesh reports the bytes each device sends in a step's all-reduces (two a
    layer and the embedding's, [1, D] float32 each, a ring moving 2 (X-1)/X of it) and
    the time of those all-reduces alone; 1x1 has none."""
    cfg = PRESETS["tiny"]
    argv = ["--scenario", "prefill", "--scenario", "decode", "--prompt-lens", "16"]
    out = run_json(capsys, *argv, "--mesh", "1x1x2", "--batches", "1")
    check_common(out, ["1x1", "1x1x2"])
    (one,), (two,) = (m["decode"] for m in out["meshes"])
    assert one["all_reduce_bytes_per_step"] == 0 and one["all_reduce_s_per_step"] is None
    assert two["all_reduce_bytes_per_step"] == (2 * cfg.L + 1) * cfg.D * 4 * 2 * (2 - 1) // 2
    check_spread(two["all_reduce_s_per_step"])
    (prefill,) = out["meshes"][1]["prefill"]  # one tick: the prompt's padded tokens
    rows = prefill["padded_prompt"]
    assert prefill["all_reduce_bytes_per_tick"] == rows * two["all_reduce_bytes_per_step"]
    check_spread(prefill["all_reduce_s_per_tick"])


def test_decode_on_replicas_reports_each_replicas_work(capsys):
    """On 2x1x1x1 each replica decodes half of batch 2's rows and reads every weight for
    them (KV for its row); the paged load runs over both replicas (its rows and pool
    each replica's) with the same tokens through many rows and 2, as on 1x1."""
    argv = ["--scenario", "decode", "--scenario", "paged", "--batches", "2"]
    out = run_json(capsys, *argv, "--mesh", "2x1x1x1")
    one, two = out["meshes"]
    assert (one["data"], two["data"]) == (1, 2)
    assert one["paged"]["same_tokens"] and two["paged"]["same_tokens"]
    assert two["paged"]["rows_2"]["max_num_seqs"] == 2 * one["paged"]["rows_2"]["max_num_seqs"]
    (whole,), (half,) = one["decode"], two["decode"]
    assert (whole["rows_per_replica"], half["rows_per_replica"]) == (2, 1)
    assert half["replicas"] == 2 and half["bytes_read_per_step"] == whole["bytes_read_per_step"]
    every = half["bytes_read_per_step"]
    mine = half["bytes_read_per_replica_step"]
    assert mine["weights"] == every["weights"] - PRESETS["tiny"].D * 4  # one embedding row
    assert mine["kv"] * 2 == every["kv"]


def test_decode_and_memory_on_2x1(capsys):
    out = run_json(
        capsys,
        "--scenario",
        "decode",
        "--scenario",
        "memory",
        "--scenario",
        "roofline",
        "--mesh",
        "2x1",
        "--batches",
        "2",
        "--decode-cache-len",
        "41",
    )
    check_common(out, ["1x1", "2x1"])
    for mesh in out["meshes"]:
        assert "prefill" not in mesh
        (job,) = mesh["decode"]
        assert job["batch"] == 2 and job["steps"] == 4 and job["chunks"] == 1
        assert job["cache_len"] == 41  # 16 prompt tokens and 4 steps need 21
        for key in ("time_s", "time_per_output_token_s", "tokens_per_s", "program_time_s"):
            check_spread(job[key])
        assert all(math.isfinite(job["host_overhead_fraction"][k]) for k in ("min", "max"))
        assert in_unit(job["bandwidth_roofline_fraction"])
        assert 0 < job["time_ratio_vs_1x1"] < math.inf
        read = job["bytes_read_per_step"]
        # K and V of every layer for 2 requests over the steps' mean context, 16 + 1.5
        kv = 2 * TINY.L * 2 * (16 + (4 - 1) / 2) * TINY.K * TINY.H * 4
        assert read["total"] == read["weights"] + read["kv"] and read["kv"] == kv
        assert job["steady_idle_fraction"] == 0.0 and 0 <= job["idle_fraction"] < 1
        assert job["ring_bytes_per_token"] == 0  # no seq axis
        mem = mesh["memory"]
        assert len(mem["weight_bytes_per_device"]) == mesh["devices"]
        # What the shardings put on a device (sharding.footprint, from shapes alone).
        S = mesh["stage"]
        expected = bytes_per_device(TINY, S, 1, jnp.float32, 2, 41)
        assert mem["max_weight_bytes"] == expected["weights"]
        assert mem["max_kv_bytes"] == expected["kv"]
        held = mem["max_weight_bytes"] + mem["max_kv_bytes"]  # a program's arguments
        for analysis in mem["programs"].values():
            assert analysis is None or (
                analysis["temp_size_in_bytes"] >= 0 and analysis["argument_size_in_bytes"] >= held
            )
    one, two = out["meshes"]
    assert one["memory"]["max_weight_bytes"] == param_bytes(TINY)  # every weight, once
    assert one["decode"][0]["stage_bytes_per_token"] == 0
    # Every tick of the chunk, each stage sends its group's hidden state [B/G, D] float32
    # and sampled token int32 on (cyclic): ticks x S x (D * 4 + 4), over B x steps tokens.
    ticks = len(two["timeline"]["decode"][0])
    assert two["decode"][0]["stage_bytes_per_token"] == ticks * 2 * (TINY.D * 4 + 4) / (2 * 4)
    assert one["decode"][0]["groups"] == 1 and two["decode"][0]["groups"] == 2
    # Groups of 1 were not run on 1x1: no ratio to them.
    assert "time_ratio_vs_1x1_groups_in_turn" not in two["decode"][0]
    # Two stages hold half the layers each (plus the replicated embedding).
    assert two["memory"]["max_weight_bytes"] < one["memory"]["max_weight_bytes"]
    assert two["memory"]["max_kv_bytes"] == one["memory"]["max_kv_bytes"] // 2


def test_decode_groups_compare_with_the_groups_run_in_turn_on_1x1():
    def job(batch, groups, seconds):
        return {
            "batch": batch,
            "padded_batch": batch,
            "groups": groups,
            "time_s": {"median": seconds},
        }

    meshes = [
        {"mesh": "1x1", "decode": [job(1, 1, 1.0), job(2, 1, 1.5)]},
        {"mesh": "2x1", "decode": [job(1, 1, 1.1), job(2, 2, 2.4)]},
    ]
    add_ratios(meshes)
    one, two = meshes[1]["decode"]
    assert one["time_ratio_vs_1x1"] == pytest.approx(1.1)
    assert "time_ratio_vs_1x1_groups_in_turn" not in one  # one group
    assert two["time_ratio_vs_1x1"] == pytest.approx(2.4 / 1.5)
    assert two["time_ratio_vs_1x1_groups_in_turn"] == pytest.approx(2.4 / (2 * 1.0))


def test_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")  # --plot only; not an install requirement
    plot = tmp_path / "bench.png"
    assert (
        main(
            [
                "bench",
                "--smoke",
                "--scenario",
                "prefill",
                "--prompt-lens",
                "16",
                "--plot",
                str(plot),
                "--targets",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for heading in ("machine:", "prefill", "targets"):
        assert heading in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a PNG image, not an empty file


def test_peer_transformers(capsys):
    # torch is deliberately not a dependency (nor in CI; transformers is in the test
    # extra, for chat templates): the peer scenario is tested only where torch is.
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = run_json(
        capsys,
        "--scenario",
        "prefill",
        "--scenario",
        "decode",
        "--peer",
        "transformers",
        "--prompt-lens",
        "16",
        "--batches",
        "1",
    )
    check_common(out, ["1x1"])
    peer = out["peer"]
    assert peer["threads"] >= 1 and peer["attn_implementation"] == "sdpa"
    assert [j["prompt_len"] for j in peer["prefill"]] == [16]
    assert [j["batch"] for j in peer["decode"]] == [1]
    for job in peer["prefill"] + peer["decode"]:
        for key in (
            "ours_time_s",
            "theirs_time_s",
            "ours_tokens_per_s",
            "theirs_tokens_per_s",
            "speedup",
        ):
            check_spread(job[key])
        assert len(job["speedup_pairs"]) == 2
    (decode,) = peer["decode"]
    speedup = out["targets"]["decode_b1_speedup_vs_peer"]["value"]
    assert speedup == decode["speedup"]["median"] > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--prompt-lens", "0"], "positive"),
        (["--scenario", "peer"], "--peer transformers"),
        (["--mesh", "2x2", "--cpu-devices", "2"], "needs 4 devices"),
        (["--decode-cache-len", "20"], "--decode-cache-len 20 is below the 21 slots"),
        # 0 is refused, not taken for "use the default"
        (["--decode-steps", "0"], "--decode-steps 0 must be at least 1"),
        (["--repeats", "0"], "--repeats 0 must be at least 1"),
        (["--chunk", "0"], "--chunk 0 must be at least 1"),
        (["--decode-prompt-len", "0"], "--decode-prompt-len 0 must be at least 1"),
        (["--prompt-lens", ""], "positive"),
        (["--prompt-lens", "16 32"], "comma-separated"),
        (
            ["--prompt-lens", "5000"],
            "--prompt-lens 5000: a prompt and the token after it need 5001",
        ),
        (["--decode-prompt-len", "4090", "--decode-steps", "8"], "4090 + --decode-steps 8 + 1"),
        (["--serve-max-batch", "0"], "--serve-max-batch 0 must be at least 1"),
        (["--serve-prompt-lens", "9,3"], "MIN,MAX with 1 <= MIN <= MAX"),
        (
            [
                "--scenario",
                "serve",
                "--serve-prompt-lens",
                "4000,4000",
                "--serve-output-lens",
                "200,200",
            ],
            "serve requests need up to 4200 positions",
        ),
        (["--serve-shared-prefix", "16"], "a part of --scenario serve"),
        (["--scenario", "serve", "--serve-shared-prefix", "-1"], "must not be negative"),
        (
            ["--scenario", "serve", "--serve-shared-prefix", "4000"],
            "a conversation's last turn needs 4280 positions",
        ),
    ],
)
def test_bad_input(capsys, argv, words):
    assert main(["bench", "--smoke", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "plot, words",
    [
        ("bench.txt", "image format"),
        ("bench", "image format"),
        ("/no/such/folder/b.png", "there is no folder"),
    ],
)
def test_plot_path_is_checked_before_the_run(capsys, plot, words):
    if "format" in words:
        pytest.importorskip("matplotlib")  # the formats are matplotlib's
    assert main(["bench", "--smoke", "--plot", plot]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --plot") and words in err and "\n" not in err


def test_cp_ring_and_ulysses_side_by_side(capsys):
    """--cp runs every seq mesh once per strategy; each prefill job reports the bytes
    each device received along seq (as pipeline.runtime.cp_cost counts them) and the model's
    time, and the link bandwidth is measured for it. The embed scenario beside it."""
    from qwen3_spmd.pipeline.runtime import cp_cost

    out = run_json(
        capsys,
        "--scenario",
        "prefill",
        "--scenario",
        "roofline",
        "--scenario",
        "embed",
        "--embed-lens",
        "64,64",
        "--prompt-lens",
        "16",
        "--mesh",
        "1x2",
        "--cp",
        "ring",
        "--cp",
        "ulysses",
    )
    assert [m["mesh"] for m in out["meshes"]] == ["1x1", "1x2", "1x2 ulysses"]
    (link,) = out["roofline"]["links"]
    assert link["devices"] == 2
    # --smoke: 1 MiB a device; all-to-all keeps its own half on 2 devices.
    for op, received in (("ppermute", 2**20), ("all_to_all", 2**19)):
        assert link[op]["bytes_received"] == received
        check_spread({k: link[op][k] for k in ("median", "min", "max", "n")}, n=3)
    one, ring, uly = (m["prefill"][0] for m in out["meshes"])
    T = ring["padded_prompt"] // 2  # each device's K, V [T, K, H] and positions [T] int32
    assert ring["cp_bytes_per_device_per_layer"] == T * (2 * TINY.K * TINY.H * 4 + 4)
    assert [j["cp_strategy"] for j in (one, ring, uly)] == ["ring", "ring", "ulysses"]
    assert one["cp_bytes_per_device"] == 0
    from qwen3_spmd.run.models import open_model

    cfg = open_model(None, 0).cfg
    for job in (ring, uly):
        per_layer = cp_cost.bytes_per_layer(job["cp_strategy"], cfg, 2, 1, job["padded_prompt"], 4)
        assert job["cp_bytes_per_device_per_layer"] == per_layer > 0
        assert job["cp_bytes_per_device"] == per_layer * cfg.L
        # At least its bytes at the measured rate of its collective.
        rate = link["ppermute" if job["cp_strategy"] == "ring" else "all_to_all"]["median"]
        assert job["cp_predicted_s"] >= job["cp_bytes_per_device"] / rate
        assert set(job["cp_model"]) == {"ring", "ulysses"}
    check_embed({m["mesh"]: m["embed"] for m in out["meshes"]})
    assert (
        main(["bench", "--smoke", "--scenario", "prefill", "--mesh", "1x3", "--cp", "ulysses"]) == 2
    )
    assert "--mesh 1x3: ulysses: 4 query heads cannot be shared" in capsys.readouterr().err


def test_each_mesh_predicts_with_the_link_of_its_own_seq_size():
    """Emulated devices share the cores, so the link is measured per seq size, and a
    mesh's cost model takes the probe of its own C (none on one device)."""
    from qwen3_spmd.run.bench.jobs import measured_rates

    def probe(C, ppermute, all_to_all):
        return {
            "devices": C,
            "ppermute": {"median": ppermute},
            "all_to_all": {"median": all_to_all},
        }

    roof = {
        "matmul_flops_per_s": {"median": 1e11},
        "links": [probe(2, 4e9, 7e8), probe(4, 2e9, 5e8)],
    }
    assert measured_rates(roof, 4)["link_bytes_per_s"] == {"ppermute": 2e9, "all_to_all": 5e8}
    assert measured_rates(roof, 2)["link_bytes_per_s"] == {"ppermute": 4e9, "all_to_all": 7e8}
    assert measured_rates(roof, 1) == {"link_bytes_per_s": None, "flops_per_s": 1e11}
    assert measured_rates(None, 2) == {}


def test_serve_closed_loops_beside_static_batches(capsys):
    """bench --scenario serve on 2x1: a closed loop per concurrency (1, G, rows, 2 x rows)
    through the scheduler next to static batches of the same requests, each with
    throughputs, latencies and row occupancy, and the targets that need them.

    Prompts of 3 or 4 tokens (--smoke's are 3-12): one prompt length bucket, so the
    loops and the static batches compile one prefill shape per batch size rather than
    one per length (54 s -> 24 s of CPU); the output lengths still differ, so rows
    finish apart and the loops replace them."""
    out = run_json(
        capsys,
        "--scenario",
        "serve",
        "--mesh",
        "2x1",
        "--serve-requests",
        "2",
        "--serve-prompt-lens",
        "3,4",
    )
    for m in out["meshes"]:
        serve = m["serve"]
        G = m["stage"]
        assert serve["max_batch"] == 2 and serve["groups"] == G
        assert [j["concurrency"] for j in serve["concurrency"]] == sorted({1, G, 2, 4})
        # The pool that gives every row its most: [L_pad, rows x pages, K, C x 16, H] for
        # k and v, over the devices; a row's pages fit a 4-token prompt padded to twice
        # (a bucket) and --smoke's 6 outputs.
        S, C, rows = m["stage"], m["seq"], serve["max_batch"]
        L_pad = S * -(-TINY.L // S)
        pages = math.ceil(math.ceil(fitting_seq_len(2 * 4, 6, C) / C) / 16)  # of 16 slots
        slots = pages * 16 * C
        cache = 2 * L_pad * rows * TINY.K * slots * TINY.H * 4
        assert serve["kv_bytes_per_device"] == cache // m["devices"]
        for j in serve["concurrency"]:
            assert j["requests"] == 2 * j["concurrency"] and j["output_tokens"] >= j["requests"]
            for key in ("output_tokens_per_s", "requests_per_s", "time_s"):
                assert 0 < j[key] < math.inf
            assert 0 < j["time_to_first_token_s"]["p50"] <= j["time_to_first_token_s"]["p90"]
            assert in_unit(j["row_occupancy"])
            assert 0 <= j["steady_idle_fraction"] <= j["stage_idle_fraction"] < 1
            drain = j["before_drain"]  # the last of 2c requests goes in after a round
            assert in_unit(drain["row_occupancy"]) and 0 <= drain["stage_idle_fraction"] < 1
            assert j["static"]["output_tokens"] == j["output_tokens"]
            for loop in (j, j["static"]):
                assert loop["output_tokens_per_s"] == loop["output_tokens"] / loop["time_s"]
            speedup = j["output_tokens_per_s"] / j["static"]["output_tokens_per_s"]
            assert j["speedup_vs_static"] == speedup
        equal = serve["static_equal_batch"]
        assert equal["batch"] == 2
        assert equal["output_tokens"] == 2 * equal["new_tokens_per_request"]
        paired = serve["paired"]
        assert paired["concurrency"] == 2
        for ratio in (paired["vs_c1"], paired["vs_static_equal_batch"]):
            assert len(ratio["each"]) == 2 and 0 < min(ratio["each"])  # --smoke: 2 repeats
            assert min(ratio["each"]) <= ratio["median"] <= max(ratio["each"])
    # the 2x1 loops that keep every group's rows full (c >= 2 x rows / G), before the drain
    (two,) = [m["serve"] for m in out["meshes"] if m["mesh"] == "2x1"]
    loaded = [
        j["before_drain"]["stage_idle_fraction"]
        for j in two["concurrency"]
        if j["concurrency"] >= 2 * two["max_batch"] // two["groups"]
    ]
    idle = out["targets"]["serve_loaded_idle_fraction_2x1"]
    assert loaded and idle["value"] == max(loaded) and idle["target"] == "<= 0.1"
    assert idle["met"] is (idle["value"] <= 0.1)
    assert out["targets"]["serve_c8_vs_c1_1x1"]["value"] is None  # rows 2: no c = 8


TINY_FOLDER = str(FIXTURES / "tiny")


def test_structured_load_against_the_same_load_unconstrained(capsys):
    """--scenario structured on the tiny checkpoint (its own byte-level tokenizer): the
    constrained loop, the same prompts unconstrained with the budgets the constrained
    answers took, and every other request constrained, each with its figures."""
    out = run_json(capsys, "--scenario", "structured", "--mesh", "1x1", "--model", TINY_FOLDER)
    (mesh,) = out["meshes"]
    job = mesh["structured"]
    free, full, half = job["unconstrained"], job["constrained"], job["half"]
    assert job["concurrency"] == 2 and full["requests"] == free["requests"] == 2
    assert full["completion_tokens"] == free["completion_tokens"]  # the same tokens to make
    # The host's mask time is part of the loop's (one mask at least was made).
    assert 0 < full["mask_s_per_token"] <= full["time_s"] and "mask_s_per_token" not in free
    ratio = full["output_tokens_per_s"] / free["output_tokens_per_s"]
    assert job["constrained_vs_unconstrained_tokens_per_s"] == ratio > 0
    assert half["unconstrained"]["requests"] == 1  # request 1 of 2 follows no schema
    assert half["unconstrained_requests"] == [1]
    # The others' TPOT against the same request's in the unconstrained loop, a pair of
    # loops a repeat (--smoke: 2), the median quoted.
    t_half, t_free = half["tpot_by_request_s"][1], free["tpot_by_request_s"][1]
    ratios = job["half_others_tpot_ratios"]
    assert len(ratios) == 2 and ratios[-1] == t_half / t_free
    assert job["half_others_tpot_vs_unconstrained"] == float(np.median(ratios))


def check_http_rows(endpoint: dict, concurrencies: list[int]) -> None:
    assert [r["concurrency"] for r in endpoint["concurrency"]] == concurrencies
    for r in endpoint["concurrency"]:
        assert r["failed"] == 0 and r["requests"] == max(r["concurrency"], 2)  # --smoke: 1 each
        assert r["output_tokens"] >= r["requests"] and 0 < r["time_s"] < math.inf
        assert r["output_tokens_per_s"] == r["output_tokens"] / r["time_s"]
        for key in ("ttft_s", "latency_s", "itl_s"):
            p = r[key]
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"] < math.inf
        assert r["ttft_s"]["p50"] <= r["latency_s"]["p50"]


def run_http(capsys, concurrency: str, *argv) -> dict:
    """bench --scenario serve --url local on the tiny checkpoint, its JSON report."""
    return run_json(
        capsys,
        "--scenario",
        "serve",
        "--url",
        "local",
        "--model",
        TINY_FOLDER,
        "--serve-concurrency",
        concurrency,
        *argv,
    )


def test_serve_over_http_starts_and_loads_our_server(capsys):
    """--url local: `qwen3-spmd serve` on the tiny checkpoint, loaded over HTTP (with
    --smoke, a server that compiles lazily)."""
    out = run_http(capsys, "1,2")
    (ours,) = out["http"]["endpoints"]
    assert ours["name"] == "qwen3-spmd" and ours["model"] == "tiny"
    check_http_rows(ours, [1, 2])
    assert out["http"]["targets"] == {}  # no peer, no ratio


def test_serve_over_http_beside_transformers_serve(capsys):
    # transformers serve needs torch and accelerate too: not dependencies (nor in CI),
    # so this runs only where they are installed.
    for module in ("torch", "transformers", "accelerate"):
        pytest.importorskip(module)
    out = run_http(capsys, "8", "--peer", "transformers")
    ours, peer = out["http"]["endpoints"]
    assert peer["name"] == "transformers"
    check_http_rows(ours, [8])
    check_http_rows(peer, [8])
    ratio = (
        ours["concurrency"][0]["output_tokens_per_s"]
        / peer["concurrency"][0]["output_tokens_per_s"]
    )
    assert out["http"]["targets"]["serve_http_c8_vs_transformers"]["value"] == ratio > 0


def test_url_goes_with_the_serve_scenario_only(capsys):
    assert main(["bench", "--url", "local", "--scenario", "decode"]) == 2
    assert "only --scenario serve" in capsys.readouterr().err


def test_prompt_logprobs_scenario_times_a_prefill_with_and_without(capsys):
    """--scenario prompt_logprobs: each prompt length's prefill scored and plain, in one
    run, and their ratio."""
    out = run_json(capsys, "--scenario", "prompt_logprobs", "--prompt-lens", "16", cache=False)
    (job,) = out["meshes"][0]["prompt_logprobs"]
    assert (job["prompt_len"], job["batch"]) == (16, 1)
    check_spread(job["plain_s"])
    check_spread(job["scored_s"])
    assert job["ratio"] == job["scored_s"]["median"] / job["plain_s"]["median"] > 0


def check_embed(meshes: dict) -> None:
    """--scenario embed on 1x1 and 1x2 (ring, Ulysses): each mesh's pass over the inputs
    (their tokens, the rows), input tokens/s from its time, the same first embedding, and
    the longest input's activations and K/V a device: on 1x2 less than on 1x1 (each
    device its share of the input), with the ratios to 1x1."""
    assert set(meshes) == {"1x1", "1x2", "1x2 ulysses"}
    one = meshes["1x1"]
    for job in meshes.values():
        assert job["inputs"] == 3 and job["tokens"] == 3 * 64 and job["lens"] == [64, 64]
        check_spread(job["time_s"])
        assert job["tokens_per_s"] == pytest.approx(job["tokens"] / job["time_s"]["median"])
        assert np.linalg.norm(job["first_embedding"]) == pytest.approx(1.0)
        np.testing.assert_allclose(job["first_embedding"], one["first_embedding"], atol=1e-5)
        memory = job["longest_prefill_activations_and_kv_per_device"]
        base = one["longest_prefill_activations_and_kv_per_device"]
        assert job["memory_ratio_vs_1x1"] == pytest.approx(memory / base)
    for mesh in ("1x2", "1x2 ulysses"):
        assert 0 < meshes[mesh]["memory_ratio_vs_1x1"] < 1
