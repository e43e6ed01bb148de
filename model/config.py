"""Qwen3 configuration: one frozen, hashable dataclass read from Hugging Face's config.json.

Both layouts found in the wild are accepted: transformers 4.x (`rope_theta` and
`rope_scaling` at top level, as the published Qwen3 checkpoints have) and 5.x
(`rope_parameters`). Anything this engine does not implement is refused with an
error that names the field, so a checkpoint is never run with silently wrong maths.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json this engine cannot run: the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling parameters as transformers reads them: `rope_type` yarn (all fields
    but the two llama3 ones), linear (factor only) or llama3 (factor, the original
    window and the two frequency factors)."""

    factor: float
    original_max_position_embeddings: int
    rope_type: str = "yarn"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """The Qwen3 architecture, dense or mixture-of-experts (Qwen3-MoE). Letters: V vocab,
    D width, F MLP width, L layers, N query heads, K KV heads, H head dim, E experts,
    A experts chosen per token.

    num_experts = 0 is dense Qwen3. Otherwise layer i is sparse (a router and E experts
    of width moe_intermediate_size) when it is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0, as transformers' Qwen3MoeDecoderLayer decides;
    the other layers keep a dense MLP of width intermediate_size."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # An FP8 checkpoint's weight_block_size (rows, columns) from its quantization_config:
    # linear weights float8 with block scales (model.fp8); None: unquantized.
    fp8_block: tuple[int, int] | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(
                    f"config field {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: grouped-query attention needs it"
            )
        if self.num_experts < 0:
            raise ConfigError(
                f"config field num_experts must be 0 (dense) or positive, got {self.num_experts}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"config field num_experts_per_tok={self.num_experts_per_tok} must be "
                    f"between 1 and num_experts={self.num_experts}: fix config.json"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError(
                    f"config field moe_intermediate_size must be positive, got "
                    f"{self.moe_intermediate_size}"
                )
            if self.decoder_sparse_step <= 0:
                raise ConfigError(
                    f"config field decoder_sparse_step must be positive, got "
                    f"{self.decoder_sparse_step}"
                )

    # Letter-legend aliases, so shape code reads like the einsum strings.
    @property
    def V(self) -> int:
        return self.vocab_size

    @property
    def D(self) -> int:
        return self.hidden_size

    @property
    def F(self) -> int:
        return self.intermediate_size

    @property
    def L(self) -> int:
        return self.num_hidden_layers

    @property
    def N(self) -> int:
        return self.num_attention_heads

    @property
    def K(self) -> int:
        return self.num_key_value_heads

    @property
    def H(self) -> int:
        return self.head_dim

    @property
    def E(self) -> int:
        return self.num_experts

    @property
    def A(self) -> int:
        return self.num_experts_per_tok

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a mixture of experts (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """[L] whether each layer is sparse."""
        return tuple(self.is_sparse(i) for i in range(self.L))

    @property
    def has_sparse(self) -> bool:
        return any(self.sparse_layers)

    @property
    def has_dense(self) -> bool:
        return not all(self.sparse_layers)

    def param_count(self, active: bool = False) -> int:
        """Parameters as the published model cards count them (tied lm_head counted once).

        active: count only the A experts a token uses in each sparse layer (the
        "A3B" / "A22B" of Qwen3-MoE's names; embedding and lm_head included)."""
        D, F, N, K, H, V = self.D, self.F, self.N, self.K, self.H, self.V
        attention = D * N * H + 2 * D * K * H + N * H * D + 2 * D + 2 * H
        if self.attention_bias:
            attention += N * H + 2 * K * H + D
        experts = self.A if active else self.E
        sparse = self.E * D + experts * 3 * D * self.moe_intermediate_size
        mlp = sum(sparse if s else 3 * D * F for s in self.sparse_layers)
        embed = V * D
        head = 0 if self.tie_word_embeddings else V * D
        return self.L * attention + mlp + embed + head + D

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> Qwen3Config:
        """Reads a Hugging Face config: a dict, a config.json path or a checkpoint folder."""
        if isinstance(source, dict):
            raw = source
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ConfigError(
                    f"no config.json at {path}: pass a Hugging Face checkpoint folder"
                )
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON ({e}): fix or replace the file") from e
        return _from_dict(raw)


# transformers' Qwen3Config defaults for fields a config.json may leave out.
HF_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768}

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _integer(v) -> bool:  # JSON's true/false are Python ints too
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_types(raw: Any) -> None:
    """Every field the engine reads has the JSON type a Qwen3 config gives it (a hand-edited
    or foreign file otherwise fails deep inside with a Python error)."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config.json holds a {type(raw).__name__}, not an object of fields: "
            "replace it with the checkpoint's own"
        )

    def check(name, ok, what):
        if name in raw and not ok(raw[name]):
            raise ConfigError(f"config field {name}={raw[name]!r} must be {what}: fix config.json")

    for name in (*_REQUIRED, "max_position_embeddings"):
        check(name, _integer, "an integer")
    for name in ("num_key_value_heads", "head_dim", "bos_token_id"):
        check(name, lambda v: v is None or _integer(v), "an integer (or null)")
    for name in ("rms_norm_eps", "rope_theta"):
        check(name, _number, "a number")
    for name in (
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
    ):
        check(name, _integer, "an integer")
    check(
        "mlp_only_layers",
        lambda v: v is None or (isinstance(v, list) and all(map(_integer, v))),
        "a list of layer indices (or null)",
    )
    for name in ("tie_word_embeddings", "attention_bias", "norm_topk_prob"):
        check(name, lambda v: isinstance(v, bool), "true or false")
    check(
        "eos_token_id",
        lambda v: v is None or _integer(v) or (isinstance(v, list) and all(map(_integer, v))),
        "an integer or a list of integers",
    )
    for name in ("rope_parameters", "rope_scaling"):
        check(name, lambda v: v is None or isinstance(v, dict), "an object (or null)")


def _from_dict(raw: dict[str, Any]) -> Qwen3Config:
    _check_types(raw)
    model_type = raw.get("model_type", "qwen3")
    if model_type == "qwen3_next":
        raise ConfigError(
            "config field model_type='qwen3_next' is Qwen3-Next, a different architecture "
            "(linear-attention layers, shared experts): this engine runs Qwen3 ('qwen3') and "
            "Qwen3-MoE ('qwen3_moe') only"
        )
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ConfigError(
            f"config field model_type={model_type!r} is not supported: this engine runs "
            "Qwen3 (model_type 'qwen3') and Qwen3-MoE ('qwen3_moe') only"
        )
    moe = _moe(raw) if model_type == "qwen3_moe" else {}
    if moe:  # transformers' Qwen3MoeConfig default: a dense layer's width may go unsaid
        raw = {"intermediate_size": 6144, **raw}
    for name in _REQUIRED:
        if name not in raw:
            raise ConfigError(
                f"config.json lacks the field {name!r}, which a Qwen3 config must have"
            )
    if (
        raw.get("use_sliding_window", False)
        and raw.get("sliding_window", 4096) is not None
        and not raw.get("layer_types")
        and raw["num_hidden_layers"] > raw.get("max_window_layers", 28)
    ):
        # transformers slides the window in layers max_window_layers and up only
        raise ConfigError(
            f"config field use_sliding_window=true with max_window_layers="
            f"{raw.get('max_window_layers', 28)} below num_hidden_layers="
            f"{raw['num_hidden_layers']} asks for sliding-window layers, which this engine "
            "does not implement: set use_sliding_window to false (published Qwen3 "
            "checkpoints do)"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field hidden_act={act!r} is not supported: Qwen3 uses 'silu'")
    if raw.get("layer_types") and any(t != "full_attention" for t in raw["layer_types"]):
        raise ConfigError(
            "config field layer_types asks for non-full attention layers, "
            "which this engine does not implement"
        )

    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"config field partial_rotary_factor={raw['partial_rotary_factor']!r} "
            "is not supported: Qwen3 rotates whole heads (1.0)"
        )
    theta, scaling = _rope(raw)
    fp8_block = _quantization(raw.get("quantization_config"))
    n_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return Qwen3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=n_heads,
        # Absent fields take transformers' Qwen3Config defaults (32 KV heads, head_dim
        # 128, 32768 positions); a null KV head count means one per query head there.
        num_key_value_heads=raw.get("num_key_value_heads", HF_DEFAULTS["num_key_value_heads"])
        or n_heads,
        head_dim=raw.get("head_dim", HF_DEFAULTS["head_dim"]) or raw["hidden_size"] // n_heads,
        max_position_embeddings=raw.get(
            "max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]
        ),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        fp8_block=fp8_block,
        **moe,
    )


# The modules an FP8 checkpoint keeps unquantized (transformers and vLLM: the embedding,
# norms, lm_head and the router `mlp.gate`), by a name's last part: `gate_proj` is not
# `gate`.
_UNQUANTIZED = ("lm_head", "embed_tokens", "gate")  # and any *norm


def _unquantized(module: Any) -> bool:
    last = module.split(".")[-1] if isinstance(module, str) else ""
    return last in _UNQUANTIZED or last.endswith("norm")


def _quantization(q: Any) -> tuple[int, int] | None:
    """The block size of an FP8 checkpoint's quantization_config (None: no such field).
    Refuses, naming the field and the fix, whatever this engine does not run: another
    quant_method, fmt or activation scheme, a block size that is not two positive
    integers, or modules_to_not_convert naming a quantized projection."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(
            f"config field quantization_config={q!r} must be an object: fix config.json"
        )
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"config field quantization_config.quant_method={method!r} is not supported: "
            "this engine reads block-wise FP8 checkpoints ('fp8') and unquantized ones "
            "(no quantization_config)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(
            f"config field quantization_config.fmt={fmt!r} is not supported: FP8 weights "
            "must be float8_e4m3fn ('e4m3')"
        )
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"config field quantization_config.activation_scheme={scheme!r} is not "
            "supported: this engine keeps activations unquantized, as 'dynamic' allows"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list) and len(block) == 2 and all(_integer(b) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"config field quantization_config.weight_block_size={block!r} must be two "
            "positive integers (published FP8 checkpoints: [128, 128]); per-tensor FP8 "
            "is not supported"
        )
    # transformers names the unquantized modules modules_to_not_convert, vLLM ignored_layers.
    for field in ("modules_to_not_convert", "ignored_layers"):
        for module in q.get(field) or ():
            if not _unquantized(module):
                raise ConfigError(
                    f"config field quantization_config.{field} names {module!r}: "
                    "this engine reads every attention and MLP projection of an FP8 "
                    "checkpoint as FP8 (only the embedding, norms, lm_head and router "
                    "unquantized): dequantize that checkpoint to bfloat16 instead"
                )
    return int(block[0]), int(block[1])


def _moe(raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe config, with transformers'
    Qwen3MoeConfig defaults. The hub's config.json says num_experts, transformers 5.x
    writes num_local_experts (its attribute_map makes them one field)."""
    if (
        "num_experts" in raw
        and "num_local_experts" in raw
        and raw["num_experts"] != raw["num_local_experts"]
    ):
        raise ConfigError(
            f"config fields num_experts={raw['num_experts']} and num_local_experts="
            f"{raw['num_local_experts']} disagree: keep one of them"
        )
    experts = raw.get("num_experts", raw.get("num_local_experts", 128))
    return dict(
        num_experts=experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 8),
        moe_intermediate_size=raw.get("moe_intermediate_size", 768),
        norm_topk_prob=raw.get("norm_topk_prob", False),
        decoder_sparse_step=raw.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
    )


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, YaRN parameters or None) from either config layout."""
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("yarn", "linear", "llama3"):
        raise ConfigError(
            f"config field rope_type={rope_type!r} is not supported: use 'default', 'yarn', "
            "'linear' or 'llama3'"
        )
    needs = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "yarn": (),
    }[rope_type]
    for key in needs:
        if not _number(params.get(key)):
            raise ConfigError(
                f"config rope parameters of rope_type {rope_type!r} need a number "
                f"{key!r}: add it to config.json"
            )
    # transformers' defaults: the original window falls back to max_position_embeddings,
    # and a missing factor is the ratio of the two windows.
    max_pos = raw.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"])
    # A top-level original_max_position_embeddings wins over the one in the rope
    # parameters, as in transformers (Phi-3 style configs keep it there).
    original = (
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor") or max_pos / original
    if rope_type != "yarn":
        return theta, RopeScaling(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            rope_type=rope_type,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )
    return theta, RopeScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _preset(vocab, D, F, L, N, K, max_pos=40960, tie=False) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=K,
        head_dim=128,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    )


def _moe_preset(D, F, F_expert, L, N, K) -> Qwen3Config:
    return dataclasses.replace(
        _preset(151936, D, F, L, N, K),
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=F_expert,
        norm_topk_prob=True,
    )


# The six published dense sizes (from their config.json files) and a tiny one for tests
# and the demo. The tiny preset keeps Qwen3's shape rules (head_dim independent of the
# width, grouped-query heads) at a size that runs in seconds on a laptop CPU.
PRESETS: dict[str, Qwen3Config] = {
    "tiny": Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        bos_token_id=None,
        eos_token_ids=(),
    ),
    "0.6B": _preset(151936, 1024, 3072, 28, 16, 8, tie=True),
    "1.7B": _preset(151936, 2048, 6144, 28, 16, 8, tie=True),
    "4B": _preset(151936, 2560, 9728, 36, 32, 8, tie=True),
    "8B": _preset(151936, 4096, 12288, 36, 32, 8),
    "14B": _preset(151936, 5120, 17408, 40, 40, 8),
    "32B": _preset(151936, 5120, 25600, 64, 64, 8),
    # The two published Qwen3-MoE sizes (their config.json: every layer sparse).
    "30B-A3B": _moe_preset(2048, 6144, 768, 48, 32, 4),
    "235B-A22B": _moe_preset(4096, 12288, 1536, 94, 64, 4),
}
