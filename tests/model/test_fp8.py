"""FP8 checkpoints (model.fp8, issue 45): the format written as transformers writes it,
the strict loader's one-line refusals, and logits of an FP8 checkpoint equal to our float32
run of its dequantized weights (numpy) on every mesh kind, where a tensor share cuts a
block.

Fixtures: `moe` quantized with 8 x 8 blocks (experts and the dense layer 2), `wide`
quantized with 16 x 16 blocks (its D = 32 and F = 100 are smaller than
128: at tensor 2 each device holds 50 MLP columns, so a share ends inside a 16-block), and
a random config with Qwen's 128 x 128 blocks whose MLP width 384 splits 192 a device at
tensor 2 (inside the second block). Our float32 path on the dequantized checkpoint is the
one test_tensor and test_engine_mesh check against transformers.
Budget: one engine per (checkpoint, mesh), one generate each.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import fixture
from safetensors.numpy import save_file

from qwen3_spmd.model import fp8
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint, LoadError
from qwen3_spmd.model.checkpoint.orbax_io import OrbaxCheckpoint, is_orbax_checkpoint
from qwen3_spmd.model.checkpoint.quantize import dequantize_fp8, quantize_fp8
from qwen3_spmd.model.config import ConfigError, Qwen3Config
from qwen3_spmd.model.params import param_path
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling import static_batch
from qwen3_spmd.run import traffic
from qwen3_spmd.sharding.footprint import bytes_per_device
from qwen3_spmd.sharding.mesh import make_mesh

TOL = 1e-4  # the parity tests' float32 tolerance
N_NEW = 6

# MLP width 384: 192 a device at tensor 2, which starts inside the second 128-block.
WIDE128 = Qwen3Config(
    vocab_size=263,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=10_000.0,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (fp8 folder, its float32 dequantization)}."""
    from qwen3_spmd.run.convert import write_random_hf

    root = tmp_path_factory.mktemp("fp8")
    src, _, _, _ = fixture("wide")
    write_random_hf(WIDE128, root / "w128-src", seed=5)
    out = {}
    moe, _, _, _ = fixture("moe")
    for name, source, block in (
        ("wide16", src, (16, 16)),
        ("w128", root / "w128-src", None),
        ("moe8", moe, (8, 8)),
    ):
        q = root / name
        quantize_fp8(source, q, *([block] if block else []))
        dequantize_fp8(q, root / f"{name}-f32")
        out[name] = (q, root / f"{name}-f32")
    return out


_ENGINES: dict[tuple, Engine] = {}


def _run(folder, S, C, X):
    key = (str(folder), S, C, X)
    if key not in _ENGINES:
        cfg = Qwen3Config.from_hf(folder)
        mesh = make_mesh(S, C, jax.devices()[: S * C * X], tensor=X)
        orbax = is_orbax_checkpoint(folder)
        source = (OrbaxCheckpoint if orbax else HFCheckpoint)(folder, cfg)
        engine = Engine(cfg, source, mesh, max_seq_len=64, chunk=4)
        _ENGINES[key] = (engine, static_batch.generate(engine, _prompts(cfg), N_NEW))
    return _ENGINES[key]


def _prompts(cfg):
    rng = np.random.default_rng(11)
    return [rng.integers(0, cfg.V, n).tolist() for n in (9, 3, 17)]


# ---- the format -----------------------------------------------------------------------


def test_quantize_is_transformers_rule_with_ragged_edge_blocks():
    """scale_inv = block absmax / 448 (1 for a zero block), W8 = W / scale_inv rounded to
    e4m3; blocks at the edges hold what rows and columns there are."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    w[128:256, 128:] = 0  # a zero block
    blocks = fp8.FP8Blocks(128, 128)
    w8, scale_inv = fp8.quantize_blocks(w, blocks)
    assert w8.dtype == np.dtype("float8_e4m3fn") and scale_inv.dtype == np.float32
    assert w8.shape == (300, 200) and scale_inv.shape == (3, 2)
    for r in range(3):
        for c in range(2):
            block = w[128 * r : 128 * (r + 1), 128 * c : 128 * (c + 1)]
            want = np.abs(block).max() / 448 if np.abs(block).max() else 1.0
            np.testing.assert_allclose(scale_inv[r, c], want, rtol=1e-6)
    back = fp8.dequantize_blocks(w8, scale_inv, blocks)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a value (normals).
    big = np.abs(w) > 2**-6 * np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:300, :200] * 448
    assert np.all(np.abs(back - w)[big] <= np.abs(w)[big] / 16)
    assert np.all(back[128:256, 128:] == 0)


def test_written_folder_is_the_published_format(folders):
    q, _ = folders["w128"]
    raw = json.loads((q / "config.json").read_text())
    assert raw["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    start, header = _header(q / "model.safetensors")
    name = "model.layers.1.mlp.gate_proj.weight"
    assert header[name]["dtype"] == "F8_E4M3" and header[name]["shape"] == [384, 128]
    assert header[name + "_scale_inv"] == {**header[name + "_scale_inv"], "shape": [3, 1]}
    assert header[name + "_scale_inv"]["dtype"] == "F32"
    for unquantized in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert header[unquantized]["dtype"] == "F32" and unquantized + "_scale_inv" not in header


def _header(file):
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


# ---- MoE experts ------------------------------------------------------------------------


EXPERT_WEIGHTS = ("gate_efd", "up_efd", "down_edf")


def _fp8_experts():
    """An FP8 MoE layer of the moe fixture's shapes (8-blocks), random scales."""
    import dataclasses

    from flax import nnx

    from qwen3_spmd.model import moe

    _, cfg, _, _ = fixture("moe")
    cfg = dataclasses.replace(cfg, fp8_block=(8, 8))
    layer = moe.MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    for i, name in enumerate(EXPERT_WEIGHTS):
        scale = getattr(layer, name + fp8.SCALE_SUFFIX)
        scale[...] = jax.random.uniform(jax.random.key(i), scale.shape, minval=0.5, maxval=2)
    return cfg, layer


@pytest.mark.parametrize(
    "how, rows",
    [("looped", 3), ("gathered", 3), ("looped", 4), ("gathered", 4), ("blocked", 1)]
    + [("dense", 1), ("grouped", 1)],
)
def test_fp8_experts_dequantize_what_a_formulation_reads(how, rows):
    """Each MoE formulation on FP8 experts gives its sums on their dequantized weights. A
    decode formulation (looped, gathered) with fewer (row, choice) pairs than experts
    never makes all E experts' float32 weights: it dequantizes the experts its rows
    chose (3 rows x 2 choices of 8 experts); from E pairs on (4 rows), and for those
    that read every expert (dense, grouped, blocked), the stack is dequantized once."""
    from qwen3_spmd.model import moe

    cfg, layer = _fp8_experts()
    x = jax.random.normal(jax.random.key(7), (rows, cfg.D))
    weights, ids, _ = moe.route(x, layer.router_ed[...], cfg.A, cfg.norm_topk_prob)
    stored = [layer.linear.stored(layer, n) for n in EXPERT_WEIGHTS]

    def fp8_run(x, weights, ids, stored):
        ws = [moe.Stacked(w, s, n, layer.linear) for (w, s), n in zip(stored, EXPERT_WEIGHTS)]
        return moe.FORMULATIONS[how](x, weights, ids, *ws)

    def plain_run(x, weights, ids, whole):
        return moe.FORMULATIONS[how](x, weights, ids, *map(moe.Stacked, whole))

    text = jax.jit(fp8_run).lower(x, weights, ids, stored).as_text()
    E, F, D = layer.gate_efd.shape
    whole_f32 = [f"tensor<{E}x{F}x{D}xf32>", f"tensor<{E}x{D}x{F}xf32>"]
    by_pairs = how in ("looped", "gathered")
    assert any(t in text for t in whole_f32) == (rows * cfg.A >= E or not by_pairs), how
    if how in ("dense", "grouped"):
        return  # read whole, as before: the layer tests cover their sums
    whole = [layer.linear.read(layer, n) for n in EXPERT_WEIGHTS]
    np.testing.assert_allclose(
        jax.jit(fp8_run)(x, weights, ids, stored),
        jax.jit(plain_run)(x, weights, ids, whole),
        rtol=1e-6,
        atol=1e-6,
    )


# ---- exact on every mesh ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, mesh",
    [
        ("wide16", (1, 1, 1)),
        ("wide16", (2, 1, 1)),
        ("wide16", (1, 2, 1)),
        ("wide16", (1, 1, 2)),  # 50 MLP columns a device: a share ends inside a 16-block
        ("wide16", (1, 1, 4)),  # K = 2 < X: KV heads and their scales repeated
        ("wide16", (2, 2, 2)),
        ("w128", (1, 1, 2)),  # 192 MLP columns a device: inside the second 128-block
        ("moe8", (1, 1, 1)),  # experts quantized (8-blocks; a dense layer among them)
        ("moe8", (1, 1, 2)),  # each expert's 10 columns split 5 a device: inside an 8-block
    ],
    ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)),
)
def test_fp8_logits_equal_float32_on_dequantized_weights(folders, name, mesh):
    q, f32 = folders[name]
    _, base = _run(f32, 1, 1, 1)
    _, gen = _run(q, *mesh)
    np.testing.assert_allclose(gen.first_logits, base.first_logits, atol=TOL, rtol=0)
    assert [c.token_ids for c in gen.completions] == [c.token_ids for c in base.completions]


@pytest.mark.parametrize("name", ["wide16", "moe8"])
def test_fp8_through_orbax_keeps_one_byte_a_weight_and_the_logits(folders, name, tmp_path):
    """convert to orbax stores the projections float8 beside their float32 scales (a
    byte and 4 / block of one a weight, against float32's 4) and restores them into the
    same logits on 1x1x2, where a tensor share ends inside a block."""
    from qwen3_spmd.run.conversion import convert

    q, f32 = folders[name]
    meta = convert(q, tmp_path / "orbax", dtype="float32")
    plain = convert(f32, tmp_path / "plain", dtype="float32")
    linear = bytes_per_device(Qwen3Config.from_hf(f32), 1, 1, jnp.float32)["linear"]
    assert plain["bytes"] - meta["bytes"] >= 0.6 * linear, (meta["bytes"], plain["bytes"])
    engine, gen = _run(tmp_path / "orbax", 1, 1, 2)
    _, base = _run(f32, 1, 1, 1)
    np.testing.assert_allclose(gen.first_logits, base.first_logits, atol=TOL, rtol=0)
    assert [c.token_ids for c in gen.completions] == [c.token_ids for c in base.completions]
    held = {
        param_path(k)[-1]: x.dtype
        for k, x in jax.tree_util.tree_flatten_with_path(engine.weights.state)[0]
    }
    assert held["q_nhd"] == held["down_df" if name == "wide16" else "down_edf"] == fp8.FP8
    assert held["q_nhd_scale"] == jnp.float32


def test_fp8_weights_are_one_byte_on_the_devices(folders):
    """The devices' own buffers: projections float8 plus float32 scales, as footprint
    counts them, at most 0.52 of bfloat16's bytes (128-blocks: 1 + 4/128 bytes a weight)."""
    q, _ = folders["w128"]
    engine, _ = _run(q, 1, 1, 2)
    cfg = Qwen3Config.from_hf(q)
    linear = [
        x
        for k, x in jax.tree_util.tree_flatten_with_path(engine.weights.state)[0]
        if fp8.weight_name(param_path(k)[-1]) in fp8.D_AXIS
    ]
    assert {x.dtype for x in linear} == {jnp.dtype(fp8.FP8), jnp.dtype(jnp.float32)}
    measured = max(traffic.bytes_per_device(linear))
    mine = bytes_per_device(cfg, 1, 1, jnp.float32, tensor=2)
    plain = Qwen3Config(**{**cfg.__dict__, "fp8_block": None})
    bf16 = bytes_per_device(plain, 1, 1, jnp.bfloat16, tensor=2)
    assert measured == mine["linear"]
    assert mine["linear"] / bf16["linear"] <= 0.52, mine["linear"] / bf16["linear"]
    # bench's decode roofline reads the projections as the devices hold them (the two
    # devices' halves), the rest in the run's dtype
    from qwen3_spmd.run.bench.measure import _projections, decode_bytes_per_step

    read = decode_bytes_per_step(cfg, 1, 0, 4)["weights"]
    rest = decode_bytes_per_step(plain, 1, 0, 4)["weights"] - 4 * sum(_projections(plain, 1))
    assert read - rest == sum(traffic.bytes_per_device(linear))


# ---- one-line refusals --------------------------------------------------------------------


def _config(**quantization):
    raw = json.loads((fixture("wide")[0] / "config.json").read_text())
    return {**raw, "quantization_config": quantization}


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"quant_method": "gptq"}, "quant_method='gptq'"),
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
        ({"weight_block_size": None}, "weight_block_size=None"),
        ({"weight_block_size": [128]}, "weight_block_size=[128]"),
        ({"modules_to_not_convert": ["model.layers.0.mlp.gate_proj"]}, "modules_to_not_convert"),
        ({"ignored_layers": ["model.layers.1.self_attn.q_proj"]}, "ignored_layers"),
    ],
)
def test_quantization_configs_the_engine_does_not_take(change, field):
    with pytest.raises(ConfigError) as e:
        Qwen3Config.from_hf(_config(**{**FP8, **change}))
    assert "\n" not in str(e.value) and f"quantization_config.{field}" in str(e.value)


def test_modules_kept_unquantized_are_accepted():
    skip = ["lm_head", "model.layers.0.mlp.gate", "model.norm", "model.embed_tokens"]
    cfg = Qwen3Config.from_hf(_config(**FP8, modules_to_not_convert=skip))
    assert cfg.fp8_block == (128, 128)


def _tamper(folders, tmp_path, edit, config=None):
    """A copy of the wide16 folder whose tensors `edit` changes (and config.json)."""
    q, _ = folders["wide16"]
    out = tmp_path / "bad"
    shutil.copytree(q, out)
    ckpt = HFCheckpoint(q, Qwen3Config.from_hf(q))
    tensors = {n: ckpt._read_tensor(n) for n in ckpt.files}
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    if config is not None:
        (out / "config.json").write_text(
            json.dumps(config(json.loads((q / "config.json").read_text())))
        )
    return out


SCALE = "model.layers.2.self_attn.o_proj.weight_scale_inv"


@pytest.mark.parametrize(
    "edit, config, message",
    [
        (lambda t: t.pop(SCALE), None, f"lacks tensor {SCALE}, the FP8 scales"),
        (
            lambda t: t.update({SCALE: t[SCALE][:1]}),
            None,
            f"tensor {SCALE} in model.safetensors has shape [1, 4]",
        ),
        (
            lambda t: None,
            lambda c: {
                **c,
                "quantization_config": {**c["quantization_config"], "weight_block_size": [32, 32]},
            },
            "weight_block_size [32, 32] implies [2, 1]",
        ),
        (
            lambda t: None,
            lambda c: {k: v for k, v in c.items() if k != "quantization_config"},
            "has FP8 scales model.layers.0.mlp.down_proj.weight_scale_inv (and 34 more), but config.json has no quantization_config",
        ),
    ],
    ids=["missing-scale", "scale-shape", "block-size", "no-quantization-config"],
)
def test_bad_fp8_checkpoints_fail_in_one_line(folders, tmp_path, edit, config, message):
    bad = _tamper(folders, tmp_path, edit, config)
    with pytest.raises(LoadError) as e:
        HFCheckpoint(bad, Qwen3Config.from_hf(bad))
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)


def test_float_weights_under_an_fp8_config_name_the_tensor(folders, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _tamper(folders, tmp_path, lambda t: t.update({name: t[name].astype(np.float32)}))
    with pytest.raises(LoadError, match=f"^tensor {name} in model.safetensors holds F32, but"):
        HFCheckpoint(bad, Qwen3Config.from_hf(bad))


def test_convert_quantize_writes_an_fp8_folder_and_refuses_an_fp8_one(tmp_path, capsys):
    from qwen3_spmd.run.cli import main

    src, cfg, _, _ = fixture("tied")
    out = tmp_path / "q"
    assert main(["convert", "--model", str(src), "--out", str(out), "--quantize", "fp8"]) == 0
    assert Qwen3Config.from_hf(out).fp8_block == (128, 128)
    HFCheckpoint(out, Qwen3Config.from_hf(out))  # every tensor checked
    assert (
        main(["convert", "--model", str(out), "--out", str(tmp_path / "r"), "--quantize", "fp8"])
        == 2
    )
    assert "is already quantized" in capsys.readouterr().err


def test_convert_quantize_writes_shards_as_transformers_does(tmp_path, capsys):
    """--max-shard-size: the FP8 folder in model-0000i-of-0000N.safetensors files with
    their index, each file at most the size but where one tensor alone is larger; the
    same tensors as the one-file folder, read by the loader; --force replaces a sharded
    folder; a size that is not one is a one-line refusal."""
    from qwen3_spmd.run.cli import main

    src, _, _, _ = fixture("wide")
    out = tmp_path / "q"
    limit = 40_000  # bytes: the float32 embedding (333 x 32 x 4 = 42,624) is larger
    argv = ["convert", "--model", str(src), "--out", str(out), "--quantize", "fp8"]
    assert main([*argv, "--max-shard-size", f"{limit / 1000}KB"]) == 0
    capsys.readouterr()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists() and not list(out.glob("*.part"))
    sizes = {}
    for f in files:
        _, header = _header(out / f)
        held = {k: v for k, v in header.items() if k != "__metadata__"}
        assert {k for k, v in index["weight_map"].items() if v == f} == set(held)
        sizes[f] = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in held.values())
        assert sizes[f] <= limit or len(held) == 1, f
        umask = os.umask(0)
        os.umask(umask)
        assert (out / f).stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    assert index["metadata"]["total_size"] == sum(sizes.values())
    # the same tensors as one file of the same quantization
    single = tmp_path / "single"
    assert main(["convert", "--model", str(src), "--out", str(single), "--quantize", "fp8"]) == 0
    a = HFCheckpoint(out, Qwen3Config.from_hf(out))
    b = HFCheckpoint(single, Qwen3Config.from_hf(single))
    assert set(a.files) == set(b.files)
    for name in b.files:
        x, y = a._read_tensor(name), b._read_tensor(name)
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name
    assert main([*argv, "--force", "--max-shard-size", "5GB"]) == 0
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    capsys.readouterr()
    assert main([*argv, "--force", "--max-shard-size", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--max-shard-size 'lots' is not a size" in err, err


def test_a_part_of_fp8_weights_and_scales_is_those_rows(folders):
    """What a host whose devices hold some of the `tensor` rows reads (sharding.place):
    the float8 rows and their scales' rows, equal to those rows of the whole, including
    parts that start or end inside a block."""
    from reference import split_parts

    q, _ = folders["wide16"]
    ckpt = HFCheckpoint(q, Qwen3Config.from_hf(q))
    checked = set()
    for path, layers, part in split_parts(ckpt):
        dtype = fp8.FP8 if path[-1] in fp8.D_AXIS else np.float32
        got = ckpt.read(path, dtype, layers, part)
        want = part.of(ckpt.read(path, dtype, layers))
        assert got.dtype == want.dtype == dtype, path
        assert np.array_equal(got.astype(np.float32), want.astype(np.float32)), (path, part)
        checked.add(path[-1])
    assert {"gate_fd_scale", "down_df_scale", "o_dnh_scale", "k_khd_scale"} <= checked


def test_bfloat16_scales_read_as_their_float32_values(folders, tmp_path):
    """Qwen's dense FP8 releases store weight_scale_inv in bfloat16: read and expanded
    exactly (bfloat16 -> float32 is exact)."""
    import ml_dtypes

    def to_bf16(t):
        for n in [n for n in t if n.endswith("_scale_inv")]:
            t[n] = t[n].astype(ml_dtypes.bfloat16)

    bad = _tamper(folders, tmp_path, to_bf16)
    q, _ = folders["wide16"]
    got = HFCheckpoint(bad, Qwen3Config.from_hf(bad)).read(("layers", "o_dnh_scale"), np.float32)
    whole = HFCheckpoint(q, Qwen3Config.from_hf(q)).read(("layers", "o_dnh_scale"), np.float32)
    assert got.dtype == np.float32 and got.shape == whole.shape == (5, 2, 8, 8)
    np.testing.assert_array_equal(got, whole.astype(ml_dtypes.bfloat16).astype(np.float32))
