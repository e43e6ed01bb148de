"""tools/: the scripts beside the package (not installed), on made-up reports."""

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_bench_reads_each_job_and_the_bandwidth():
    ab = load("ab_bench")
    spread = lambda v: {"median": v, "min": v, "max": v, "n": 1}  # noqa: E731
    report = {
        "roofline": {"bandwidth_bytes_per_s": spread(20e9)},
        "meshes": [
            {
                "mesh": "1x1",
                "prefill": [{"prompt_len": 512, "tokens_per_s": spread(300.0)}],
                "decode": [
                    {"batch": 1, "tokens_per_s": spread(6.5)},
                    {"batch": 8, "tokens_per_s": spread(30.0)},
                ],
            }
        ],
    }
    assert ab.figures(report) == {
        "1x1 prefill P=512 tok/s": 300.0,
        "1x1 decode B=1 tok/s": 6.5,
        "1x1 decode B=8 tok/s": 30.0,
        "bandwidth GB/s": 20.0,
    }


def test_ab_bench_refuses_no_rounds():
    with pytest.raises(SystemExit):
        load("ab_bench").main(["a", "b", "--rounds", "0", "--", "--model", "tiny"])
