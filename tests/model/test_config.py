"""Qwen3Config: both Hugging Face config layouts, the fixtures' config.json, refusals
that name the field, hashability, and the published sizes' parameter counts."""

import copy
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import FIXTURES

from qwen3_spmd.model.config import PRESETS, ConfigError, Qwen3Config, RopeScaling
from qwen3_spmd.model.layers import Qwen3

NAMES = ("tiny", "tied", "yarn")


def _raw(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _as_4x(raw: dict, type_key: str = "rope_type") -> dict:
    """The same config in transformers 4.x form: top-level rope_theta, rope_scaling."""
    out = copy.deepcopy(raw)
    params = out.pop("rope_parameters")
    out["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    out["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **params}
    return out


# Qwen3-0.6B's published config.json (transformers 4.51 layout).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


# ---- layouts and the fixtures ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fixture_config_parses_to_its_fields(name):
    raw = _raw(name)
    cfg = Qwen3Config.from_hf(FIXTURES / name)
    assert (cfg.V, cfg.D, cfg.F, cfg.L, cfg.N, cfg.K, cfg.H) == (
        raw["vocab_size"],
        raw["hidden_size"],
        raw["intermediate_size"],
        raw["num_hidden_layers"],
        raw["num_attention_heads"],
        raw["num_key_value_heads"],
        raw["head_dim"],
    )
    assert cfg.max_position_embeddings == raw["max_position_embeddings"]
    assert cfg.rms_norm_eps == raw["rms_norm_eps"]
    assert cfg.tie_word_embeddings == raw["tie_word_embeddings"]
    assert cfg.attention_bias == raw["attention_bias"]
    assert cfg.bos_token_id == raw["bos_token_id"]
    assert cfg.eos_token_ids == (raw["eos_token_id"],)
    params = raw["rope_parameters"]
    assert cfg.rope_theta == params["rope_theta"]
    if params["rope_type"] == "default":
        assert cfg.rope_scaling is None
    else:
        y = cfg.rope_scaling
        assert y.factor == params["factor"]
        assert y.original_max_position_embeddings == params["original_max_position_embeddings"]
        # transformers' defaults where the file is silent
        assert (y.beta_fast, y.beta_slow, y.truncate) == (32.0, 1.0, True)
        assert y.attention_factor is None and y.mscale is None and y.mscale_all_dim is None


@pytest.mark.parametrize("name", NAMES)
def test_folder_file_and_dict_sources_agree(name):
    folder = FIXTURES / name
    assert Qwen3Config.from_hf(folder) == Qwen3Config.from_hf(folder / "config.json")
    assert Qwen3Config.from_hf(str(folder)) == Qwen3Config.from_hf(_raw(name))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_transformers_4x_layout_equals_5x_layout(name, type_key):
    five = Qwen3Config.from_hf(_raw(name))
    four = Qwen3Config.from_hf(_as_4x(_raw(name), type_key))
    assert four == five


def test_4x_yarn_with_every_option_equals_5x():
    base = _raw("yarn")
    options = {
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 24.0,
        "beta_slow": 2.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.5,
        "truncate": False,
    }
    five = copy.deepcopy(base)
    five["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, **options}
    four = copy.deepcopy(base)
    del four["rope_parameters"]
    four["rope_theta"] = 5000.0
    four["rope_scaling"] = {"type": "yarn", **options}
    c4, c5 = Qwen3Config.from_hf(four), Qwen3Config.from_hf(five)
    assert c4 == c5
    assert c5.rope_theta == 5000.0
    assert c5.rope_scaling == RopeScaling(
        factor=8.0,
        original_max_position_embeddings=16,
        beta_fast=24.0,
        beta_slow=2.0,
        mscale=0.707,
        mscale_all_dim=0.5,
        truncate=False,
    )


def test_published_0_6b_config_is_the_preset():
    cfg = Qwen3Config.from_hf(QWEN3_0_6B)
    # The preset lists generation_config.json's two EOS ids; config.json names one.
    assert cfg.eos_token_ids == (151645,)
    assert dataclasses.replace(cfg, eos_token_ids=PRESETS["0.6B"].eos_token_ids) == PRESETS["0.6B"]
    assert isinstance(cfg.rope_theta, float) and cfg.rope_theta == 1e6


def test_defaults_for_optional_fields_are_transformers_defaults():
    """A config.json without head_dim, num_key_value_heads or max_position_embeddings
    means what transformers' Qwen3Config makes of it: 128, 32 and 32768 (not hidden /
    heads, one KV head per query head, or the published 40960)."""
    raw = {
        k: v
        for k, v in _raw("tiny").items()
        if k
        not in ("head_dim", "num_key_value_heads", "max_position_embeddings", "rope_parameters")
    }
    raw["num_attention_heads"] = 64
    cfg = Qwen3Config.from_hf(raw)
    assert (cfg.K, cfg.H, cfg.max_position_embeddings) == (32, 128, 32768)
    assert cfg.rope_scaling is None
    assert Qwen3Config.from_hf({**raw, "num_key_value_heads": None}).K == 64
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Qwen3Config(**raw)
    assert (theirs.num_key_value_heads, theirs.head_dim, theirs.max_position_embeddings) == (
        cfg.K,
        cfg.H,
        cfg.max_position_embeddings,
    )


def test_top_level_original_window_wins_for_yarn():
    raw = _raw("tiny")
    raw["rope_parameters"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 64,
    }
    raw["original_max_position_embeddings"] = 16
    assert Qwen3Config.from_hf(raw).rope_scaling.original_max_position_embeddings == 16


def test_refuses_partial_rotary_factor():
    raw = _raw("tiny")
    raw["partial_rotary_factor"] = 0.5
    assert "partial_rotary_factor" in _refused(raw)


def test_eos_list_becomes_a_tuple():
    raw = _raw("tiny")
    raw["eos_token_id"] = [302, 300]
    assert Qwen3Config.from_hf(raw).eos_token_ids == (302, 300)


# ---- refusals --------------------------------------------------------------------------------


def _refused(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        Qwen3Config.from_hf(raw)
    return str(e.value)


def test_refuses_other_architectures():
    raw = _raw("tiny")
    raw["model_type"] = "llama"
    msg = _refused(raw)
    assert "model_type" in msg and "llama" in msg
    raw["model_type"] = "qwen3_next"
    assert "Qwen3-Next, a different architecture" in _refused(raw)


def test_refuses_sliding_window():
    raw = _raw("tiny")
    raw["use_sliding_window"] = True
    raw["sliding_window"] = 16
    raw["max_window_layers"] = 2  # transformers slides layers 2 and up
    del raw["layer_types"]  # (which it derives from the above)
    assert "use_sliding_window" in _refused(raw)


def test_sliding_window_switched_on_for_no_layer_is_full_attention():
    """transformers slides the window only in layers max_window_layers and up (none
    here, nor with a null window), so these are plain Qwen3 configs."""
    plain = Qwen3Config.from_hf(_raw("tiny"))
    raw = _raw("tiny")
    raw["use_sliding_window"] = True
    raw["sliding_window"] = 16
    raw["max_window_layers"] = raw["num_hidden_layers"]
    del raw["layer_types"]
    assert Qwen3Config.from_hf(raw) == plain
    assert Qwen3Config.from_hf({**raw, "max_window_layers": 1, "sliding_window": None}) == plain


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_refuses_unknown_rope_type(layout, rope_type):
    raw = _raw("yarn")
    raw["rope_parameters"]["rope_type"] = rope_type
    if layout == "4.x":
        raw = _as_4x(raw, "type")
    msg = _refused(raw)
    assert "rope_type" in msg and rope_type in msg


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_refuses_other_activation(act):
    raw = _raw("tiny")
    raw["hidden_act"] = act
    msg = _refused(raw)
    assert "hidden_act" in msg and act in msg


def test_refuses_heads_not_a_multiple_of_kv_heads():
    raw = _raw("tiny")
    raw["num_attention_heads"], raw["num_key_value_heads"] = 6, 4
    msg = _refused(raw)
    assert "num_attention_heads=6" in msg and "num_key_value_heads=4" in msg


def test_refuses_sliding_layer_types():
    raw = _raw("tiny")
    raw["layer_types"] = ["full_attention", "sliding_attention"] + ["full_attention"] * 3
    assert "layer_types" in _refused(raw)


@pytest.mark.parametrize(
    "field",
    ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"],
)
def test_refuses_missing_required_field(field):
    raw = _raw("tiny")
    del raw[field]
    assert field in _refused(raw)


@pytest.mark.parametrize("field", ["vocab_size", "num_hidden_layers", "head_dim"])
def test_refuses_non_positive_size(field):
    raw = _raw("tiny")
    raw[field] = 0 if field != "head_dim" else -16
    assert field in _refused(raw)


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", None),
        ("hidden_size", 48.0),
        ("max_position_embeddings", None),
        ("num_key_value_heads", "2"),
        ("rope_theta", "abc"),
        ("rms_norm_eps", True),
        ("tie_word_embeddings", "yes"),
        ("eos_token_id", "abc"),
        ("eos_token_id", [1, "2"]),
        ("rope_scaling", "yarn"),
    ],
)
def test_refuses_a_field_of_the_wrong_type(field, value):
    raw = _raw("tiny")
    raw[field] = value
    assert f"config field {field}=" in _refused(raw)


def test_refuses_a_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a list"):
        Qwen3Config.from_hf(tmp_path)


def test_missing_and_invalid_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        Qwen3Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Qwen3Config.from_hf(tmp_path)


# ---- frozen, hashable ------------------------------------------------------------------------


def test_config_is_frozen_and_hashable():
    a = Qwen3Config.from_hf(FIXTURES / "yarn")
    b = Qwen3Config.from_hf(FIXTURES / "yarn")
    assert a is not b and a == b and hash(a) == hash(b)
    assert len({a, b, Qwen3Config.from_hf(FIXTURES / "tiny")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hidden_size = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rope_scaling.factor = 2.0


def test_config_is_a_static_jit_argument():
    calls = []

    def f(cfg, x):
        calls.append(cfg)
        return x * cfg.H

    g = jax.jit(f, static_argnums=0)
    cfg = Qwen3Config.from_hf(FIXTURES / "tiny")
    assert float(g(cfg, jnp.float32(2.0))) == 2.0 * cfg.H
    assert float(g(Qwen3Config.from_hf(FIXTURES / "tiny"), jnp.float32(3.0))) == 3.0 * cfg.H
    assert len(calls) == 1  # an equal config hits the cache: no retrace


# ---- presets: published parameter counts -----------------------------------------------------

# Qwen3 model cards: (total, non-embedding) in billions, as printed.
PUBLISHED = {
    "0.6B": ("0.6", "0.44"),
    "1.7B": ("1.7", "1.4"),
    "4B": ("4.0", "3.6"),
    "8B": ("8.2", "6.95"),
    "14B": ("14.8", "13.2"),
    "32B": ("32.8", "31.2"),
}


def _abstract_param_counts(cfg: Qwen3Config) -> tuple[int, dict]:
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    sizes = {jax.tree_util.keystr(p): math.prod(x.shape) for p, x in leaves}
    return sum(sizes.values()), sizes


def _rounded(x: float, printed: str) -> str:
    digits = len(printed.split(".")[1]) if "." in printed else 0
    return f"{x:.{digits}f}"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_match_model_cards(name):
    cfg = PRESETS[name]
    total, sizes = _abstract_param_counts(cfg)
    assert total == cfg.param_count()
    # Tied presets have no lm_head leaf, untied ones one [D, V] leaf.
    heads = [k for k in sizes if "lm_head" in k]
    assert len(heads) == (0 if cfg.tie_word_embeddings else 1)
    embedding = cfg.V * cfg.D * (1 if cfg.tie_word_embeddings else 2)
    want_total, want_non_embedding = PUBLISHED[name]
    assert _rounded(total / 1e9, want_total) == want_total
    assert _rounded((total - embedding) / 1e9, want_non_embedding) == want_non_embedding


def test_tiny_preset_counts_and_shapes():
    cfg = PRESETS["tiny"]
    total, sizes = _abstract_param_counts(cfg)
    assert total == cfg.param_count()
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    # Layers are stacked on a leading L axis.
    assert model.layers.q_nhd.shape == (cfg.L, cfg.N, cfg.H, cfg.D)
    assert model.layers.o_dnh.shape == (cfg.L, cfg.D, cfg.N, cfg.H)
    assert model.layers.k_khd.shape == (cfg.L, cfg.K, cfg.H, cfg.D)
    assert cfg.N % cfg.K == 0 and cfg.N != cfg.K  # grouped-query heads
    assert cfg.N * cfg.H != cfg.D  # head_dim independent of the width


def test_32b_model_shapes_without_allocating():
    cfg = PRESETS["32B"]
    model = nnx.eval_shape(lambda: Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert model.embed_vd.shape == (151936, 5120)
    assert model.lm_head_vd.shape == (151936, 5120)
    assert model.layers.gate_fd.shape == (64, 25600, 5120)
    assert model.layers.k_khd.shape == (64, 8, 128, 5120)
    assert model.layers.q_norm.scale.shape == (64, 128)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # about 65.5 GB of bfloat16 weights, never allocated here
    assert isinstance(model.embed_vd.get_value(), jax.ShapeDtypeStruct)
    assert np.isclose(cfg.param_count() * 2 / 1e9, 65.5, atol=0.1)


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
def test_linear_and_llama3_rope(layout):
    raw = _raw("yarn")
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    linear = Qwen3Config.from_hf(_as_4x(raw, "type") if layout == "4.x" else raw)
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.factor) == ("linear", 2.0)
    assert linear.rope_theta == 5000.0
    raw["rope_parameters"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 5000.0,
    }
    y = Qwen3Config.from_hf(_as_4x(raw, "type") if layout == "4.x" else raw).rope_scaling
    assert (
        y.rope_type,
        y.factor,
        y.low_freq_factor,
        y.high_freq_factor,
        y.original_max_position_embeddings,
    ) == ("llama3", 8.0, 1.0, 4.0, 64)


@pytest.mark.parametrize(
    "rope_type, missing", [("linear", "factor"), ("llama3", "low_freq_factor")]
)
def test_refuses_scaled_rope_without_its_parameters(rope_type, missing):
    raw = _raw("yarn")
    raw["rope_parameters"] = {
        "rope_type": rope_type,
        "factor": 2.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "rope_theta": 5000.0,
    }
    del raw["rope_parameters"][missing]
    assert missing in _refused(raw)
