"""The command line: the JSON contract, the demo, --check, --logits-out, bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from children import child_env
from reference import FIXTURES, ROOT

from qwen3_spmd.run.cli import main

COMMANDS = ("generate", "serve", "bench", "convert", "plan", "ring")


def run_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_contract_matches_transformers(capsys, tmp_path):
    ref = np.load(FIXTURES / "tiny" / "reference.npz")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    argv = [
        "--model",
        str(FIXTURES / "tiny"),
        "--mesh",
        "1x1",
        "--max-new-tokens",
        "8",
        "--logits-out",
        str(tmp_path / "logits.npy"),
    ]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = run_json(capsys, *argv)
    assert out["mesh"] == {"data": 1, "stage": 1, "seq": 1, "tensor": 1}
    assert out["stage_layers"] == [[0, 4]]
    for i, req in enumerate(out["requests"]):
        assert req["prompt_ids"] == prompts[i]
        assert req["token_ids"] == ref[f"greedy_tokens_{i}"].tolist()
        assert req["finish_reason"] == "length"
        assert isinstance(req["text"], str)
    assert set(out["timing"]) >= {
        "compile_s",
        "prefill_s",
        "decode_s",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
    }
    assert all(v > 0 for v in out["timing"].values())
    logits = np.load(tmp_path / "logits.npy")
    assert logits.shape == (8, ref["step_logits_0"].shape[1]) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref["step_logits_0"], atol=1e-4)


def test_demo_on_2x2_matches_single_device(capsys):
    out = run_json(capsys, "--mesh", "2x2", "--check", "--max-new-tokens", "6")
    assert out["model"]["random_weights"] is True
    assert out["matches_single_device"] is True
    assert out["max_error_vs_single_device"] < 1e-4
    assert out["stage_layers"] == [[0, 1], [2, 3]]
    assert out["schedule"]["prefill"]["idle_fraction"] == pytest.approx(0.5)
    assert out["schedule"]["decode"]["steady_idle_fraction"] == 0.0
    assert out["kv_bytes_per_device"] > 0 and out["weight_bytes_per_device"] > 0
    pool = out["kv_cache"]  # a static batch: each row its max_seq_len of pages of 16 x 2
    assert pool["page_tokens"] == 32 and pool["tokens"] == 32 * pool["pages"]
    assert pool["max_concurrency"] == int(pool["max_concurrency"]) >= len(out["requests"])
    # Its prompts are text, through Qwen3's tokenizer; its replies decoded text (noise).
    assert out["requests"][0]["prompt_ids"] == [785, 14796, 27455]  # "The river flows"
    assert all(isinstance(r["text"], str) for r in out["requests"])


def test_chat_prompt_uses_template(capsys):
    out = run_json(
        capsys,
        "--model",
        str(FIXTURES / "tiny"),
        "--mesh",
        "1x1",
        "--prompt",
        "Hi",
        "--chat",
        "--no-thinking",
        "--max-new-tokens",
        "2",
    )
    ids = out["requests"][0]["prompt_ids"]
    # <|im_start|>user ... <|im_start|>assistant, then the empty <think>\n\n</think>\n\n
    # that Qwen3's template adds for enable_thinking=False.
    assert ids[0] == 301 and ids[-6:] == [303, 198, 198, 304, 198, 198]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "/no/such/folder"], "no such folder"),
        (["--prompt-ids", "1,2,x"], "comma-separated"),
        (["--prompt-ids", "1 2 3"], "comma-separated"),  # not the one token 123
        (["--prompt-ids", "1,,2"], "comma-separated"),
        (["--prompt-ids", "1,2", "--temperature", "nan"], "--temperature nan"),
        (["--prompt-ids", ""], "empty"),
        (["--prompt-ids", "1,2,200000"], "outside the vocabulary"),  # the demo's: 151,936
        (["--prompt-ids", "1,2", "--max-new-tokens", "50", "--max-seq-len", "20"], "--max-seq-len"),
        # the library names its parameters (top_p, chunk); the command line, its flags
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "error: --top-p 1.5 must be in (0, 1]"),
        (["--prompt-ids", "1,2", "--chunk", "0"], "error: --chunk 0 must be at least 1"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "error: --max-new-tokens 0 must be"),
        (["--prompt-ids", "1,2", "--dtype", "float16"], "--dtype"),
        (["--prompt-ids", "1,2", "--mesh", "3"], "SxC"),
        (["--prompt-ids", "1,2", "--mesh", "3x3"], "9 devices"),
        (["--prompt-ids", "1,2", "--mesh", "8x1"], "stages"),
        # docs/parallelism.md's Ulysses example, as printed there
        (
            ["--model", "0.6B", "--prompt-ids", "1,2,3", "--mesh", "1x3", "--cp", "ulysses"],
            "error: ulysses: 16 query heads cannot be shared equally by 3 seq devices; use "
            "--cp ring, or a seq size that divides 16 (1, 2, 4, 8, 16)",
        ),
        (["--prompt-ids", "1,2", "--mesh", "2x2", "-tp", "2"], "--tensor-parallel-size says 2"),
        # all-to-all experts over data x tensor (the default with replicas): 6 over 4
        (
            ["--model", str(FIXTURES / "moe_tied"), "--prompt-ids", "1,2", "--mesh", "4x1x1x1"],
            "error: tensor 1: its 6 experts cannot be shared equally by 4 x 1 data x tensor "
            "devices (or split each expert's columns: expert split 'tp'); use a data size",
        ),
        (["--model", "tiny", "--prompt", "hello"], "tokenizer"),  # a preset: ids only
        (["--prompt-ids", "1,2", "--no-thinking"], "add --chat"),
        (["--prompt-ids", "1,2", "--cpu-devices", "0"], "--cpu-devices 0 must be at least 1"),
        # outputs are checked before the work, whose result would otherwise be lost
        (["--prompt-ids", "1,2", "--logits-out", "/no/such/folder/l.npy"], "there is no folder"),
        (["--prompt-ids", "1,2", "--logits-out", str(FIXTURES)], "is a folder"),
        (
            ["--prompt-ids", "1,2", "--profile", str(FIXTURES / "tiny" / "config.json")],
            "cannot make that folder",
        ),
        # argparse's own errors, one line too
        (["--prompt-ids", "1,2", "--max-new-tokens", "x"], "invalid int value"),
        (["--prompt-ids", "1,2", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err


# One child runs every line: (argv, exit status, words its output holds). The unknown
# flag's line names the nearest real flag and the subcommand's help, not the top level's.
ANSWERED_AT_ONCE = [
    (["--help"], 0, "generate"),
    *(([c, "--help"], 0, "usage: qwen3-spmd " + c) for c in COMMANDS),
    (
        ["generate", "--max-new-tokns", "4"],
        2,
        "did you mean --max-new-tokens? (see qwen3-spmd generate --help)",
    ),
    (["serve", "--max-batch", "0"], 2, "--max-batch 0 must be at least 1"),
    (["serve", "--max-num-seqs", "0"], 2, "--max-batch 0 must be at least 1"),  # vLLM's name
    (["generate", "--max-model-lenn", "9"], 2, "did you mean --max-model-len?"),
    (["bench", "--cp", "rung"], 2, "invalid choice"),
]


def test_help_and_flag_errors_answer_before_jax_loads():
    """`--help`, each subcommand's, and flag errors come before JAX is imported (which
    takes seconds): measured in a fresh process by what it imported, not by a clock."""
    script = (
        "import contextlib, io, json, sys\n"
        "from qwen3_spmd.run.cli import main\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    text = io.StringIO()\n"
        "    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):\n"
        "        code = main(argv)\n"
        "    out.append([code, text.getvalue()])\n"
        "print(json.dumps({'runs': out, 'loaded': [m for m in ('jax', 'flax') if m in sys.modules]}))\n"
    )
    argvs = [argv for argv, _, _ in ANSWERED_AT_ONCE]
    child = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    for (argv, code, words), (got, text) in zip(ANSWERED_AT_ONCE, result["runs"]):
        assert (got, words in text) == (code, True), (argv, text)
    assert result["loaded"] == []


def test_folder_without_config(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_console_script_sets_cpu_devices_before_jax_starts():
    # No model and no prompt: the demo, on an emulated 2x2 CPU mesh, checked and drawn.
    env = child_env()
    out = subprocess.run(
        [sys.executable, "-m", "qwen3_spmd.run", "generate", "--max-new-tokens", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "mesh 2x2 (stage x seq) over 4 CPU devices" in out.stdout
    assert "stage 0: layers 0-1" in out.stdout and "stage 1: layers 2-3" in out.stdout
    assert "timeline" in out.stdout and "KV cache bytes per device" in out.stdout
    assert "bytes between stages" in out.stdout
    assert "(hidden states at 4 bytes per value)" in out.stdout  # float32
    assert "matches_single_device: true" in out.stdout
    assert "Qwen3's real tokenizer, but random weights, so the text is noise" in out.stdout


def test_several_requests_print_each_when_done(capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(FIXTURES / "tiny"),
                "--mesh",
                "1x1",
                "--prompt-ids",
                "1,2,3",
                "--prompt-ids",
                "4,5",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("[0] (3 prompt tokens -> 3 new") == 1
    assert out.count("[1] (2 prompt tokens -> 3 new") == 1


def test_profile_writes_a_trace(capsys, tmp_path):
    assert (
        main(
            [
                "generate",
                "--mesh",
                "1x1",
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "2",
                "--json",
                "--profile",
                str(tmp_path / "trace"),
            ]
        )
        == 0
    )
    json.loads(capsys.readouterr().out)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))


def test_bad_distributed_flags_are_one_line_exit_2(capsys):
    for argv, words in [
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
        (["--num-processes", "2", "--process-id", "0"], "--coordinator"),
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"],
            "--process-id 5",
        ),
        (["--peer-timeout", "0"], "--peer-timeout"),
        (["--peer-timeout", "nan"], "--peer-timeout"),
        (["--peer-timeout", "inf"], "--peer-timeout"),
    ]:
        assert main(["generate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and "\n" not in err


def test_a_second_run_reads_its_programs_from_the_compile_cache(tmp_path):
    """Two runs with one --compile-cache folder: the first compiles and writes its
    programs there, the second reads them back (and gives the same tokens)."""
    argv = [
        sys.executable,
        "-m",
        "qwen3_spmd.run",
        "generate",
        "--model",
        str(FIXTURES / "tiny"),
        "--mesh",
        "1x2",
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "5",
        "--json",
        "--compile-cache",
        str(tmp_path / "xla"),
    ]
    # None of the session's cache settings (tests/conftest.py): JAX's defaults, as a user
    # runs it, and a first run that compiles.
    session = ("QWEN3_SPMD_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")
    session += ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if k not in session}
    runs = []
    for _ in range(2):
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout))
    first, second = runs
    assert first["compile_cache"] == {"dir": str(tmp_path / "xla"), "programs_read": 0}
    assert list((tmp_path / "xla").iterdir())
    assert second["compile_cache"]["programs_read"] >= 2  # prefill and decode at least
    assert second["requests"][0]["token_ids"] == first["requests"][0]["token_ids"]


def test_compile_cache_off_and_unusable(capsys, tmp_path):
    assert (
        main(
            [
                "generate",
                "--mesh",
                "1x1",
                "--prompt-ids",
                "1,2",
                "--max-new-tokens",
                "2",
                "--json",
                "--compile-cache",
                "off",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["compile_cache"] == {"dir": None, "programs_read": 0}
    (tmp_path / "file").write_text("")
    assert (
        main(
            [
                "generate",
                "--mesh",
                "1x1",
                "--prompt-ids",
                "1,2",
                "--compile-cache",
                str(tmp_path / "file" / "xla"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --compile-cache") and "\n" not in err
