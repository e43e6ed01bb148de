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


class CLIError(ValueError):
    """Bad command-line input: the message names the problem and the fix."""


def _subcommands():
    from qwen3_spmd.run import convert, generate, ring_demo
    from qwen3_spmd.run.bench import command as bench
    from qwen3_spmd.run.serve import command as serve

    return [generate, ring_demo, bench, convert, serve]


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
    for module in _subcommands():
        module.register(sub)
    for command in sub.choices.values():  # --debug after the subcommand works too
        command.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show tracebacks of errors",
        )
    return parser


def int_list(text: str, flag: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3] (a trailing comma is allowed; '' is []). Anything else
    between the commas, '1 2' included, is an error naming the flag."""
    items = text.strip().removesuffix(",").split(",") if text.strip() else []
    try:
        return [int(t) for t in items]
    except ValueError:
        raise CLIError(
            f"{flag} {text!r} is not a comma-separated list of integers (e.g. 1,2,3)"
        ) from None


def check_output_file(path: str, flag: str) -> None:
    """Before any work: a file can be written at `path` (else the work's result would be
    lost at the end)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path} is a folder: give a file name")
    if not os.path.isdir(parent):
        raise CLIError(
            f"{flag} {path}: there is no folder {parent}: create it, or choose another path"
        )
    if not os.access(parent, os.W_OK):
        raise CLIError(f"{flag} {path}: the folder {parent} is not writable: choose another path")


def check_output_folder(path: str, flag: str) -> None:
    """Before any work: `path` is (or is made) a writable folder."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CLIError(
            f"{flag} {path}: cannot make that folder ({e.strerror}): choose another path"
        ) from None
    if not os.access(path, os.W_OK):
        raise CLIError(f"{flag} {path}: the folder is not writable: choose another path")


def platform_is_cpu() -> bool:
    """Whether JAX will run on the CPU, decided without starting a backend (which would
    fix the device count before --cpu-devices can set it)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] == "cpu"
    import importlib.util

    return not any(
        importlib.util.find_spec(m)
        for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    )


def use_cpu_devices(n: int | None) -> None:
    """Emulates n CPU devices. Must run before any JAX computation."""
    if n is None:
        return
    if n < 1:
        raise CLIError(f"--cpu-devices {n} must be at least 1")
    size_cpu_threads(n)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return  # the environment already chose; the mesh check reports a mismatch
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def size_cpu_threads(devices: int) -> None:
    """Gives XLA's CPU client one thread per core plus one per emulated device (unless
    PJRT_NPROC is set). Must run before any JAX computation.

    Every device's program runs on the client's thread pool, and one waiting in a
    collective holds its thread (blocked): with one thread per core, a pipeline stage
    in its bubble takes a core's thread from the stage at work, whose matmuls then run
    on fewer threads, which slowed decode on a 2x1 mesh by a fifth or more."""
    if devices > 1:
        os.environ.setdefault("PJRT_NPROC", str((os.cpu_count() or 1) + devices))


def _known_errors() -> tuple[type[BaseException], ...]:
    from qwen3_spmd.model.checkpoint.hf import LoadError
    from qwen3_spmd.model.config import ConfigError
    from qwen3_spmd.pipeline.requests import RequestError
    from qwen3_spmd.pipeline.sampling import SamplingError
    from qwen3_spmd.run.text import TextError
    from qwen3_spmd.sharding.mesh import MeshError
    from qwen3_spmd.sharding.plan import PlanError

    return (
        CLIError,
        ConfigError,
        LoadError,
        RequestError,
        SamplingError,
        TextError,
        MeshError,
        PlanError,
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
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
