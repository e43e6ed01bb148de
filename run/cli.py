"""`qwen3-spmd`: the command line.

Subcommands register themselves (each module has `register(subparsers)`). Flags that
shape the JAX runtime (`--cpu-devices`) act right after parsing, before anything
touches a JAX backend. Bad input ends with one line on stderr and exit status 2;
`--debug` (before or after the subcommand) also shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.run import convert, generate, plan, ring_demo
from qwen3_spmd.run.bench import command as bench
from qwen3_spmd.run.flags import CLIError, in_flags
from qwen3_spmd.run.flags import size_cpu_threads as size_cpu_threads  # tests/conftest.py's
from qwen3_spmd.run.serve import command as serve

SUBCOMMANDS = (generate, ring_demo, bench, convert, serve, plan)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qwen3-spmd",
        description="Qwen3 inference in JAX over a (stage, seq) device mesh: pipeline "
        "parallelism, ring attention, decode context parallelism.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(sub)
    for command in sub.choices.values():  # --debug after the subcommand works too
        command.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show tracebacks of errors",
        )
    return parser


def _known_errors() -> tuple[type[BaseException], ...]:
    # Imported once an error is met: the checkpoint loader's module loads Flax, which
    # `--help` and the argument errors need not wait for.
    from qwen3_spmd.model.checkpoint.hf import LoadError
    from qwen3_spmd.model.config import ConfigError
    from qwen3_spmd.model.split import TensorError
    from qwen3_spmd.run.text import TextError
    from qwen3_spmd.sharding.mesh import MeshError
    from qwen3_spmd.sharding.plan import PlanError

    return (
        CLIError,
        ConfigError,
        LoadError,
        RequestError,  # SamplingError too
        TextError,
        MeshError,
        PlanError,
        TensorError,
        FileNotFoundError,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error (printed already)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): stop quietly, as a program killed by
        # SIGPIPE does, and keep Python's exit-time flush from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except _known_errors() as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {in_flags(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
