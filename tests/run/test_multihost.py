"""Several processes, one mesh: `generate` over jax.distributed (gloo on CPU, 127.0.0.1).

Each process is `python -m qwen3_spmd.run generate ...` with its own emulated CPU devices
(the session's device count removed from XLA_FLAGS, so --cpu-devices decides). Each costs
several seconds of start-up and compilation, so runs are few and requests short.
"""

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
from children import child_env
from ports import free_port
from reference import FIXTURES, ROOT, TINY
from safetensors import safe_open

from qwen3_spmd.run.cli import main

REF = np.load(TINY / "reference.npz")
PROMPTS = [REF[f"prompt_{i}"].tolist() for i in range(3)]
NEW = 8
ENV = child_env()


def spawn(argv, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "qwen3_spmd.run", "generate", *argv],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def job(n: int, port: int, argv, peer_timeout: float = 30) -> list[subprocess.Popen]:
    return [
        spawn(
            [
                *argv,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(n),
                "--process-id",
                str(i),
                "--peer-timeout",
                str(peer_timeout),
            ]
        )
        for i in range(n)
    ]


def finish(procs, timeout=240) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


def reference_argv(mesh: str, cpu_devices: int) -> list[str]:
    argv = [
        "--model",
        str(TINY),
        "--mesh",
        mesh,
        "--cpu-devices",
        str(cpu_devices),
        "--max-new-tokens",
        str(NEW),
        "--json",
    ]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    return argv


def tokens(report: dict) -> list[list[int]]:
    return [r["token_ids"] for r in report["requests"]]


REFERENCE_TOKENS = [REF[f"greedy_tokens_{i}"].tolist()[:NEW] for i in range(3)]


def run_two(mesh: str, cpu_devices: int) -> dict:
    (rc0, out0, err0), (rc1, out1, err1) = finish(
        job(2, free_port(), reference_argv(mesh, cpu_devices))
    )
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    assert out1 == "" and err1 == ""  # only process 0 prints
    assert err0 == ""  # --json: nothing on stderr either (no gloo or XLA chatter)
    return json.loads(out0)


def test_2x2_over_two_processes_gives_the_one_process_tokens():
    """The tokens are transformers', which one process gives on 2x2 and on 1x1 too
    (tests/pipeline/runtime/test_engine_mesh.py, the README's demo)."""
    report = run_two("2x2", 2)
    mesh = {"data": 1, "stage": 2, "seq": 2, "tensor": 1}
    assert report["processes"] == 2 and report["mesh"] == mesh
    assert report["stage_processes"] == [[0], [1]]  # process 0's two devices are stage 0
    assert tokens(report) == REFERENCE_TOKENS  # the transformers reference = the 1x1 run


def _tensor_bytes(names) -> int:
    with safe_open(TINY / "model.safetensors", framework="numpy") as f:
        return sum(f.get_slice(n)[...].nbytes for n in names)


def test_2x1_over_two_processes_each_reads_only_its_stage():
    report = run_two("2x1", 1)
    assert tokens(report) == REFERENCE_TOKENS
    assert report["stage_processes"] == [[0], [1]]
    with safe_open(TINY / "model.safetensors", framework="numpy") as f:
        names = list(f.keys())
    shared = [n for n in names if not n.startswith("model.layers.")]
    expected = []
    for first, last in report["stage_layers"]:
        mine = [
            n
            for n in names
            if n.startswith("model.layers.") and first <= int(n.split(".")[2]) <= last
        ]
        expected.append(_tensor_bytes(shared) + _tensor_bytes(mine))
    assert report["weight_bytes_read_per_process"] == expected
    assert sum(expected) < 2 * _tensor_bytes(names)  # neither process read everything


def test_1x1x2_over_two_processes_each_reads_its_tensor_rows():
    """`tensor` spans the processes (one device each): each reads its 3 of 6 query heads,
    1 of 2 KV heads, 52 of 104 MLP columns, its vocabulary rows (331 padded to 332: rows
    0-165 and 166-330) and every norm; the tokens are 1x1's."""
    report = run_two("1x1x2", 1)
    assert tokens(report) == REFERENCE_TOKENS
    with safe_open(TINY / "model.safetensors", framework="numpy") as f:
        names = list(f.keys())
        shapes = {n: f.get_slice(n).get_shape() for n in names}
    norms = [n for n in names if n.endswith("norm.weight")]
    vocab = [n for n in names if n in ("model.embed_tokens.weight", "lm_head.weight")]
    split = [n for n in names if n not in norms and n not in vocab]
    row = 4 * shapes[vocab[0]][1]  # float32 bytes of one vocabulary row
    expected = [
        _tensor_bytes(norms) + _tensor_bytes(split) // 2 + len(vocab) * rows * row
        for rows in (166, 165)
    ]
    assert report["weight_bytes_read_per_process"] == expected
    assert sum(expected) == _tensor_bytes(names) + _tensor_bytes(norms)


def test_moe_2x1x1x1_over_two_processes_each_holds_a_replica_and_half_the_experts():
    """`data` spans the processes (one device each), Qwen3-MoE (`moe`: 8 experts): each
    process holds a replica, reads every weight but the other's 4 experts of each
    sparse layer (the all-to-all split over data, its default with replicas), decodes
    its own rows (the book deals them in turn) and sends its tokens to the other's
    experts across the processes; the tokens are transformers'."""
    moe = FIXTURES / "moe"
    ref = np.load(moe / "reference.npz")
    argv = ["--model", str(moe), "--mesh", "2x1x1x1", "--cpu-devices", "1", "--json"]
    argv += ["--max-new-tokens", str(int(ref["max_new_tokens"]))]
    n = int(ref["num_prompts"])
    for i in range(n):
        argv += ["--prompt-ids", ",".join(map(str, ref[f"prompt_{i}"].tolist()))]
    (rc0, out0, err0), (rc1, out1, err1) = finish(job(2, free_port(), argv))
    assert rc0 == 0 and rc1 == 0 and out1 == "", (err0, err1)
    report = json.loads(out0)
    assert tokens(report) == [ref[f"greedy_tokens_{i}"].tolist() for i in range(n)]
    assert report["mesh"] == {"data": 2, "stage": 1, "seq": 1, "tensor": 1}
    assert report["stage_processes"] == [[0, 1]]  # stage 0 of both replicas
    with safe_open(moe / "model.safetensors", framework="numpy") as f:
        sizes = {k: f.get_slice(k)[...].nbytes for k in f.keys()}
    expert = [re.search(r"\.experts\.(\d+)\.", k) for k in sizes]
    shared = sum(s for s, e in zip(sizes.values(), expert) if e is None)
    half = [
        sum(s for s, e in zip(sizes.values(), expert) if e and int(e[1]) // 4 == p) for p in (0, 1)
    ]
    assert report["weight_bytes_read_per_process"] == [shared + half[0], shared + half[1]]
    assert report["kv_cache"]["replicas"] == 2 and report["layout"]["batch"] == 4
    assert report["bytes_all_to_all_per_device"]["decode_per_step"] > 0


def test_1x2_over_two_processes_ring_crosses_them():
    report = run_two("1x2", 1)
    assert tokens(report) == REFERENCE_TOKENS
    assert report["stage_processes"] == [[0, 1]]


def test_speculative_rounds_over_two_processes_give_plain_tokens(capsys):
    """ngram speculation on 2x1 over two processes: each process drafts from the same
    tokens and verifies the same rows, and the tokens are one process's plain ones."""
    argv = reference_argv("2x1", 1)
    argv[argv.index("--max-new-tokens") + 1] = "16"  # room for the drafts to be taken
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    (rc0, out0, err0), (rc1, out1, err1) = finish(
        job(2, free_port(), [*argv, "--speculative-config", config])
    )
    assert rc0 == 0 and rc1 == 0 and out1 == "", (err0, err1)
    report = json.loads(out0)
    spec = report["speculative"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
    plain = [*argv[: argv.index("--mesh")], "--mesh", "1x1", *argv[argv.index("--mesh") + 2 :]]
    assert main(["generate", *plain]) == 0
    assert tokens(report) == tokens(json.loads(capsys.readouterr().out))


def test_losing_a_peer_ends_the_other_with_one_line():
    port, timeout = free_port(), 10  # long enough for a loaded 2-core machine to keep heartbeats
    argv = [
        "--mesh",
        "2x2",
        "--cpu-devices",
        "2",
        "--prompt-ids",
        "1,2,3",
        "--chunk",
        "1",
        "--max-new-tokens",
        "400",
        "--max-seq-len",
        "420",
    ]
    p0, p1 = job(2, port, argv, peer_timeout=timeout)
    try:
        first = p0.stdout.readline() + p0.stdout.readline()  # model, mesh
        assert "2 processes" in first, first
        if not p0.stdout.read(8):  # streamed tokens: generation is under way
            p1.kill()
            raise AssertionError(f"process 0 ended before generating: {p0.communicate()[1]}")
        p1.kill()
        killed = time.monotonic()
        _, err = p0.communicate(timeout=timeout + 30)
        elapsed = time.monotonic() - killed
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert p0.returncode == 1
    line = err.strip()
    assert "\n" not in line and line.startswith("error: lost process 1"), err
    assert f"127.0.0.1:{port}" in line
    assert elapsed < timeout + 20  # the heartbeat timeout, plus a loaded machine's slack


def test_start_up_errors_are_one_line_exit_2(capsys):
    # Flags alone: said before any process starts to wait.
    assert (
        main(
            [
                "generate",
                "--coordinator",
                "127.0.0.1:1",
                "--num-processes",
                "2",
                "--process-id",
                "2",
            ]
        )
        == 2
    )
    assert "--process-id 2 is not among the 2 processes" in capsys.readouterr().err
    assert main(["generate", "--coordinator", "127.0.0.1:1", "--num-processes", "2"]) == 2
    assert "--process-id" in capsys.readouterr().err
    # Waiting that cannot succeed: all at once, each bounded by --peer-timeout.
    base = ["--mesh", "2x2", "--cpu-devices", "2", "--peer-timeout", "2"]
    lone, odd = free_port(), free_port()
    procs = [
        # nobody serves this port
        spawn(
            [
                *base,
                "--coordinator",
                f"127.0.0.1:{free_port()}",
                "--num-processes",
                "2",
                "--process-id",
                "1",
            ]
        ),
        # process 0 of 2, but the other never comes
        spawn(
            [
                *base,
                "--coordinator",
                f"127.0.0.1:{lone}",
                "--num-processes",
                "2",
                "--process-id",
                "0",
            ]
        ),
        # process 0 expects 2 processes; the other one believes there are 4
        spawn(
            [
                *base,
                "--coordinator",
                f"127.0.0.1:{odd}",
                "--num-processes",
                "2",
                "--process-id",
                "0",
            ]
        ),
        spawn(
            [
                "--mesh",
                "2x2",
                "--cpu-devices",
                "1",
                "--peer-timeout",
                "2",
                "--coordinator",
                f"127.0.0.1:{odd}",
                "--num-processes",
                "4",
                "--process-id",
                "3",
            ]
        ),
    ]
    t0 = time.monotonic()
    results = finish(procs, timeout=120)
    assert time.monotonic() - t0 < 90
    errors = [err.strip() for _, _, err in results]
    assert [rc for rc, _, _ in results] == [2, 2, 2, 2], errors
    assert all(e.startswith("error: ") and "\n" not in e for e in errors), errors
    assert "could not join the coordinator at 127.0.0.1:" in errors[0]
    assert f"not all 2 processes joined at 127.0.0.1:{lone}" in errors[1]
    assert f"127.0.0.1:{odd}" in errors[2]
    assert "does not expect process 3" in errors[3] or "could not join" in errors[3], errors[3]


def test_interrupt_is_one_line_exit_130():
    port = free_port()
    argv = [
        "--mesh",
        "1x2",
        "--cpu-devices",
        "1",
        "--prompt-ids",
        "1,2,3",
        "--chunk",
        "1",
        "--max-new-tokens",
        "400",
        "--max-seq-len",
        "420",
    ]
    procs = job(2, port, argv, peer_timeout=5)
    try:
        p0 = procs[0]
        p0.stdout.readline()
        p0.stdout.readline()
        assert p0.stdout.read(4)
        for p in procs:
            p.send_signal(signal.SIGINT)
        results = finish(procs, timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, _, err in results:
        assert rc == 130 and err.strip() == "interrupted", (rc, err)
