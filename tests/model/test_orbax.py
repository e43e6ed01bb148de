"""Orbax checkpoints: convert a fixture, restore it onto several meshes and get exactly
what the safetensors load gives; bfloat16; killed conversions; mismatched or foreign
folders."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import child_env
from ports import free_port
from reference import FIXTURES, ROOT, TINY, split_parts

from qwen3_spmd.model.checkpoint import orbax_io as ob
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint, LoadError
from qwen3_spmd.model.config import ConfigError, Qwen3Config
from qwen3_spmd.model.params import abstract_model, map_params
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.run import conversion
from qwen3_spmd.run.cli import main
from qwen3_spmd.run.convert import measure, to_hf
from qwen3_spmd.run.models import open_model
from qwen3_spmd.sharding.mesh import make_mesh
from qwen3_spmd.sharding.place import place_params
from qwen3_spmd.sharding.stages import StagePlan

MESHES = [(1, 1), (2, 2), (4, 1), (1, 4)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny fixture converted in float32 and in bfloat16, in a folder whose name a
    URL would misread (a space, # and %20)."""
    root = tmp_path_factory.mktemp("orbax") / "a folder #2 %20"
    conversion.convert(TINY, root / "f32", "float32")
    conversion.convert(TINY, root / "bf16", "bfloat16")
    return root


@pytest.fixture(scope="module")
def cfg():
    return Qwen3Config.from_hf(TINY)


@pytest.fixture(scope="module")
def prompts():
    ref = np.load(TINY / "reference.npz")
    return [ref[f"prompt_{i}"].tolist() for i in range(3)], ref


def _mesh(S, C):
    return make_mesh(S, C, jax.devices()[: S * C])


def test_folder_has_params_config_tokenizer_and_marker(converted):
    folder = converted / "f32"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        ob.METADATA_FILE,
        ob.COMPLETE_FILE,
    ):
        assert (folder / name).is_file(), name
    assert (folder / "config.json").read_bytes() == (TINY / "config.json").read_bytes()
    meta = json.loads((folder / ob.METADATA_FILE).read_text())
    assert meta["format"] == ob.FORMAT and meta["version"] == ob.VERSION
    assert meta["dtype"] == "float32"
    assert json.loads((converted / "bf16" / ob.METADATA_FILE).read_text())["dtype"] == "bfloat16"
    spec = open_model(str(folder))
    assert isinstance(spec.source, ob.OrbaxCheckpoint) and spec.folder == folder
    assert spec.eos_ids() == (302, 300)


@pytest.mark.parametrize("S, C", MESHES)
def test_restored_state_is_bitwise_the_safetensors_state(converted, cfg, S, C):
    """Every leaf, every device's shard: same bytes and same sharding as from the
    safetensors checkpoint."""
    mesh, plan = _mesh(S, C), StagePlan(cfg.L, S)
    for dtype, folder in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"), (jnp.bfloat16, "f32")):
        _, abstract = abstract_model(cfg, dtype)
        want = place_params(abstract, plan, mesh, HFCheckpoint(TINY, cfg))
        got = place_params(abstract, plan, mesh, ob.OrbaxCheckpoint(converted / folder, cfg))
        for w, g in zip(
            jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True
        ):
            assert g.shape == w.shape and g.dtype == w.dtype and g.sharding == w.sharding
            for ws, gs in zip(w.addressable_shards, g.addressable_shards, strict=True):
                assert ws.device == gs.device and ws.index == gs.index
                assert np.array_equal(np.asarray(ws.data), np.asarray(gs.data))


def test_restored_state_on_a_tensor_mesh_is_the_safetensors_state(converted, cfg):
    """On 2x1x2 each device's shard of each (padded) parameter, restored from orbax,
    holds the bytes the safetensors checkpoint gives it."""
    split = TensorSplit(2)
    mesh, plan = make_mesh(2, 1, jax.devices()[:4], tensor=2), StagePlan(cfg.L, 2)
    _, abstract = abstract_model(cfg, jnp.float32, split)
    want = place_params(abstract, plan, mesh, HFCheckpoint(TINY, cfg), split)
    got = place_params(abstract, plan, mesh, ob.OrbaxCheckpoint(converted / "f32", cfg), split)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        assert g.shape == w.shape and g.sharding == w.sharding
        for ws, gs in zip(w.addressable_shards, g.addressable_shards, strict=True):
            assert ws.index == gs.index and np.array_equal(np.asarray(ws.data), np.asarray(gs.data))
    assert want["embed_vd"].shape == (332, cfg.D)  # 331 rows padded to a multiple of 2


@pytest.mark.parametrize("name", ["wide", "moe_fused"])
def test_a_part_reads_only_the_pieces_that_hold_its_rows(tmp_path, name):
    """Each split axis is stored in pieces (the most up to 64 that divide it, for an axis
    of one kind): a part reads the pieces that hold its rows, nothing else."""
    conversion.convert(FIXTURES / name, tmp_path / name, "float32")
    cfg = Qwen3Config.from_hf(FIXTURES / name)
    hf, orb = HFCheckpoint(FIXTURES / name, cfg), ob.OrbaxCheckpoint(tmp_path / name, cfg)
    for path, layers, part in split_parts(hf):
        before = orb.bytes_read
        got = orb.read(path, np.float32, layers, part)
        np.testing.assert_array_equal(got, hf.read(path, np.float32, layers, part))
        read = orb.bytes_read - before
        if cfg.has_sparse:
            assert got.nbytes <= read, path
            continue
        whole = orb.read(path, np.float32, layers)
        n = whole.shape[part.axis]
        rows = n // max(g for g in range(1, 65) if n % g == 0)  # a piece's
        pieces = -(-part.stop // rows) - part.start // rows
        assert read == whole.nbytes // n * pieces * rows, (path, part)


def test_read_matches_safetensors(converted, cfg):
    hf, orb = HFCheckpoint(TINY, cfg), ob.OrbaxCheckpoint(converted / "f32", cfg)
    for path, layers in (
        (("layers", "q_nhd"), [1, 3]),
        (("layers", "gate_fd"), None),
        (("embed_vd",), None),
        (("norm", "scale"), None),
    ):
        assert np.array_equal(orb.read(path, np.float32, layers), hf.read(path, np.float32, layers))
    assert orb.read(("layers", "up_fd"), np.float32, []).shape == (0, cfg.F, cfg.D)


@pytest.mark.parametrize("S, C", MESHES)
def test_generation_matches_safetensors_on_every_mesh(converted, cfg, prompts, S, C):
    prompts, ref = prompts
    mesh = _mesh(S, C)
    outs = [
        static_batch.generate(
            Engine(cfg, source, mesh, jnp.float32, max_seq_len=128, chunk=4), prompts, 8
        )
        for source in (HFCheckpoint(TINY, cfg), ob.OrbaxCheckpoint(converted / "f32", cfg))
    ]
    hf, orb = outs
    for i, (a, b) in enumerate(zip(hf.completions, orb.completions, strict=True)):
        assert b.token_ids == a.token_ids == ref[f"greedy_tokens_{i}"].tolist()
    assert np.array_equal(orb.first_logits, hf.first_logits)


def test_bfloat16_conversion_generates_like_bfloat16_safetensors(converted, cfg, prompts):
    prompts, _ = prompts
    mesh = _mesh(2, 2)
    hf, orb = (
        static_batch.generate(
            Engine(cfg, s, mesh, jnp.bfloat16, max_seq_len=128, chunk=4), prompts, 8
        )
        for s in (HFCheckpoint(TINY, cfg), ob.OrbaxCheckpoint(converted / "bf16", cfg))
    )
    assert [c.token_ids for c in orb.completions] == [c.token_ids for c in hf.completions]
    assert np.array_equal(orb.first_logits, hf.first_logits)


def test_to_hf_inverts_the_loader(cfg):
    """The random-checkpoint writer used for measurements writes what the loader reads."""
    hf = HFCheckpoint(TINY, cfg)
    for e in hf.table.values():
        name = e.hf.format(i=2)
        raw = hf._read_tensor(name)
        assert np.array_equal(to_hf(e, e.to_ours(raw, cfg), cfg), raw), name


# ---- interrupted conversions ------------------------------------------------------------

_STALL = """
import sys, time
from pathlib import Path
import qwen3_spmd.run.conversion as conversion
real = conversion._fsync_tree
def stall(folder, files=True):
    real(folder, files)
    (Path(sys.argv[2]).parent / "stalled").write_text("")
    time.sleep(600)  # killed here: every parameter written, the marker not yet
conversion._fsync_tree = stall
from qwen3_spmd.run.cli import main
sys.exit(main(["convert", "--model", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_killed_conversion_leaves_nothing_that_loads_and_rerun_finishes(tmp_path, capsys):
    out = tmp_path / "ckpt"
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALL, str(TINY), str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stalled").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "convert did not stall"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    (partial,) = conversion.partial_folders(out)
    assert (partial / ob.METADATA_FILE).is_file() and (partial / "params").is_dir()

    with pytest.raises(ConfigError, match=rf"{partial.name}.*re-run `qwen3-spmd convert`"):
        open_model(str(out))
    with pytest.raises(LoadError, match=rf"{partial}.*incomplete.*re-run `qwen3-spmd convert`"):
        open_model(str(partial))
    assert main(["generate", "--model", str(partial), "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert str(partial) in err and "re-run `qwen3-spmd convert`" in err

    # A re-run removes the leftover and finishes the job; a second one refuses to overwrite.
    assert main(["convert", "--model", str(TINY), "--out", str(out)]) == 0
    assert conversion.partial_folders(out) == [] and (out / ob.COMPLETE_FILE).is_file()
    assert isinstance(open_model(str(out)).source, ob.OrbaxCheckpoint)
    assert main(["convert", "--model", str(TINY), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (
        main(["convert", "--model", str(TINY), "--out", str(out), "--force", "--dtype", "bfloat16"])
        == 0
    )
    assert open_model(str(out)).source.meta["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "stalled"]


# ---- mismatched and foreign folders ---------------------------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        (
            "intermediate_size",
            96,
            (
                r"parameter layers\.down_df\.0 .* has shape \[48, 104\], "
                r"but config\.json implies \[48, 96\]"
            ),
        ),
        ("num_hidden_layers", 4, r"unexpected parameter layers\.down_df\.4"),
        ("num_hidden_layers", 6, r"lacks parameter layers\.down_df\.5"),
        ("tie_word_embeddings", True, r"unexpected parameter lm_head_vd"),
    ],
)
def test_config_that_does_not_match_the_arrays(converted, tmp_path, field, value, words):
    folder = tmp_path / "ckpt"
    shutil.copytree(converted / "f32", folder)
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LoadError, match=words):
        open_model(str(folder))


def test_folder_of_neither_format(tmp_path, capsys):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match="neither a Hugging Face checkpoint.*nor an orbax"):
        open_model(str(tmp_path))
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "neither" in capsys.readouterr().err
    assert main(["convert", "--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "safetensors" in capsys.readouterr().err


def test_wrong_format_version_is_refused(converted, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(converted / "f32", folder)
    meta = json.loads((folder / ob.METADATA_FILE).read_text())
    (folder / ob.METADATA_FILE).write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(LoadError, match="version 99.*re-run `qwen3-spmd convert`"):
        open_model(str(folder))


# ---- several processes: each reads only its own stages and tensor rows -------------------

WIDE = FIXTURES / "wide"

_HOST = """
import sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
rank, port, ckpt, hf_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
S, C, X = map(int, sys.argv[5].split("x"))
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
import jax.numpy as jnp, numpy as np
from qwen3_spmd.model.checkpoint import orbax_io as ob
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.params import abstract_model
from qwen3_spmd.model.split import TensorSplit
from qwen3_spmd.sharding.mesh import make_mesh
from qwen3_spmd.sharding.place import place_params
from qwen3_spmd.sharding.stages import StagePlan
cfg = Qwen3Config.from_hf(hf_dir)
mesh = make_mesh(S, C, sorted(jax.devices(), key=lambda d: (d.process_index, d.id)), tensor=X)
split = TensorSplit(X)
plan, (_, abstract) = StagePlan(cfg.L, S), abstract_model(cfg, jnp.float32, split)
hf, orb = HFCheckpoint(hf_dir, cfg), ob.OrbaxCheckpoint(ckpt, cfg)
want = place_params(abstract, plan, mesh, hf, split)
got = place_params(abstract, plan, mesh, orb, split)
same = all(ws.device == gs.device and np.array_equal(np.asarray(ws.data), np.asarray(gs.data))
           for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got))
           for ws, gs in zip(w.addressable_shards, g.addressable_shards, strict=True))
print("RESULT", same, orb.bytes_read, hf.bytes_read, flush=True)
"""


def _two_hosts(ckpt: Path, hf_dir: Path, mesh: str) -> list[list[str]]:
    """[same shards, orbax bytes read, safetensors bytes read] of each of two processes
    (two CPU devices each) placing both formats on `mesh`."""
    port = free_port()
    env = child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOST, str(r), str(port), str(ckpt), str(hf_dir), mesh],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        (line,) = [l for l in out.splitlines() if l.startswith("RESULT")]
        results.append(line.split()[1:])
    return results


def test_two_processes_each_restore_only_their_stages(converted, cfg):
    results = _two_hosts(converted / "f32", TINY, "2x2x1")
    # Stage 0 (layers 0-2) lives on process 0, stage 1 (layers 3-4) on process 1: each
    # reads its layers and the replicated tensors, exactly what the safetensors path reads.
    _, abstract = abstract_model(cfg, jnp.float32)
    sizes = {}
    map_params(lambda path, x: sizes.__setitem__(path, x.size * 4), abstract)
    per_layer = sum(n for path, n in sizes.items() if path[0] == "layers") // cfg.L
    shared = sum(n for path, n in sizes.items() if path[0] != "layers")
    assert results == [
        ["True", str(b), str(b)] for b in (3 * per_layer + shared, 2 * per_layer + shared)
    ]


def test_two_processes_on_one_tensor_axis_each_read_their_rows(tmp_path):
    """1x1x4 over two processes of two devices: `tensor` spans them, so each reads half
    of every split parameter (its 4 of 8 query heads, its one KV head of 2, which its two
    devices both hold, 50 of 100 MLP columns) and its vocabulary rows (V = 333 padded to
    336: rows 0-167 and 168-332), and the norms whole; orbax reads whole pieces (the
    vocabulary's 37 pieces of 9 rows: 19 each, 3 and 6 rows more than asked)."""
    ckpt = tmp_path / "wide"
    conversion.convert(WIDE, ckpt, "float32")
    results = _two_hosts(ckpt, WIDE, "1x1x4")
    cfg = Qwen3Config.from_hf(WIDE)
    _, abstract = abstract_model(cfg, jnp.float32)
    split, vocab, whole = 0, 0, 0
    for path, x in _leaves(abstract):
        if path[-1] in ("embed_vd", "lm_head_vd"):
            vocab += x.size // cfg.V * 4  # bytes a row
        elif path[-1] in ("scale",):
            whole += x.size * 4
        else:
            split += x.size * 4
    hf = [whole + split // 2 + vocab * rows for rows in (168, 165)]
    orb = [whole + split // 2 + vocab * 171] * 2
    assert results == [["True", str(o), str(h)] for o, h in zip(orb, hf)]
    assert sum(hf) == whole * 2 + split + vocab * cfg.V  # the model once, the norms twice


def _leaves(state) -> list:
    out = []
    map_params(lambda path, x: out.append((path, x)), state)
    return out


def test_load_measurement_runs_both_formats(converted):
    """`convert --measure`: each format loads in a fresh process, as the engine loads it
    (placement into per-slot buffers), and reports its time, memory and format."""
    got = measure(TINY, converted / "f32", [(2, 1)], say=lambda *_: None)
    assert [r["format"] for r in got] == ["safetensors", "orbax"]
    for r in got:
        assert r["mesh"] == "2x1" and r["load_s"] > 0
        assert r["peak_rss_bytes"] >= r["rss_before_load_bytes"] > 0
        assert r["kept_bytes"] > r["largest_tensor_bytes"] > 0
    assert got[0]["kept_bytes"] == got[1]["kept_bytes"]


def test_convert_never_deletes_what_it_did_not_write(tmp_path, capsys):
    """--out the checkpoint itself, or a folder holding it, is refused even with --force;
    --force replaces an orbax checkpoint or an empty folder, not another folder's files;
    an --out that cannot be written is one line naming it."""
    hf = tmp_path / "work" / "hf"
    shutil.copytree(TINY, hf)
    (tmp_path / "work" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in hf.iterdir())
    for out, words in [
        (hf, "holds the checkpoint being converted"),
        (tmp_path / "work", "holds the checkpoint being converted"),
        (tmp_path, "holds the checkpoint being converted"),
    ]:
        assert main(["convert", "--model", str(hf), "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and "\n" not in err
    assert sorted(p.name for p in hf.iterdir()) == before
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    assert main(["convert", "--model", str(hf), "--out", str(other), "--force"]) == 2
    assert "is not an orbax checkpoint" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "keep"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", "--model", str(hf), "--out", str(empty), "--force"]) == 0
    assert (empty / ob.COMPLETE_FILE).is_file()
    capsys.readouterr()

    (tmp_path / "file").write_text("")
    assert main(["convert", "--model", str(hf), "--out", str(tmp_path / "file" / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "cannot write there" in err and "\n" not in err


def test_damaged_folders_are_one_line_errors(converted, tmp_path, capsys):
    """params/ gone, or its largest data file cut short: a LoadError naming the folder
    and the fix, and nothing else on stderr (orbax and tensorstore raise AttributeError
    and 80-line errors, and a restore that fails part-way leaves reads in flight that
    print errors of their own: the completion marker's list of data files and their
    sizes finds the cut file before orbax reads it). A second process runs the cut
    case too, so late output of orbax's threads would show on its stderr."""
    gone = tmp_path / "gone"
    shutil.copytree(converted / "f32", gone)
    shutil.rmtree(gone / ob.PARAMS_DIR)
    cut = tmp_path / "cut"
    shutil.copytree(converted / "f32", cut)
    data = max(
        (p for p in (cut / ob.PARAMS_DIR).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data.write_bytes(data.read_bytes()[:1000])
    argv = ["generate", "--mesh", "1x1", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    errors = {}
    for folder in (gone, cut):
        assert main([*argv, "--model", str(folder)]) == 2
        errors[folder] = capsys.readouterr().err.strip()
    assert f"{data.relative_to(cut).as_posix()} is 1,000 bytes" in errors[cut]
    env = child_env()
    out = subprocess.run(
        [sys.executable, "-m", "qwen3_spmd.run", *argv, "--model", str(cut)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.strip() == errors[cut]
    for folder, err in errors.items():
        assert "\n" not in err and err.startswith(f"error: orbax checkpoint {folder} cannot be")
        assert err.endswith("re-run `qwen3-spmd convert` to write it again")
