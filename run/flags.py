"""What the subcommands share about their flags: `CLIError`, the checks of a flag's
value, the CPU device set-up and the default dtype.

Imports nothing of JAX at module level: every subcommand imports this while the
parser is built, before `--cpu-devices` has set the device count.
"""

from __future__ import annotations

import json
import os
import re


class CLIError(ValueError):
    """Bad command-line input: the message names the problem and the fix."""


def flag(name: str) -> str:
    """The flag of a setting or parameter: its Python name with dashes (max_seq_len:
    --max-seq-len). vLLM's names, taken besides, are `engine_args.ALIASES`."""
    return "--" + name.replace("_", "-")


def in_names(text: str) -> str:
    """A command line's message said in the Python API's names (`flag` undone: "--chunk 0
    must be ..." -> "chunk 0 must be ...")."""
    return re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), text)


# The library names a parameter as its Python API does (pipeline.requests.RequestError
# carries the names apart from the text); the command line says these as their flags.
FLAGGED = (
    "max_new_tokens",
    "max_seq_len",
    "max_batch",
    "max_queue",
    "microbatches",
    "groups",
    "chunk",
    "cp",
    "temperature",
    "top_k",
    "top_p",
)


def in_flags(e: BaseException) -> str:
    """An error's message for the command line: the parameters a RequestError names
    (its `spelled`, read without importing the pipeline here) said as flags (FLAGGED)."""
    spelled = getattr(e, "spelled", None)
    return spelled({name: flag(name) for name in FLAGGED}) if callable(spelled) else str(e)


def json_object(value: str | dict) -> dict:
    """A flag's or setting's JSON object, given as text or as a mapping; ValueError
    naming the fault."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not a JSON object")
    return value


_BYTE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BYTE_SUFFIXES.update({k.upper(): 2 ** (10 * (i + 1)) for i, k in enumerate("kmgt")})


def byte_count(text: str | int, flag: str) -> int:
    """A byte count as vLLM writes one: an integer, or a number with a suffix, k/m/g/t
    decimal (1k = 1000) and K/M/G/T binary (1K = 1024): "2G" is 2 GiB, "1.5g" 1.5e9."""
    if isinstance(text, int):
        return text
    value, unit = str(text).strip(), 1
    if value and value[-1] in _BYTE_SUFFIXES:
        value, unit = value[:-1], _BYTE_SUFFIXES[value[-1]]
    try:
        number = float(value) if unit > 1 else int(value)
    except ValueError:
        raise CLIError(
            f"{flag} {text!r} is not a byte count: an integer, or a number with k/m/g "
            "(decimal) or K/M/G (binary), e.g. 2G"
        ) from None
    return int(number * unit)


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


# ---- devices ---------------------------------------------------------------------------


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
    in its bubble would take a core's thread from the stage at work, whose matmuls
    would then run on fewer threads."""
    if devices > 1:
        os.environ.setdefault("PJRT_NPROC", str((os.cpu_count() or 1) + devices))


def local_cpu_devices(cpu_devices: int | None, mesh_text: str, total: int, n_proc: int) -> int:
    """CPU devices this process emulates: each of n_proc processes holds total / n_proc
    of the `total` devices --mesh mesh_text needs (or --cpu-devices, when they agree)."""
    if cpu_devices is not None:
        if cpu_devices < 1:
            raise CLIError(f"--cpu-devices {cpu_devices} must be at least 1")
        if cpu_devices * n_proc != total:
            per = (
                f"{n_proc} processes x --cpu-devices {cpu_devices} = {cpu_devices * n_proc}"
                if n_proc > 1
                else f"--cpu-devices is {cpu_devices}"
            )
            raise CLIError(f"--mesh {mesh_text} needs {total} devices but {per}: make them agree")
        return cpu_devices
    if total % n_proc:
        raise CLIError(
            f"--mesh {mesh_text} has {total} devices, which {n_proc} processes cannot "
            f"share evenly: choose a mesh with a multiple of {n_proc} devices"
        )
    return total // n_proc


def mesh_devices(n: int, procs, mesh_text: str) -> list:
    """The n devices of --mesh mesh_text, process by process: process 0's devices come
    first, so they form stage 0 (row-major: a stage is a row of C seq devices)."""
    import jax  # here, not above: the device count is set by then

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) < n:
        raise CLIError(
            f"--mesh {mesh_text} needs {n} devices, but {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} visible: choose a smaller "
            f"--mesh, or (on CPU) --cpu-devices {n}"
        )
    if procs.many and len(devices) != n:
        raise CLIError(
            f"--mesh {mesh_text} needs {n} devices, but the {procs.count} processes "
            f"hold {len(devices)}: a multi-process mesh must use every device"
        )
    return devices[:n] if len(devices) > n else devices


# ---- dtype -----------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16")


def add_model(parser, help: str, **kwargs) -> None:
    """--model (`help` says what it takes; a Hugging Face hub id works everywhere) and
    --revision, which picks the hub id's branch, tag or commit."""
    parser.add_argument("--model", help=help, **kwargs)
    parser.add_argument(
        "--revision",
        help="with a hub id as --model: the branch, tag or commit to use (default: main)",
    )


def add_expert_split(parser) -> None:
    """--expert-split: how Qwen3-MoE's experts share the mesh (model.split)."""
    parser.add_argument(
        "--expert-split",
        choices=("ep", "tp", "a2a"),
        help="Qwen3-MoE's experts: tp splits every expert's columns over tensor (1/X of "
        "each chosen expert's work on every device), ep gives each tensor device E/X "
        "whole experts, a2a gives each data x tensor device E/(D X) whole experts and "
        "sends each token to its experts' devices by all-to-alls (default a2a with "
        "replicas, else tp)",
    )


def add_dtype(parser) -> None:
    parser.add_argument(
        "--dtype", help="float32 or bfloat16 (default: bfloat16 on GPU, float32 on CPU)"
    )


def dtype_name(given: str | None) -> str:
    """--dtype, or the platform's default (float32 on CPU, bfloat16 elsewhere), checked.
    Call once the device count is set: it asks JAX for the backend."""
    import jax

    name = given or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if name not in DTYPES:
        raise CLIError(f"--dtype {name} is not supported: use {' or '.join(DTYPES)}")
    return name
