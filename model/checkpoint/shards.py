"""Writing a checkpoint's tensors as Hugging Face writes them (`save_pretrained`): shards
of at most `max_bytes` of tensor data (each file's header comes on top, as there), held
one shard at a time, so a model larger than the host's memory can be written.

    out = ShardWriter(folder, max_bytes=5 * 10**9)
    for name, x in tensors:
        out.add(name, x)
    out.close()

gives, for N > 1 shards, model-00001-of-0000N.safetensors .. and
model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map": {name: file}});
for one shard, model.safetensors alone. A shard closes when the next tensor would take
it past `max_bytes`; a tensor larger than that goes alone in its own (as transformers
does). The loader (`checkpoint.hf`) reads both forms.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

DEFAULT_MAX_BYTES = 5 * 10**9  # transformers' max_shard_size default, "5GB"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes of a size as transformers' `max_shard_size` takes it: 5GB (10^9 bytes a GB),
    4GiB (2^30), 500MB, or a plain number of bytes. ValueError names what it takes."""
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        value = 0
    if value < 1:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with KB, MB, GB "
            "(powers of 10) or KiB, MiB, GiB (powers of 2), e.g. 5GB"
        )
    return int(value)


class ShardWriter:
    """Tensors into `folder` (made if absent) in shards of at most `max_bytes` each."""

    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self.total_bytes = 0
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._written: list[list[str]] = []  # each written shard's tensor names
        self._names: set[str] = set()  # every tensor added (a large MoE has ~10^5)

    def add(self, name: str, x: np.ndarray) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name} was added twice")
        self._names.add(name)
        x = np.ascontiguousarray(x)
        if self._pending and self._pending_bytes + x.nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = x
        self._pending_bytes += x.nbytes
        self.total_bytes += x.nbytes

    def _part(self, i: int) -> Path:
        return self.folder / f"model-{i + 1:05d}.safetensors.part"

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        part = self._part(len(self._written))
        save_file(self._pending, str(part), metadata={"format": "pt"})
        # safetensors writes its files for the owner alone (0600): the mode a new file
        # gets here, so a shared model folder stays readable
        umask = os.umask(0)
        os.umask(umask)
        part.chmod(0o666 & ~umask)
        self._written.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Writes the last shard and names them all (the index too, for more than one).
        Returns the files' names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            self._part(0).rename(self.folder / SINGLE)
            return [SINGLE]
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for i, (file, tensors) in enumerate(zip(names, self._written)):
            self._part(i).rename(self.folder / file)
            weight_map.update(dict.fromkeys(tensors, file))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, INDEX]
