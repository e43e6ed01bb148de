"""`qwen3-spmd`: the command line.

Subcommands register themselves (each module has `register(subparsers)`). Flags that
shape the JAX runtime (`--cpu-devices`) act right after parsing, before anything
touches a JAX backend. Bad input ends with one line on stderr and exit status 2;
`--debug` (before or after the subcommand) also shows the traceback. An unknown flag's
line names the nearest real one and the subcommand's `--help`.

Building the parser imports no JAX (no subcommand module imports it at its top, nor
anything of the library that does): `--help` and flag errors answer before JAX would
have loaded; tests/run/test_cli.py checks it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import traceback

from qwen3_spmd.run import convert, embed, generate, ring_demo
from qwen3_spmd.run.bench import command as bench
from qwen3_spmd.run.flags import CLIError, in_flags
from qwen3_spmd.run.flags import size_cpu_threads as size_cpu_threads  # tests/conftest.py's
from qwen3_spmd.run.plan import command as plan
from qwen3_spmd.run.serve import command as serve

SUBCOMMANDS = (generate, ring_demo, bench, convert, serve, embed, plan)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def unknown(self, extras: list[str]):
        """Exits on flags this (sub)command does not know, naming the nearest real one."""
        flags = [a for a in extras if a.startswith("-")]
        known = list(self._option_string_actions)
        near = difflib.get_close_matches(flags[0].split("=")[0], known, n=1) if flags else []
        hint = f": did you mean {near[0]}?" if near else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qwen3-spmd",
        description="Qwen3 inference in JAX over a (stage, seq, tensor) device mesh: "
        "pipeline parallelism, ring and Ulysses attention, decode context parallelism, "
        "tensor and expert parallelism.",
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


# The errors of bad input, each a line on stderr: (module, class) besides CLIError.
KNOWN_ERRORS = (
    ("qwen3_spmd.model.config", "ConfigError"),
    ("qwen3_spmd.model.checkpoint.hf", "LoadError"),
    ("qwen3_spmd.pipeline.requests", "RequestError"),  # SamplingError too
    ("qwen3_spmd.run.text", "TextError"),
    ("qwen3_spmd.sharding.mesh", "MeshError"),
    ("qwen3_spmd.sharding.stages", "PlanError"),
    ("qwen3_spmd.model.split", "TensorError"),
)


def _known_errors() -> tuple[type[BaseException], ...]:
    # Only the classes of modules loaded by now: an error of a module never imported
    # cannot have been raised, and importing them would load JAX and Flax for a flag's
    # error that came before them.
    return (
        CLIError,
        FileNotFoundError,
        *(getattr(sys.modules[m], name) for m, name in KNOWN_ERRORS if m in sys.modules),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # the subcommand's flags are the ones meant: its parser says so
            commands = parser._subparsers._group_actions[0].choices
            (commands.get(args.command) or parser).unknown(extras)
    except SystemExit as e:  # --help, or a usage error (printed already)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    # What a run of several processes re-runs as its supervised child
    # (run.distributed.supervise): this process's own command line; None when called
    # from Python with another.
    given = sys.argv[1:] if argv is None else list(argv)
    args.command_line = given if given == sys.argv[1:] else None
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
