"""Pooling models: Qwen3-Embedding and Qwen3-Reranker, as their files say.

A pooling runner's prefill gives each input's last token's hidden state after the final
norm, h [D] (`pipeline.programs.prefill`, pooled). `Pooling` turns h into the output:

    embed  h itself, L2-normalised (sentence-transformers' last-token Pooling then
           Normalize, as Qwen3-Embedding's modules.json lists them); with Matryoshka
           `dimensions` d, the first d values renormalised (vLLM's rule).
    score  P("yes") against "no" at the pair's last position (Qwen3-Reranker's model
           card): softmax over the two logits, which is sigmoid(h . (w_yes - w_no))
           with w the lm_head rows of the two tokens (vLLM's converted classifier).

Which one, and its settings, come from the folder: sentence-transformers' modules.json,
1_Pooling/config.json and config_sentence_transformers.json for an embedding model;
vLLM's `hf_overrides` (architectures Qwen3ForSequenceClassification, classifier_from_token
["no", "yes"], is_original_qwen3_reranker) for the reranker, which is a causal LM; and
config.json's (or the overrides') `is_matryoshka` / `matryoshka_dimensions`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from qwen3_spmd.model.config import ConfigError, Qwen3Config
from qwen3_spmd.model.params import Part
from qwen3_spmd.pipeline.requests import RequestError

RERANKER = "Qwen3ForSequenceClassification"  # the architecture vLLM's overrides name
MODULES = "modules.json"
POOLING_CONFIG = "1_Pooling/config.json"
ST_CONFIG = "config_sentence_transformers.json"
# hf_overrides keys this runner reads; any other is refused (a typo would be silent).
OVERRIDES = (
    "architectures",
    "classifier_from_token",
    "is_original_qwen3_reranker",
    "is_matryoshka",
    "matryoshka_dimensions",
)


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How hidden states [D] become a pooling model's outputs.

    task: "embed" or "score". normalize: embeddings L2-normalised. matryoshka: the
    `dimensions` an embedding may be cut to (None: not a Matryoshka model; () any from
    1 to D). prompts: sentence-transformers' named prompts (the query instruction), put
    before a text on request (`prompt`). classifier: score's [D] float64, w_yes - w_no; labels: the
    (no, yes) token ids it was taken from."""

    task: str
    D: int
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None
    prompts: dict = dataclasses.field(default_factory=dict)
    classifier: np.ndarray | None = None
    labels: tuple[int, int] | None = None

    def check_dimensions(self, dimensions: int | None) -> None:
        """A request's Matryoshka `dimensions` (None: the whole D), in words."""
        if dimensions is None:
            return
        if self.task != "embed":
            raise RequestError("$dimensions applies to embeddings, not scores", "dimensions")
        if self.matryoshka is None:
            raise RequestError(
                f"$dimensions {dimensions}: this model does not support Matryoshka "
                "representation (config.json has no is_matryoshka or matryoshka_dimensions)",
                "dimensions",
            )
        allowed = self.matryoshka or range(1, self.D + 1)
        if dimensions not in allowed:
            which = f"one of {list(self.matryoshka)}" if self.matryoshka else f"from 1 to {self.D}"
            raise RequestError(f"$dimensions {dimensions} is not {which}", "dimensions")

    def prompt(self, name: str) -> str:
        """Named prompt `name` (sentence-transformers'), in words when there is none."""
        if name not in self.prompts:
            have = ", ".join(sorted(self.prompts)) or "none"
            raise RequestError(
                f"$prompt_name {name!r} is not a prompt of this model's "
                f"{ST_CONFIG} (it has: {have})",
                "prompt_name",
            )
        return self.prompts[name]

    def embed(self, hidden: np.ndarray, dimensions: int | None = None) -> np.ndarray:
        """hidden [D] -> the embedding [d] float32 (d = dimensions or D)."""
        self.check_dimensions(dimensions)
        e = np.asarray(hidden, np.float64)
        if self.normalize:
            e = e / max(np.linalg.norm(e), 1e-12)
        if dimensions is not None and dimensions < self.D:
            e = e[:dimensions]
            e = e / max(np.linalg.norm(e), 1e-12)
        return e.astype(np.float32)

    def score(self, hidden: np.ndarray) -> float:
        """hidden [D] -> P(yes) over {no, yes} at that position."""
        margin = float(np.asarray(hidden, np.float64) @ self.classifier)
        return float(1.0 / (1.0 + np.exp(-margin)))


def read_overrides(overrides) -> dict:
    """vLLM's `hf_overrides` (a JSON object's text, a mapping or None) as a dict of the
    keys this runner reads (ValueError naming any other)."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not JSON ({e.msg}): pass a JSON object") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"must be a JSON object, not {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ValueError(
            f"has {unknown[0]!r}, which this runner does not read: it takes {', '.join(OVERRIDES)}"
        )
    return dict(overrides)


def asks_reranker(overrides: dict) -> bool:
    """Whether `overrides` (read_overrides') make a causal LM a reranker."""
    return RERANKER in (overrides.get("architectures") or ())


def is_embedding_folder(folder: Path | None) -> bool:
    """A sentence-transformers model (modules.json): the pooling runner's by default."""
    return folder is not None and (Path(folder) / MODULES).is_file()


def _json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e.msg}): fix or re-download it") from None


def _config_json(folder: Path | None) -> dict:
    file = Path(folder) / "config.json" if folder is not None else None
    return _json(file) if file is not None and file.is_file() else {}


def _matryoshka(config: dict, D: int, where: str) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if dims is not None:
        if not (isinstance(dims, list) and all(isinstance(d, int) and 0 < d <= D for d in dims)):
            raise ConfigError(
                f"{where}'s matryoshka_dimensions {dims!r} must be a list of sizes from 1 "
                f"to the hidden size {D}"
            )
        return tuple(sorted(set(dims)))
    return () if config.get("is_matryoshka") else None


def embedding(folder: Path | None, cfg: Qwen3Config, overrides: dict) -> Pooling:
    """An embedding model's Pooling from its folder (None: a preset, last-token pooling
    with normalisation, as vLLM defaults a decoder); a folder whose sentence-transformers
    files ask for another pooling is refused, naming the file."""
    normalize, prompts = True, {}
    if is_embedding_folder(folder):
        modules = _json(folder / MODULES)
        types = [str(m.get("type", "")) for m in modules] if isinstance(modules, list) else []
        normalize = any(t.endswith("Normalize") for t in types)
        pooling = folder / POOLING_CONFIG
        if pooling.is_file():
            modes = {k for k, v in _json(pooling).items() if k.startswith("pooling_mode") and v}
            if modes != {"pooling_mode_lasttoken"}:
                raise ConfigError(
                    f"{pooling} asks for {', '.join(sorted(modes)) or 'no pooling'}: this "
                    "runner pools Qwen3's last token (pooling_mode_lasttoken) only"
                )
        st = folder / ST_CONFIG
        if st.is_file():
            prompts = dict(_json(st).get("prompts") or {})
    config = {**_config_json(folder), **overrides}
    where = "hf_overrides" if "matryoshka_dimensions" in overrides else "config.json"
    return Pooling("embed", cfg.D, normalize, _matryoshka(config, cfg.D, where), prompts=prompts)


def reranker(folder: Path | None, cfg: Qwen3Config, overrides: dict, source, text) -> Pooling:
    """A Qwen3-Reranker's Pooling: classifier_from_token's two tokens (no, yes) looked up
    in the tokenizer, their lm_head rows read from `source` (the model's weights)."""
    if is_embedding_folder(folder):
        raise ConfigError(
            f"{folder / MODULES} says this is a sentence-transformers embedding model, and "
            f"hf_overrides ask for a reranker ({RERANKER}): leave the overrides out to embed"
        )
    if not overrides.get("is_original_qwen3_reranker"):
        raise ConfigError(
            f"hf_overrides name {RERANKER} without is_original_qwen3_reranker: this runner "
            "scores Qwen3-Reranker's way (P(yes) against no); add "
            '"is_original_qwen3_reranker": true'
        )
    tokens = overrides.get("classifier_from_token")
    if not (
        isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)
    ):
        raise ConfigError(
            f'hf_overrides\' classifier_from_token {tokens!r} must be two tokens, ["no", "yes"]'
        )
    if text is None:
        raise ConfigError(
            "a reranker looks its classifier_from_token up in tokenizer.json, and this "
            "model has none: pass a checkpoint folder with its tokenizer"
        )
    ids = []
    for token in tokens:
        id = text.tokenizer.token_to_id(token)
        if id is None or id >= cfg.V:
            raise ConfigError(
                f"classifier_from_token {token!r} is not one token of tokenizer.json: give "
                'the reranker\'s own tokens (Qwen3-Reranker\'s are "no" and "yes")'
            )
        ids.append(id)
    head = ("embed_vd",) if cfg.tie_word_embeddings else ("lm_head_vd",)
    rows = [
        source.read(head, np.float32, part=Part(0, i, i + 1))[0].astype(np.float64) for i in ids
    ]
    return Pooling("score", cfg.D, classifier=rows[1] - rows[0], labels=(ids[0], ids[1]))
