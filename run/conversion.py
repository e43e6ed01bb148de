"""Converting a Hugging Face checkpoint folder into an orbax checkpoint folder, safely.

The parameters are written by `model.checkpoint.orbax_io.write_params`; this module
owns the folder: it writes into the sibling `OUT.partial-<pid>`, flushes every byte,
writes the completion marker last and only then renames the folder to `OUT`, so a
killed conversion never leaves an `OUT` that looks whole. Leftover partial folders of
dead conversions are removed; one whose process still runs is refused. `--force`
replaces only what a conversion wrote (an orbax checkpoint, or an empty folder).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint, LoadError
from qwen3_spmd.model.checkpoint.orbax_io import (
    COMPLETE_FILE,
    COPIED,
    DTYPES,
    FORMAT,
    METADATA_FILE,
    PARAMS_DIR,
    VERSION,
    Progress,
    data_files,
    is_orbax_checkpoint,
    write_params,
)
from qwen3_spmd.model.config import Qwen3Config


def partial_folders(out: str | Path) -> list[Path]:
    """Leftover `OUT.partial-<pid>` folders of conversions into `out`."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    return sorted(out.parent.glob(f"{out.name}.partial-*"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The conversion protocol in order (check, write into DIR.partial-<pid>, verify, mark
# complete, rename): splitting it would hide the order the crash-safety rests on.
def convert(
    hf_folder: str | Path,
    out: str | Path,
    dtype: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Converts a Hugging Face checkpoint folder into an orbax checkpoint folder `out`.

    Writes into `out.partial-<pid>` and renames it to `out` after the completion marker;
    removes partial folders left by killed conversions. An existing complete `out` is
    refused unless `force` (then it is replaced once the new one is complete).

    Returns the metadata written (format, version, dtype, bytes, source).
    """
    hf_folder, out = Path(hf_folder), Path(out)
    if is_orbax_checkpoint(hf_folder):
        raise LoadError(
            f"{hf_folder} is already an orbax checkpoint: convert reads a Hugging "
            "Face checkpoint folder (config.json + safetensors)"
        )
    cfg = Qwen3Config.from_hf(hf_folder)
    source = HFCheckpoint(hf_folder, cfg)  # checks every tensor before anything is written
    if dtype is None:
        raw = json.loads((hf_folder / "config.json").read_text())
        named = raw.get("dtype") or raw.get("torch_dtype")
        dtype = named if named in DTYPES else "float32"
    if dtype not in DTYPES:
        raise LoadError(f"--dtype {dtype} is not supported: use {' or '.join(DTYPES)}")
    if out.resolve() == hf_folder.resolve() or out.resolve() in hf_folder.resolve().parents:
        raise LoadError(
            f"--out {out} holds the checkpoint being converted ({hf_folder}), which "
            "writing it would delete: choose another --out"
        )
    if out.exists() and not force:
        what = "an orbax checkpoint" if is_orbax_checkpoint(out) else "a folder"
        raise LoadError(
            f"{out} already exists ({what}): pass --force to replace it, or choose another --out"
        )
    # --force replaces what convert wrote, never another folder's files.
    if out.exists() and not (is_orbax_checkpoint(out) or (out.is_dir() and not any(out.iterdir()))):
        raise LoadError(
            f"{out} exists and is not an orbax checkpoint, which is all --force "
            "replaces: choose another --out, or remove it yourself"
        )
    for stale in partial_folders(out):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            raise LoadError(
                f"{stale} belongs to a conversion still running (pid {pid}): wait "
                "for it, or stop it and re-run"
            )
        shutil.rmtree(stale)

    partial = out.parent / f"{out.name}.partial-{os.getpid()}"
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise LoadError(
            f"--out {out}: cannot write there ({e.strerror}): choose a writable folder"
        ) from None
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "layout": "our NNX state, one array per parameter and layer (layers.<name>.<i>)",
        "source": str(hf_folder.resolve()),
    }
    (partial / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    for name in COPIED:
        if (hf_folder / name).is_file():
            shutil.copy2(hf_folder / name, partial / name)
    meta["bytes"] = write_params(partial / PARAMS_DIR, source, cfg, dtype, progress)
    _fsync_tree(partial)
    marker = partial / COMPLETE_FILE
    # The marker lists the data files with their sizes: a file cut short later is named
    # before orbax reads it.
    marker.write_text(
        json.dumps({**meta, "files": data_files(partial / PARAMS_DIR)}, indent=2) + "\n"
    )
    _fsync_tree(partial, files=False)
    if out.exists():  # --force: swap the new one in, then drop the old one
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)
    return meta


def _fsync_tree(folder: Path, files: bool = True) -> None:
    """Flushes the files (and directories) under `folder`, so the marker never lands
    before the data it vouches for."""
    for root, _, names in os.walk(folder):
        for name in names if files else []:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
