"""The `ring` demo subcommand, run in-process through its argparse registration."""

import argparse
import json

import pytest

from qwen3_spmd.run import ring_demo


def _parse(*argv):
    parser = argparse.ArgumentParser()
    ring_demo.register(parser.add_subparsers())
    return parser.parse_args(["ring", *argv])


def test_defaults_reproduce_design_numbers(capsys):
    args = _parse("--json")
    assert args.func is ring_demo.main
    assert (args.heads, args.seq, args.dim, args.devices, args.batch, args.seed) == (
        4,
        64,
        32,
        4,
        1,
        0,
    )
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)["partitions"]
    assert report["contiguous"]["work"] == [136, 392, 648, 904]
    assert report["zigzag"]["work"] == [520, 520, 520, 520]
    assert report["contiguous"]["blocks"] == [3, 7, 11, 15]
    assert report["zigzag"]["blocks"] == [9, 9, 9, 9]
    assert all(r["max_error"] <= 1e-5 for r in report.values())


def test_table_output_padded_batch(capsys):
    args = _parse("--seq", "13", "--devices", "2", "--batch", "2", "--heads", "3", "--dim", "8")
    assert ring_demo.main(args) == 0
    out = capsys.readouterr().out
    assert "contiguous" in out and "zigzag" in out and "max error" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--devices", "64"), "--devices 64"),
        (("--heads", "0"), "--heads must be at least 1"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, argv, message):
    assert ring_demo.main(_parse(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and captured.err.count("\n") == 1
