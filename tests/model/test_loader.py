"""The strict Hugging Face safetensors loader: errors that name the tensor or file,
sharded and single-file checkpoints alike, lazy per-layer reads, bfloat16 files.

Broken checkpoints are built by copying a fixture into tmp_path and rewriting its
safetensors with safetensors.numpy (no torch needed)."""

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from reference import FIXTURES, split_parts
from safetensors.numpy import load_file, save_file

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint, LoadError, load_model
from qwen3_spmd.model.checkpoint.hf_names import name_table
from qwen3_spmd.model.config import ConfigError, Qwen3Config
from qwen3_spmd.model.params import abstract_model, map_params

TINY, TIED = FIXTURES / "tiny", FIXTURES / "tied"


@pytest.fixture(scope="module")
def tiny_cfg():
    return Qwen3Config.from_hf(TINY)


@pytest.fixture(scope="module")
def tied_cfg():
    return Qwen3Config.from_hf(TIED)


@pytest.fixture(scope="module")
def tiny_tensors():
    return load_file(TINY / "model.safetensors")


def _copy(src: Path, dst: Path, weights: bool = True) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if weights or not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    return dst


def _tiny_with(tmp_path: Path, tensors: dict) -> Path:
    folder = _copy(TINY, tmp_path / "ckpt", weights=False)
    save_file(tensors, folder / "model.safetensors")
    return folder


def _load_error(folder, cfg) -> str:
    with pytest.raises(LoadError) as e:
        HFCheckpoint(folder, cfg)
    return str(e.value)


# ---- errors ------------------------------------------------------------------------------------


def test_missing_folder(tmp_path, tiny_cfg):
    folder = tmp_path / "does-not-exist"
    msg = _load_error(folder, tiny_cfg)
    assert str(folder) in msg and "model.safetensors" in msg
    with pytest.raises(ConfigError) as e:
        Qwen3Config.from_hf(folder)
    assert str(folder) in str(e.value) and "config.json" in str(e.value)


def test_missing_config(tmp_path):
    folder = _copy(TINY, tmp_path / "ckpt")
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        Qwen3Config.from_hf(folder)


def test_folder_without_safetensors(tmp_path, tiny_cfg):
    folder = _copy(TINY, tmp_path / "ckpt", weights=False)
    msg = _load_error(folder, tiny_cfg)
    assert "model.safetensors" in msg and str(folder) in msg


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.embed_tokens.weight",
    ],
)
def test_missing_tensor(tmp_path, tiny_cfg, tiny_tensors, name):
    tensors = {k: v for k, v in tiny_tensors.items() if k != name}
    assert len(tensors) == len(tiny_tensors) - 1
    assert name in _load_error(_tiny_with(tmp_path, tensors), tiny_cfg)


def test_missing_tensors_counts_the_rest(tmp_path, tiny_cfg, tiny_tensors):
    tensors = {k: v for k, v in tiny_tensors.items() if "layers.4." not in k}
    msg = _load_error(_tiny_with(tmp_path, tensors), tiny_cfg)
    assert "model.layers.4." in msg and "10 more" in msg


@pytest.mark.parametrize(
    "name,shape",
    [
        ("model.layers.0.self_attn.q_proj.bias", (96,)),  # the config has attention_bias false
        ("model.layers.5.mlp.up_proj.weight", (104, 48)),  # a sixth layer of a 5-layer config
        ("model.rotary_emb.inv_freq", (8,)),
    ],
)
def test_unexpected_tensor(tmp_path, tiny_cfg, tiny_tensors, name, shape):
    tensors = dict(tiny_tensors)
    tensors[name] = np.zeros(shape, np.float32)
    assert name in _load_error(_tiny_with(tmp_path, tensors), tiny_cfg)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "lm_head.weight",
    ],
)
def test_mis_shaped_tensor(tmp_path, tiny_cfg, tiny_tensors, name):
    tensors = dict(tiny_tensors)
    good = tensors[name]
    bad = good.T.copy() if good.ndim == 2 else np.concatenate([good, good])
    tensors[name] = bad
    msg = _load_error(_tiny_with(tmp_path, tensors), tiny_cfg)
    assert name in msg and str(list(bad.shape)) in msg and str(list(good.shape)) in msg


def test_integer_tensor(tmp_path, tiny_cfg, tiny_tensors):
    tensors = dict(tiny_tensors)
    name = "model.norm.weight"
    tensors[name] = tensors[name].astype(np.int32)
    msg = _load_error(_tiny_with(tmp_path, tensors), tiny_cfg)
    assert name in msg and "I32" in msg and "not floating point" in msg


def test_truncated_safetensors_file(tmp_path, tiny_cfg):
    folder = _copy(TINY, tmp_path / "ckpt")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = _load_error(folder, tiny_cfg)
    assert "model.safetensors is not a readable safetensors file" in msg and "\n" not in msg


def test_index_putting_a_tensor_in_the_wrong_shard(tmp_path, tied_cfg):
    folder = _copy(TIED, tmp_path / "ckpt")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name, file = next(iter(index["weight_map"].items()))
    index["weight_map"][name] = next(f for f in index["weight_map"].values() if f != file)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "not a readable safetensors file, or lacks a tensor" in _load_error(folder, tied_cfg)


def test_checks_run_before_any_read(tiny_cfg):
    ckpt = HFCheckpoint(TINY, tiny_cfg)
    assert ckpt.bytes_read == 0


def test_index_listing_a_missing_shard(tmp_path, tied_cfg):
    folder = _copy(TIED, tmp_path / "ckpt")
    (folder / "model-00002-of-00003.safetensors").unlink()
    msg = _load_error(folder, tied_cfg)
    assert "model-00002-of-00003.safetensors" in msg and "model.safetensors.index.json" in msg


def test_broken_index(tmp_path, tied_cfg):
    folder = _copy(TIED, tmp_path / "ckpt")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert "model.safetensors.index.json" in _load_error(folder, tied_cfg)


def test_config_of_another_model(tmp_path, tied_cfg):
    """tiny's weights (5 layers) under tied's config.json (3 layers): refused, naming a
    tensor of a layer the config does not have."""
    folder = _copy(TINY, tmp_path / "ckpt")
    shutil.copy(TIED / "config.json", folder / "config.json")
    msg = _load_error(folder, Qwen3Config.from_hf(folder))
    assert "unexpected tensor model.layers.3." in msg


def test_tied_checkpoint_may_carry_an_lm_head(tmp_path, tied_cfg):
    merged = {}
    for f in sorted(TIED.glob("model-*.safetensors")):
        merged.update(load_file(f))
    merged["lm_head.weight"] = merged["model.embed_tokens.weight"].copy()
    folder = _copy(TIED, tmp_path / "ckpt", weights=False)
    save_file(merged, folder / "model.safetensors")
    ckpt = HFCheckpoint(folder, tied_cfg)
    assert ("lm_head_vd",) not in ckpt.table


# ---- what is read ------------------------------------------------------------------------------


def _all_params(ckpt, cfg):
    _, abstract = abstract_model(cfg, np.float32)
    out = {}
    map_params(lambda path, x: out.__setitem__(path, ckpt.read(path, np.float32)), abstract)
    return out


def test_sharded_equals_single_file(tmp_path, tied_cfg):
    index = json.loads((TIED / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    merged = {}
    for f in sorted(set(index.values())):
        merged.update(load_file(TIED / f))
    assert set(merged) == set(index)
    folder = _copy(TIED, tmp_path / "single", weights=False)
    save_file(merged, folder / "model.safetensors")
    assert not (folder / "model.safetensors.index.json").exists()

    sharded = HFCheckpoint(TIED, tied_cfg)
    single = HFCheckpoint(folder, tied_cfg)
    assert len(set(sharded.files.values())) == 3 and len(set(single.files.values())) == 1
    a, b = _all_params(sharded, tied_cfg), _all_params(single, tied_cfg)
    assert set(a) == set(b) and ("lm_head_vd",) not in a
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    assert sharded.bytes_read == single.bytes_read


def test_layout_of_each_tensor(tiny_cfg, tiny_tensors):
    """Our layouts against the torch Linear [out, in] tensors, index by index."""
    c = tiny_cfg
    ckpt = HFCheckpoint(TINY, c)
    q = ckpt.read(("layers", "q_nhd"), np.float32)
    o = ckpt.read(("layers", "o_dnh"), np.float32)
    k = ckpt.read(("layers", "k_khd"), np.float32)
    gate = ckpt.read(("layers", "gate_fd"), np.float32)
    down = ckpt.read(("layers", "down_df"), np.float32)
    head = ckpt.read(("lm_head_vd",), np.float32)
    assert q.shape == (c.L, c.N, c.H, c.D) and o.shape == (c.L, c.D, c.N, c.H)
    for layer, n, h in [(0, 0, 0), (3, 5, 11), (4, 2, 15)]:
        wq = tiny_tensors[f"model.layers.{layer}.self_attn.q_proj.weight"]
        wo = tiny_tensors[f"model.layers.{layer}.self_attn.o_proj.weight"]
        np.testing.assert_array_equal(q[layer, n, h, :], wq[n * c.H + h, :])
        np.testing.assert_array_equal(o[layer, :, n, h], wo[:, n * c.H + h])
    wk = tiny_tensors["model.layers.1.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(k[1, 1, 7, :], wk[1 * c.H + 7, :])
    np.testing.assert_array_equal(gate[2], tiny_tensors["model.layers.2.mlp.gate_proj.weight"])
    np.testing.assert_array_equal(down[2], tiny_tensors["model.layers.2.mlp.down_proj.weight"])
    np.testing.assert_array_equal(head, tiny_tensors["lm_head.weight"])
    np.testing.assert_array_equal(
        ckpt.read(("layers", "q_norm", "scale"), np.float32)[4],
        tiny_tensors["model.layers.4.self_attn.q_norm.weight"],
    )


def test_layer_subsets_in_the_order_asked(tiny_cfg):
    ckpt = HFCheckpoint(TINY, tiny_cfg)
    whole = ckpt.read(("layers", "up_fd"), np.float32)
    np.testing.assert_array_equal(ckpt.read(("layers", "up_fd"), np.float32, [3, 1]), whole[[3, 1]])
    empty = ckpt.read(("layers", "up_fd"), np.float32, [])
    assert empty.shape == (0, *whole.shape[1:])


@pytest.mark.parametrize(
    "path", [("layers", "q_nhd"), ("layers", "down_df"), ("layers", "input_norm", "scale")]
)
def test_bytes_read_of_one_layer_is_one_over_L(tiny_cfg, path):
    one = HFCheckpoint(TINY, tiny_cfg)
    x = one.read(path, np.float32, layers=[0])
    every = HFCheckpoint(TINY, tiny_cfg)
    y = every.read(path, np.float32)
    assert one.bytes_read == x.nbytes > 0
    assert every.bytes_read == y.nbytes
    assert every.bytes_read == tiny_cfg.L * one.bytes_read


def test_bytes_read_of_a_stage(tiny_cfg):
    """Layers 3 and 4 of every stacked tensor: 2/L of all layer bytes, no embedding."""
    ckpt = HFCheckpoint(TINY, tiny_cfg)
    stacked = [e.path for e in name_table(tiny_cfg) if e.path[0] == "layers"]
    for path in stacked:
        ckpt.read(path, np.float32, layers=[3, 4])
    part = ckpt.bytes_read
    for path in stacked:
        ckpt.read(path, np.float32)
    assert ckpt.bytes_read - part == part * tiny_cfg.L // 2


@pytest.mark.parametrize("name", ["wide", "moe", "moe_fused"])
def test_a_part_reads_only_its_rows(name):
    """A host's rows of a split axis (heads inside q_proj's head-major rows, o_proj's
    columns, the fused gate_up's gate or up half, whole experts): the rows of the whole
    read, and only their bytes (none for a layer of the other MLP kind)."""
    cfg = Qwen3Config.from_hf(FIXTURES / name)
    ckpt = HFCheckpoint(FIXTURES / name, cfg)
    count = 0
    for path, layers, part in split_parts(ckpt):
        whole = ckpt.read(path, np.float32, layers)
        before = ckpt.bytes_read
        got = ckpt.read(path, np.float32, layers, part)
        np.testing.assert_array_equal(got, part.of(whole), err_msg=str((path, part)))
        held = [ckpt.table[path].holds(cfg, i) for i in layers] if layers else [True]
        assert ckpt.bytes_read - before == got.nbytes * sum(held) // len(held)  # float32 files
        count += 1
    assert count >= 25


def test_bfloat16_checkpoint_loads_as_float32(tmp_path, tiny_cfg, tiny_tensors):
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tiny_tensors.items()}
    folder = _tiny_with(tmp_path, bf16)
    ckpt = HFCheckpoint(folder, tiny_cfg)
    q = ckpt.read(("layers", "q_nhd"), np.float32)
    assert q.dtype == np.float32
    want = HFCheckpoint(TINY, tiny_cfg).read(("layers", "q_nhd"), np.float32)
    np.testing.assert_array_equal(q, want.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(q, want)  # the file really was bfloat16
    assert ckpt.bytes_read == want.nbytes // 2

    model = load_model(folder, tiny_cfg, np.float32)
    leaves = jax.tree.leaves(nnx.state(model))
    assert leaves and all(x.dtype == np.float32 for x in leaves)
    np.testing.assert_array_equal(
        np.asarray(model.embed_vd[...]),
        tiny_tensors["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16).astype(np.float32),
    )


def test_load_model_matches_reads(tiny_cfg):
    model = load_model(TINY, tiny_cfg, np.float32)
    ckpt = HFCheckpoint(TINY, tiny_cfg)
    np.testing.assert_array_equal(
        np.asarray(model.layers.v_khd[...]), ckpt.read(("layers", "v_khd"), np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(model.norm.scale[...]), ckpt.read(("norm", "scale"), np.float32)
    )
