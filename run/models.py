"""Resolving `--model`: a Hugging Face checkpoint folder, an orbax checkpoint folder
written by `qwen3-spmd convert`, or a preset name with seeded random weights (the
built-in demo uses the `tiny` preset)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from qwen3_spmd.model.config import PRESETS, ConfigError, Qwen3Config


@dataclasses.dataclass
class ModelSpec:
    cfg: Qwen3Config
    source: object  # a weight source: read(path, dtype, layers) (orbax: also place)
    folder: Path | None  # the checkpoint folder (tokenizer, generation config), if any
    label: str
    random: bool

    def generation_config(self) -> dict:
        """generation_config.json of the folder ({} without one)."""
        gen = self.folder / "generation_config.json" if self.folder is not None else None
        if gen is None or not gen.is_file():
            return {}
        try:
            return json.loads(gen.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{gen} is not valid JSON ({e}): fix or remove it") from None

    def eos_ids(self) -> tuple[int, ...]:
        """EOS ids: generation_config.json's, else config.json's."""
        eos = self.generation_config().get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
        return self.cfg.eos_token_ids


def open_model(spec: str | None, seed: int = 0) -> ModelSpec:
    """A checkpoint folder (Hugging Face or orbax), or a preset (random weights); None
    means the tiny demo."""
    from qwen3_spmd.model.checkpoint import orbax_io
    from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
    from qwen3_spmd.model.checkpoint.random_weights import RandomWeights
    from qwen3_spmd.run import conversion

    name = "tiny" if spec is None else spec
    if name in PRESETS and not Path(name).exists():
        cfg = PRESETS[name]
        return ModelSpec(
            cfg,
            RandomWeights(cfg, seed),
            None,
            f"preset {name} with seeded RANDOM weights (not a trained model)",
            True,
        )
    folder = Path(name)
    if not folder.exists():
        partial = conversion.partial_folders(folder)
        if partial:
            raise ConfigError(
                f"--model {name}: no such folder, but {partial[-1]} holds an interrupted "
                f"conversion into it: {orbax_io.RERUN}"
            )
        raise ConfigError(
            f"--model {name}: no such folder, and not a preset "
            f"({', '.join(PRESETS)}): pass a Hugging Face checkpoint folder "
            "or an orbax checkpoint folder written by `qwen3-spmd convert`"
        )
    if not folder.is_dir():
        raise ConfigError(f"--model {name} is a file: pass the checkpoint folder that holds it")
    if orbax_io.is_orbax_checkpoint(folder):
        orbax_io.read_metadata(folder)  # an interrupted conversion: say so first
        cfg = Qwen3Config.from_hf(folder)
        return ModelSpec(
            cfg, orbax_io.OrbaxCheckpoint(folder, cfg), folder, f"{folder} (orbax)", False
        )
    if not any(
        (folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise ConfigError(
            f"--model {name} is neither a Hugging Face checkpoint (config.json with "
            "model.safetensors or model.safetensors.index.json) nor an orbax checkpoint written "
            f"by `qwen3-spmd convert` ({orbax_io.METADATA_FILE}): pass a folder of "
            "either kind"
        )
    cfg = Qwen3Config.from_hf(folder)
    return ModelSpec(cfg, HFCheckpoint(folder, cfg), folder, str(folder), False)
