"""Orbax checkpoints of the model's parameters: written once by `qwen3-spmd convert`,
restored straight into the shardings of whatever mesh is in use.

Folder layout (everything but `params/` is copied from the Hugging Face folder)::

    DIR/qwen3_spmd_orbax.json   format, version, stored dtype (written first)
    DIR/params/                 the orbax PyTree checkpoint (OCDBT)
    DIR/config.json, generation_config.json, tokenizer.json, tokenizer_config.json, ...
    DIR/CONVERSION_COMPLETE     written last, after every byte above is on disk

`run.conversion` writes a folder into the sibling `DIR.partial-<pid>` and renames it
to `DIR` only after the completion marker, so a killed conversion leaves no `DIR`; a
folder without the marker is refused here with an error that says to re-run convert.

Stored layout: one array per parameter and layer. The parameters are those of the NNX
state of `model.layers.Qwen3` in our layout (e.g. `q_nhd` [N, H, D]); a stacked layer
parameter `("layers", "q_nhd")` of shape [L, N, H, D] is stored as L arrays
`layers.q_nhd.0` ... `layers.q_nhd.{L-1}`. Each axis that `tensor` may split (heads,
MLP columns, vocabulary rows, experts) is stored as [pieces, rows / pieces], the most
pieces up to 64 that divide it (`_pieces`), each piece a chunk of its own: `q_nhd` of
16 heads is stored [16, 1, H, D], a 3072-wide `gate_fd` [64, 48, D]. Nothing in it
depends on a mesh, so it restores onto any.

Why per-layer arrays rather than one stacked [L, ...] array: the mesh wants
[L_pad, ...] sharded P('stage'), where stage s owns a contiguous run of real layers
followed by identity (zero) slots (`StagePlan.layer_of_slot`). A stage's run is not a
shard of any regular sharding of [L, ...] when S does not divide L (5 layers on 2
stages: 3 + 2). With one array per layer, a host reads exactly the layers of its own
stages; with the pieces, only its rows of the split axes when `tensor` spans hosts.

How a restore goes: the same placement as every weight source
(`sharding.place.place_params`), one parameter at a time: `OrbaxCheckpoint.read` opens
the host's layers of that parameter through tensorstore (orbax's storage: zarr arrays
in an OCDBT database), reads them in parallel (only the pieces that hold the host's
rows) into host memory, stacked and cast to the target dtype; each device's shard is
cut from them by `jax.make_array_from_callback`; the host copy is dropped before the
next parameter.

Why not restore jax.Arrays onto per-stage sub-mesh shardings and stack on device:
orbax 0.12 cannot restore an array that has no shard on the calling
host (every host would then read every layer), and on the emulated CPU devices it
was slower and held more memory than reading to host once and placing the blocks.

How much each host reads: the bytes of the layers of the stages its devices belong
to, of those only the pieces that hold its devices' rows of the split axes, plus what
no axis splits (norms, the router, o_proj's bias), once each (`bytes_read` counts the bytes read; a two-process test checks it
equals what the safetensors path reads, or is within a piece of it at each end of a
host's rows). How much it holds beyond what it keeps: one parameter's layers for its
stages, twice (the read arrays and the stacked copy), at the peak.

Restoring into a different dtype than the stored one casts on read (float32 stored,
bfloat16 restored, or the other way). An FP8 checkpoint's projections are stored as
they are held, float8 beside their float32 scales in our layout (model.fp8), so its
conversion keeps one byte a weight and restores them unchanged in either dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from qwen3_spmd.model.checkpoint.hf import LoadError
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.params import ParamPath, Part, abstract_model, map_params
from qwen3_spmd.model.split import EXPERT_AXIS, TENSOR_AXIS

FORMAT = "qwen3-spmd-orbax"
VERSION = 2  # 2: split axes stored in pieces, one chunk each (1: whole arrays)
MAX_PIECES = 64  # pieces of one split axis
MAX_CHUNKS = 1024  # chunks of one stored array
METADATA_FILE = "qwen3_spmd_orbax.json"
COMPLETE_FILE = "CONVERSION_COMPLETE"
PARAMS_DIR = "params"
# Files copied beside the parameters: the config, and every tokenizer file present.
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPES = ("float32", "bfloat16")
RERUN = "re-run `qwen3-spmd convert` to write it again"

Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


def is_orbax_checkpoint(folder: str | Path) -> bool:
    """Whether `folder` was written by `convert` (complete or not): it has our metadata."""
    return (Path(folder) / METADATA_FILE).is_file()


# ---- the stored tree ------------------------------------------------------------------


def _params(cfg: Qwen3Config, dtype=np.float32) -> dict[ParamPath, tuple[tuple, np.dtype]]:
    """NNX state path -> (shape in our stacked layout, [L, ...] for layer parameters;
    the dtype it is stored in: the model's own, so an FP8 config's projections stay
    float8 and their scales float32 (model.fp8), the rest `dtype`)."""
    _, abstract = abstract_model(cfg, dtype)
    out: dict[ParamPath, tuple[tuple, np.dtype]] = {}
    map_params(lambda path, x: out.__setitem__(path, (tuple(x.shape), np.dtype(x.dtype))), abstract)
    return out


def _pieces(path: ParamPath, shape: Sequence[int]) -> dict[int, int]:
    """Axis -> how many equal pieces the stored array cuts it in: each axis of one
    array (a layer parameter's, one layer's) that `tensor` may split (heads, columns,
    vocabulary rows, experts under either expert split), in the most pieces up to
    MAX_PIECES that divide it, with MAX_CHUNKS an array at most."""
    drop = path[0] == "layers"
    at = {TENSOR_AXIS.get(path[-1]), *(axes.get(path[-1]) for axes in EXPERT_AXIS.values())}
    out, chunks = {}, 1
    for axis in sorted(a - drop for a in at if a is not None):
        cap = min(MAX_PIECES, MAX_CHUNKS // chunks)
        out[axis] = max(g for g in range(1, cap + 1) if shape[axis] % g == 0)
        chunks *= out[axis]
    return out


def _stored_shape(path: ParamPath, shape: Sequence[int]) -> tuple[int, ...]:
    """One array's shape as stored: each split axis of n rows as [pieces, n / pieces],
    the pieces written as separate chunks, so a host reads only the pieces that hold
    its rows (`OrbaxCheckpoint.read` with a part)."""
    pieces = _pieces(path, shape)
    out: list[int] = []
    for axis, n in enumerate(shape):
        out += [pieces[axis], n // pieces[axis]] if axis in pieces else [n]
    return tuple(out)


def _piece_axes(path: ParamPath, shape: Sequence[int]) -> tuple[int, ...]:
    """The stored array's axes that count pieces (orbax's shard_axes: a chunk each)."""
    return tuple(a + n for n, a in enumerate(sorted(_pieces(path, shape))))


def _stored_keys(
    path: ParamPath, shape, layers: Sequence[int]
) -> list[tuple[tuple[str, ...], tuple]]:
    """(key path in the stored tree, stored shape) of one parameter, one per layer."""
    if path[0] != "layers":
        return [(path, _stored_shape(path, shape))]
    return [((*path, str(i)), _stored_shape(path, shape[1:])) for i in layers]


def _nest(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for keys, value in flat.items():
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return tree


def _flatten(tree, prefix=()) -> dict[tuple[str, ...], object]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, (*prefix, str(k))))
    return out


def _checkpointer():
    import orbax.checkpoint as ocp

    # Weights barely compress, and decompression would cost restore time. OCDBT and
    # zarr v2 named, since reads open the arrays through tensorstore (`_spec`).
    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=True, use_zarr3=False)
    )


# ---- writing -----------------------------------------------------------------------


def write_params(
    params_dir: Path, source, cfg: Qwen3Config, dtype, progress: Progress | None = None
) -> int:
    """Reads `source` tensor by tensor and writes the orbax checkpoint `params_dir`.

    Holds one copy of the parameters (in `dtype`) while orbax writes them; the source
    is read one tensor (one layer of a stacked parameter) at a time. Returns the bytes
    written.
    """
    import threading

    import orbax.checkpoint as ocp

    params = _params(cfg, dtype)
    shapes = {path: shape for path, (shape, _) in params.items()}
    dtypes = {path: stored for path, (_, stored) in params.items()}
    items = [
        (path, keys, shape)
        for path, full in shapes.items()
        for keys, shape in _stored_keys(path, full, range(cfg.L))
    ]
    total = sum(int(np.prod(s)) * dtypes[path].itemsize for path, _, s in items)
    flat, save_args, done = {}, {}, 0
    for path, keys, shape in items:
        if path[0] == "layers":
            x = source.read(path, dtypes[path], [int(keys[-1])])[0]
        else:
            x = source.read(path, dtypes[path])
        want = shapes[path][path[0] == "layers" :]
        if tuple(x.shape) != want:  # a source bug, not a user error
            raise LoadError(
                f"parameter {'.'.join(keys)} read as {list(x.shape)}, expected {list(want)}"
            )
        flat[keys] = np.ascontiguousarray(x).reshape(shape)
        save_args[keys] = ocp.SaveArgs(shard_axes=_piece_axes(path, x.shape))
        done += x.nbytes
        if progress:
            progress("read", done, total)

    # Orbax writes every array at once; a thread watches the bytes landing on disk.
    error: list[BaseException] = []

    def save():
        try:
            _checkpointer().save(
                params_dir, args=ocp.args.PyTreeSave(_nest(flat), save_args=_nest(save_args))
            )
        except BaseException as e:  # re-raised below, in the caller's thread
            error.append(e)

    writer = threading.Thread(target=save, daemon=True)
    writer.start()
    while writer.is_alive():
        writer.join(0.25)
        if progress:
            progress("write", min(_du(params_dir.parent), total), total)
    if error:
        raise error[0]
    if progress:
        progress("write", total, total)
    return total


def _du(folder: Path) -> int:
    n = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                n += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass  # orbax renames its temporary files as it goes
    return n


# ---- reading -----------------------------------------------------------------------


def _first_line(e: BaseException, limit: int = 200) -> str:
    """An error's first line, cut to `limit` characters (tensorstore's run to many)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[:limit] + "..."


class OrbaxCheckpoint:
    """A checked orbax checkpoint folder written by `convert`.

    A weight source like `HFCheckpoint`: `read(path, dtype, layers)` reads one parameter
    to host memory, and `sharding.place.place_params` cuts the devices' shards from it.
    """

    def __init__(self, folder: str | Path, cfg: Qwen3Config):
        self.folder = Path(folder)
        self.cfg = cfg
        self.meta = read_metadata(self.folder)
        self.params_dir = (self.folder / PARAMS_DIR).absolute()
        self.shapes = {path: shape for path, (shape, _) in _params(cfg).items()}
        self.bytes_read = 0
        self._check()
        import tensorstore as ts

        self._context = ts.Context()  # one OCDBT manifest and cache for every read

    @property
    def dtype(self):
        return jnp.dtype(self.meta["dtype"])

    def _check(self) -> None:
        _check_data_files(self.folder)
        try:
            meta = _checkpointer().metadata(self.params_dir)
            stored = _flatten(meta.item_metadata.tree)
        except (FileNotFoundError, ValueError, OSError, AttributeError) as e:
            # AttributeError: orbax finds no item metadata (params/ missing or emptied)
            raise LoadError(
                f"orbax checkpoint {self.folder} cannot be read "
                f"({type(e).__name__}: {_first_line(e)}): {RERUN}"
            ) from None
        expected = {}
        for path, full in self.shapes.items():
            for keys, shape in _stored_keys(path, full, range(self.cfg.L)):
                expected[keys] = (path, shape)
        missing = [k for k in expected if k not in stored]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise LoadError(
                f"orbax checkpoint {self.folder} lacks parameter {'.'.join(missing[0])}{more}, "
                "which its config.json implies: the arrays and config.json do not belong together"
            )
        unexpected = sorted(k for k in stored if k not in expected)
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise LoadError(
                f"orbax checkpoint {self.folder} has unexpected parameter "
                f"{'.'.join(unexpected[0])}{more}: not a weight of the Qwen3 its config.json "
                "describes"
            )
        for keys, (path, want) in expected.items():
            shape = tuple(stored[keys].shape)
            if shape != want:
                ours = self.shapes[path][path[0] == "layers" :]
                if len(shape) == len(want):  # named in our layout: pieces merged back
                    merged = list(shape)
                    for a in reversed(_piece_axes(path, ours)):
                        merged[a : a + 2] = [merged[a] * merged[a + 1]]
                    shape = tuple(merged)
                raise LoadError(
                    f"parameter {'.'.join(keys)} in orbax checkpoint {self.folder} has shape "
                    f"{list(shape)}, but config.json implies {list(ours)}: the arrays and "
                    "config.json do not match"
                )

    def _spec(self, keys: tuple[str, ...]) -> dict:
        """The tensorstore spec of one stored array (orbax's names and layout)."""
        return {
            "driver": "zarr",
            "kvstore": {
                "driver": "ocdbt",
                "base": {"driver": "file", "path": str(self.params_dir)},  # not a URL: any name
                "path": ".".join(keys),
            },
        }

    def read(
        self,
        path: ParamPath,
        dtype,
        layers: Sequence[int] | None = None,
        part: Part | None = None,
    ) -> np.ndarray:
        """One parameter in our layout, cast to `dtype`, on the host.

        Every layer's array is opened and read at once (tensorstore reads them in
        parallel); with a part, only the pieces that hold its rows.

        Args:
          path: NNX state path, e.g. ("layers", "q_nhd").
          layers: for a stacked layer parameter, which layers (default all) -> [len, ...].
          part: only these rows of one axis.
        """
        import tensorstore as ts

        full = self.shapes.get(path)
        if full is None:
            raise KeyError(f"no checkpoint tensor for parameter {'.'.join(path)}")
        stacked = path[0] == "layers"
        ids = list(range(self.cfg.L) if layers is None else layers) if stacked else []
        shape = list(full[stacked:])  # one stored array's, in our layout
        pieces = _pieces(path, shape)
        index = [slice(None)] * (len(shape) + len(pieces))  # into the stored array
        take: tuple[slice, ...] = ()  # the part's rows of what is read
        if part is not None:
            axis = part.axis - stacked
            rows = shape[axis] // pieces[axis]  # a piece's
            first, last = part.start // rows, -(-part.stop // rows)
            index[axis + sum(a < axis for a in pieces)] = slice(first, last)
            shape[axis] = (last - first) * rows
            take = (slice(None),) * axis + (
                slice(part.start - first * rows, part.stop - first * rows),
            )
        try:
            keys = [k for k, _ in _stored_keys(path, full, ids)]
            opened = [ts.open(self._spec(k), context=self._context, read=True) for k in keys]
            reads = [f.result()[tuple(index)].read() for f in opened]
            got = [r.result() for r in reads]
        except (ValueError, OSError) as e:  # damaged data files (tensorstore's errors)
            raise LoadError(
                f"orbax checkpoint {self.folder} cannot be restored "
                f"({type(e).__name__}: {_first_line(e)}): {RERUN}"
            ) from None
        self.bytes_read += sum(x.nbytes for x in got)
        arrays = [x.reshape(shape)[take].astype(dtype, copy=False) for x in got]
        del got
        if not stacked:
            return arrays[0]
        out = np.stack(arrays) if arrays else np.zeros((0, *shape), dtype)[(slice(None), *take)]
        del arrays
        _release_host_memory()
        return out


def _release_host_memory() -> None:
    """Gives orbax's read buffers of the parameter just read back to the system.

    Tensorstore's reader threads allocate orbax's read buffers from per-thread malloc
    arenas, which glibc does not return to the system by itself once they are freed;
    left alone they add about half the parameter bytes to the peak RSS of a load
    (docs/benchmarks.md, "Loading weights", has the measured loads).
    """
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def data_files(params_dir: Path) -> dict[str, int]:
    """Every file under params/ -> its size in bytes (paths relative, '/'-separated).
    `run.conversion` records them in the completion marker once they are on disk."""
    return {
        p.relative_to(params_dir).as_posix(): p.stat().st_size
        for p in sorted(params_dir.rglob("*"))
        if p.is_file()
    }


def _check_data_files(folder: Path) -> None:
    """A file the completion marker lists that is gone or of another size is a one-line
    error here, before orbax reads it: a restore that fails part-way leaves reads in
    flight that print errors of their own after ours."""
    try:
        listed = json.loads((folder / COMPLETE_FILE).read_text()).get("files")
    except (OSError, json.JSONDecodeError, AttributeError):
        listed = None
    if not isinstance(listed, dict):
        return  # written before the marker listed its files
    for rel, size in listed.items():
        path = folder / PARAMS_DIR / rel
        now = path.stat().st_size if path.is_file() else None
        if now != size:
            state = "is missing" if now is None else f"is {now:,} bytes, {size:,} when written"
            raise LoadError(
                f"orbax checkpoint {folder} cannot be restored: its data file "
                f"{PARAMS_DIR}/{rel} {state}: {RERUN}"
            )


def read_metadata(folder: Path) -> dict:
    """Our metadata, after checking the conversion completed and the format is ours."""
    meta_file = folder / METADATA_FILE
    if not meta_file.is_file():
        raise LoadError(
            f"{folder} has no {METADATA_FILE}: not an orbax checkpoint written by "
            "`qwen3-spmd convert`"
        )
    if not (folder / COMPLETE_FILE).is_file():
        raise LoadError(
            f"{folder} holds an incomplete conversion (no {COMPLETE_FILE}; the "
            f"conversion was interrupted): {RERUN}"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{meta_file} is not valid JSON ({e}): {RERUN}") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise LoadError(
            f"{meta_file} says format {meta.get('format')!r} version "
            f"{meta.get('version')!r}; this build reads {FORMAT!r} version {VERSION}: "
            f"{RERUN}"
        )
    if meta.get("dtype") not in DTYPES:
        raise LoadError(
            f"{meta_file} names dtype {meta.get('dtype')!r}, not one of {DTYPES}: {RERUN}"
        )
    return meta
