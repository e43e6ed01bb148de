"""`convert`: a Hugging Face checkpoint folder -> an orbax checkpoint folder, or a
random checkpoint of a preset's shape.

    qwen3-spmd convert --model HF_DIR --out DIR [--dtype float32|bfloat16] [--force]
    qwen3-spmd convert --random-preset NAME --out DIR [--force]
    qwen3-spmd convert --model HF_DIR --out DIR --quantize fp8

The third writes `DIR` as a Hugging Face checkpoint folder in Qwen3's published FP8
format (float8_e4m3fn linear weights with 128x128 block scales, `quantization_config` in
config.json: model.checkpoint.quantize), which loads like the hub's FP8 releases.

The first writes `DIR` (see `model.checkpoint.orbax_io` for the layout and the restore),
which `generate`/`bench --model DIR` then restore onto any mesh. A killed conversion
leaves only `DIR.partial-<pid>`, which nothing loads; re-running the command removes it
and writes `DIR` again.

The second writes `DIR` as a Hugging Face checkpoint folder shaped like a real Qwen3
one: config.json, model.safetensors (seeded random float32 weights), and Qwen3's own
tokenizer.json, tokenizer_config.json (the chat template) and generation_config.json
(`run.qwen_tokenizer`). A preset with fewer than Qwen3's 151,936 vocabulary rows (tiny:
512) gets that many, so that every token id the tokenizer makes is a row.

The load measurement (load time and peak host memory of both paths, each in a fresh
process) on a random checkpoint of the 0.6B preset's shape:

    qwen3-spmd convert --random-preset 0.6B --model /tmp/q06-hf --out /tmp/q06-orbax \\
        --measure 1x1,2x2

With `--model` too, `--random-preset NAME` writes that random checkpoint into `--model`,
if it is not there yet, and then converts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qwen3_spmd.run.flags import CLIError, add_model


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to an orbax "
        "checkpoint that restores sharded onto any mesh",
    )
    add_model(
        p,
        "the Hugging Face checkpoint folder (config.json, safetensors), or a hub id "
        "(Qwen/Qwen3-0.6B: downloaded on first use)",
        metavar="HF_DIR",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the orbax checkpoint folder (with --random-preset alone: the random Hugging "
        "Face checkpoint folder)",
    )
    p.add_argument(
        "--dtype", help="float32 or bfloat16 (default: config.json's dtype, else float32)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument(
        "--measure",
        metavar="SxC[xX][,...]",
        help="then measure load time and peak RSS of both formats on these meshes "
        "(emulated CPU devices, one fresh process per load)",
    )
    p.add_argument(
        "--measure-dtype",
        default="float32",
        help="dtype the measured loads restore into (default float32)",
    )
    p.add_argument(
        "--random-preset",
        metavar="NAME",
        help="write a Hugging Face checkpoint of this preset (tiny, 0.6B, ...) with seeded "
        "random weights and Qwen3's tokenizer into --out; with --model: into --model (if "
        "absent), then convert it",
    )
    p.add_argument(
        "--quantize",
        choices=("fp8",),
        help="write --out as a Hugging Face FP8 checkpoint (block-wise float8_e4m3fn "
        "weights with 128x128 scales, as Qwen publishes them) instead of orbax",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="with --quantize: the largest safetensors file written, as transformers' "
        "max_shard_size (5GB: 10^9 bytes a GB; 4GiB: 2^30; default 5GB)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=main)


def main(args) -> int:
    from qwen3_spmd.model.checkpoint import orbax_io
    from qwen3_spmd.run import conversion, models
    from qwen3_spmd.sharding.mesh import parse_mesh

    meshes = [parse_mesh(m) for m in args.measure.split(",")] if args.measure else []
    say = (
        (lambda *a: print(*a, file=sys.stderr, flush=True))
        if args.json
        else (lambda *a: print(*a, flush=True))
    )
    if args.model is None and not args.random_preset:
        raise CLIError("convert needs --model HF_DIR (or --random-preset NAME)")
    if args.random_preset:
        from qwen3_spmd.model.config import PRESETS

        if args.random_preset not in PRESETS:
            raise CLIError(
                f"--random-preset {args.random_preset} is not a preset: use one of "
                f"{', '.join(PRESETS)}"
            )
        if args.model is None:  # the random checkpoint is what --out asks for
            if meshes:
                raise CLIError("--measure compares two folders: add --model HF_DIR")
            _clear_out(Path(args.out), args.force)
        target = args.model or args.out
        if not Path(target).exists():
            t0 = time.perf_counter()
            write_random_preset(args.random_preset, target)
            say(
                f"wrote random {args.random_preset} checkpoint {target} "
                f"({time.perf_counter() - t0:.1f} s): Hugging Face safetensors, Qwen3's "
                "tokenizer and chat template"
            )
        if args.model is None:
            if args.json:
                print(json.dumps({"random_preset": args.random_preset, "out": args.out}))
            return 0
    report: dict = {"model": args.model, "out": args.out}
    hf_folder = models.local_folder(args.model, args.revision)  # a hub id: its snapshot
    if args.quantize:
        return _quantize(hf_folder, Path(args.out), args, report, say)
    out = Path(args.out)
    if (
        meshes
        and orbax_io.is_orbax_checkpoint(out)
        and not args.force
        and (out / orbax_io.COMPLETE_FILE).is_file()
    ):
        say(f"{out} is already converted; measuring it")
    else:
        t0 = time.perf_counter()
        with _progress_bar(f"{args.model} -> {args.out}") as progress:
            meta = conversion.convert(hf_folder, args.out, args.dtype, args.force, progress)
        report["convert"] = {
            "dtype": meta["dtype"],
            "bytes": meta["bytes"],
            "seconds": round(time.perf_counter() - t0, 2),
        }
        say(
            f"wrote {args.out}: {meta['bytes'] / 1e6:.1f} MB of {meta['dtype']} parameters in "
            f"{report['convert']['seconds']} s"
        )
    if meshes:
        report["loads"] = measure(hf_folder, args.out, meshes, args.measure_dtype, say)
    if args.json:
        print(json.dumps(report))
    return 0


def _quantize(hf_folder, out: Path, args, report: dict, say) -> int:
    """--quantize fp8: the FP8 form of an unquantized checkpoint folder."""
    from qwen3_spmd.model.checkpoint.quantize import quantize_fp8
    from qwen3_spmd.model.checkpoint.shards import parse_size

    if args.measure:
        raise CLIError("--measure compares orbax with safetensors: drop --quantize")
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        raise CLIError(f"--max-shard-size {e}") from None
    _clear_out(out, args.force)
    t0 = time.perf_counter()
    try:
        made = quantize_fp8(hf_folder, out, max_shard_bytes=max_shard_bytes)
    except ValueError as e:
        raise CLIError(str(e)) from None
    report["quantize"] = {**made, "seconds": round(time.perf_counter() - t0, 2)}
    shards = sum(f.endswith(".safetensors") for f in made["files"])
    say(
        f"wrote {out}: FP8 checkpoint, {made['quantized']} weights quantized, "
        f"{made['bytes'] / 1e6:.1f} MB in {shards} safetensors file{'s' * (shards > 1)} "
        f"in {report['quantize']['seconds']} s"
    )
    if args.json:
        print(json.dumps(report))
    return 0


class _progress_bar:
    """A rich progress bar on stderr: reading the safetensors, then writing the orbax files."""

    def __init__(self, title: str):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.title, self.tasks = title, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.tasks:
            self.bar.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not sys.stderr.isatty():  # bars are for a person watching, not for a log
            return
        # Started at the first progress, so an error found before any work is one line.
        if not self.tasks:
            self.bar.start()
        if phase not in self.tasks:
            label = {"read": "reading safetensors", "write": "writing orbax"}.get(phase, phase)
            self.tasks[phase] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[phase], completed=done)


# ---- a random Hugging Face checkpoint of a preset's shape -----------------------------


def hf_config(cfg) -> dict:
    """A transformers 4.x-style config.json for `cfg` (Qwen3-MoE's fields as the hub
    writes them)."""
    if cfg.E:
        return {
            **_dense_config(cfg),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": cfg.E,
            "num_experts_per_tok": cfg.A,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers),
        }
    return _dense_config(cfg)


def _dense_config(cfg) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.V,
        "hidden_size": cfg.D,
        "intermediate_size": cfg.F,
        "num_hidden_layers": cfg.L,
        "num_attention_heads": cfg.N,
        "num_key_value_heads": cfg.K,
        "head_dim": cfg.H,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) or None,
        "torch_dtype": "float32",
        "use_sliding_window": False,
    }


def write_random_preset(name: str, folder: str | Path, seed: int = 0) -> None:
    """Preset `name` as a Hugging Face checkpoint folder with Qwen3's tokenizer files; a
    preset's vocabulary grows to Qwen3's 151,936 rows where it is smaller."""
    from qwen3_spmd.model.config import PRESETS
    from qwen3_spmd.run import qwen_tokenizer
    from qwen3_spmd.run.models import with_qwen_vocab

    cfg = with_qwen_vocab(PRESETS[name])
    write_random_hf(cfg, folder, seed)
    qwen_tokenizer.write(folder, cfg.max_position_embeddings)


def _clear_out(out: Path, force: bool) -> None:
    """--out of a random checkpoint: absent, or replaced with --force when it is a
    Hugging Face checkpoint folder (never another folder's files)."""
    import shutil

    from qwen3_spmd.model.checkpoint.shards import INDEX, SINGLE

    if not out.exists():
        return
    if not force:
        raise CLIError(f"--out {out} already exists: pass --force to replace it")
    weights = (out / SINGLE).is_file() or (out / INDEX).is_file()
    if not (out / "config.json").is_file() or not weights:
        raise CLIError(
            f"--out {out} exists and is not a Hugging Face checkpoint folder, which is all "
            "--force replaces: choose another --out, or remove it yourself"
        )
    shutil.rmtree(out)


def to_hf(entry, ours, cfg):
    """Our layout -> the Hugging Face tensor (the inverse of the loader's reshape)."""
    return np.ascontiguousarray(entry.to_hf(ours, cfg))


def write_random_hf(cfg, folder: str | Path, seed: int = 0) -> None:
    """A single-file float32 Hugging Face checkpoint with `RandomWeights(cfg, seed)`."""
    from safetensors.numpy import save_file

    from qwen3_spmd.model.checkpoint.hf_names import name_table
    from qwen3_spmd.model.checkpoint.random_weights import RandomWeights

    folder = Path(folder)
    folder.mkdir(parents=True)
    source = RandomWeights(cfg, seed)
    tensors = {}
    for e in name_table(cfg):
        for i in range(cfg.L) if e.stacked else [None]:
            x = source.read(e.path, np.float32, None if i is None else [i])
            for name, t in e.hf_tensors(x if i is None else x[0], cfg, i).items():
                tensors[name] = np.ascontiguousarray(t)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")


# ---- measuring both load paths -------------------------------------------------------


def measure_load(
    folder: str, stage: int, seq: int, dtype: str = "float32", tensor: int = 1
) -> dict:
    """Loads `folder` onto a stage x seq x tensor mesh of emulated CPU devices in this
    process and
    reports the load time and this process's peak RSS. Call it in a fresh process (it
    sets the device count, and peak RSS covers the process's whole life: the high-water
    mark of its address space, VmHWM, which starts afresh at exec; getrusage's maxrss
    would carry over the parent's at fork).

    The load is what `Engine.__init__` does with the weights: `sharding.place.place_state`.
    """
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", stage * seq * tensor)
    import jax.numpy as jnp
    import numpy as np

    from qwen3_spmd.model.checkpoint.orbax_io import OrbaxCheckpoint
    from qwen3_spmd.model.params import abstract_model, map_params
    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.run.models import open_model
    from qwen3_spmd.sharding.mesh import make_mesh
    from qwen3_spmd.sharding.place import place_state
    from qwen3_spmd.sharding.stages import StagePlan

    mesh = make_mesh(stage, seq, jax.devices()[: stage * seq * tensor], tensor=tensor)
    jnp.zeros(1).block_until_ready()  # start the backend before measuring
    rss_before = _peak_rss()
    t0 = time.perf_counter()
    spec = open_model(folder)
    plan = StagePlan(spec.cfg.L, stage)
    split = TensorSplit(tensor)
    split.check(spec.cfg)
    _, abstract = abstract_model(spec.cfg, jnp.dtype(dtype), split)
    state = place_state(abstract, plan, mesh, spec.source, split)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    peak = _peak_rss()
    leaves = jax.tree_util.tree_leaves(state)
    kept = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    sizes = []
    map_params(
        lambda path, x: sizes.append(
            int(np.prod(x.shape[1:] if path[0] == "layers" else x.shape)) * x.dtype.itemsize
        ),
        abstract,
    )
    largest = max(sizes)
    target = 1.5 * kept + largest
    fmt = "orbax" if isinstance(spec.source, OrbaxCheckpoint) else "safetensors"
    return {
        "format": fmt,
        "mesh": _shape(stage, seq, tensor),
        "dtype": dtype,
        "load_s": round(seconds, 3),
        "peak_rss_bytes": peak,
        "rss_before_load_bytes": rss_before,
        "kept_bytes": kept,
        "largest_tensor_bytes": largest,
        "target_bytes": int(target),
        "under_target": peak < target,
    }


def _shape(stage: int, seq: int, tensor: int) -> str:
    from qwen3_spmd.sharding.mesh import MeshShape

    return str(MeshShape(stage, seq, tensor))


def _peak_rss() -> int:
    """This process's peak resident set size in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not Linux: maxrss (kilobytes on Linux, bytes on macOS)

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def measure(hf_folder, orbax_folder, meshes, dtype: str = "float32", say=print) -> list[dict]:
    """Both load paths on each mesh, each in a fresh process; prints one line per load."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    results = []
    from qwen3_spmd.sharding.mesh import MeshShape

    for stage, seq, tensor in (MeshShape(*m)[:3] for m in meshes):  # (S, C) or (S, C, X)
        for folder in (hf_folder, orbax_folder):
            code = (
                "import json, sys; from qwen3_spmd.run.convert import measure_load; "
                f"print(json.dumps(measure_load({str(folder)!r}, {stage}, {seq}, {dtype!r}, "
                f"{tensor})))"
            )
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
            )
            if out.returncode != 0:
                raise RuntimeError(
                    f"measuring {folder} on {_shape(stage, seq, tensor)} failed:\n{out.stderr}"
                )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            say(
                f"{r['mesh']} {r['format']:>11}: load {r['load_s']:.2f} s, peak RSS "
                f"{r['peak_rss_bytes'] / 1e9:.2f} GB (before load {r['rss_before_load_bytes'] / 1e9:.2f}"
                f" GB), kept {r['kept_bytes'] / 1e9:.2f} GB, target < 1.5 x kept + largest tensor "
                f"= {r['target_bytes'] / 1e9:.2f} GB: {'ok' if r['under_target'] else 'OVER'}"
            )
    return results
