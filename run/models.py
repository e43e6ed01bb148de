"""Resolving `--model`: a Hugging Face checkpoint folder, an orbax checkpoint folder
written by `qwen3-spmd convert`, a Hugging Face hub id (`Qwen/Qwen3-0.6B`, downloaded
into the hub cache on first use), or a preset name with seeded random weights (the
built-in demo uses the `tiny` preset)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from qwen3_spmd.model.config import PRESETS, ConfigError, Qwen3Config


@dataclasses.dataclass
class ModelSpec:
    cfg: Qwen3Config
    source: object  # a weight source: read(path, dtype, layers) (orbax: also place)
    folder: Path | None  # the checkpoint folder (tokenizer, generation config), if any
    label: str
    random: bool
    hub_id: str | None = None  # the hub id `folder` was resolved from, if any
    qwen_text: bool = False  # no folder, but Qwen3's shipped tokenizer (the demo)
    # The bare decoder's weights (no lm_head: Qwen3-Embedding as published): only the
    # pooling runner can serve it (`pipeline.pooling`).
    headless: bool = False

    def text(self):
        """The tokenizer and chat template (run.text.Text), or None without any."""
        from qwen3_spmd.run.text import Text

        return Text.qwen() if self.qwen_text else Text.find(self.folder)

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


# What a checkpoint needs from a hub repository: no PyTorch .bin, no README or images.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    # sentence-transformers' (an embedding model: the pooling runner, pipeline.pooling)
    "modules.json",
    "1_Pooling/config.json",
    "config_sentence_transformers.json",
]


def is_hub_id(name: str) -> bool:
    """`org/name` as the hub spells a repository id (one slash, no `..`, no leading `/`)."""
    if name.count("/") != 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_folder(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of hub repository `repo_id` at `revision`, downloaded
    (the HUB_FILES only) into the hub cache unless it is there already. The cache and the
    network follow huggingface_hub's environment: HF_HOME / HF_HUB_CACHE, HF_TOKEN,
    HF_HUB_OFFLINE. A progress bar shows on a terminal."""
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # A LocalEntryNotFoundError since huggingface_hub 1.x; older ones return the folder.
    incomplete = getattr(errors, "IncompleteSnapshotError", ())

    at = f" at revision {revision}" if revision else ""
    fix = f"download it with `hf download {repo_id} --local-dir DIR` and pass --model DIR"
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=HUB_FILES, tqdm_class=_tty_tqdm()
            )
        )
    except LocalEntryNotFoundError as e:
        if isinstance(e, incomplete):
            raise ConfigError(
                f"--model {repo_id}{at}: its copy in the hub cache {constants.HF_HUB_CACHE} "
                f"is incomplete and the hub cannot be reached: rerun with network access, or "
                f"{fix}"
            ) from None
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"--model {repo_id}{at}: no such folder, and not in the hub cache "
                f"{constants.HF_HUB_CACHE} while HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE "
                f"to download it, or {fix}"
            ) from None
        raise ConfigError(
            f"--model {repo_id}{at}: no such folder, not in the hub cache "
            f"{constants.HF_HUB_CACHE}, and the hub cannot be reached: check the network "
            f"(or HF_ENDPOINT), or {fix}"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(
            f"--revision {revision}: the hub repository {repo_id} has no such branch, tag "
            "or commit: pass one it has, or leave --revision out for main"
        ) from None
    except RepositoryNotFoundError:  # GatedRepoError too
        raise ConfigError(
            f"--model {repo_id}: no such folder, and no hub repository you may read by that "
            "id: check the spelling, or for a private or gated model set HF_TOKEN "
            "(or run `hf auth login`)"
        ) from None
    except HfHubHTTPError as e:
        raise ConfigError(
            f"--model {repo_id}{at}: the hub answered {e.response.status_code}: retry later, "
            f"or {fix}"
        ) from None


def _tty_tqdm():
    """huggingface_hub's progress bar class, silent unless stderr is a terminal (so
    `--json` output and logs stay clean)."""
    from huggingface_hub.utils import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            if not sys.stderr.isatty():
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Bar


def _names_hub(name: str, revision: str | None) -> bool:
    """Whether --model `name` means a hub repository: a valid id that is no local path
    (a folder of that name wins) nor the target of an interrupted conversion (which
    open_model reports). --revision goes with a hub id only."""
    from qwen3_spmd.run import conversion

    hub = is_hub_id(name) and not Path(name).exists() and not conversion.partial_folders(Path(name))
    if revision is not None and not hub:
        raise ConfigError(
            f"--revision {revision} needs a Hugging Face hub id (org/name) as --model, "
            f"not {name}: leave --revision out"
        )
    return hub


def local_folder(name: str, revision: str | None = None) -> str:
    """`name` itself, or the snapshot folder of hub id `name` (downloaded if need be):
    for the commands that read a checkpoint folder by path (convert)."""
    return str(hub_folder(name, revision)) if _names_hub(name, revision) else name


def with_qwen_vocab(cfg: Qwen3Config) -> Qwen3Config:
    """`cfg` with at least Qwen3's 151,936 embedding rows and its BOS/EOS ids, so that
    every id of Qwen's tokenizer is a row. A preset that grows (tiny, 512 rows) ties its
    output projection to the embedding, as the small Qwen3s do: one [V, D] table, not
    two."""
    from qwen3_spmd.run import qwen_tokenizer as qt

    grows = cfg.V < qt.QWEN_VOCAB
    return dataclasses.replace(
        cfg,
        vocab_size=max(cfg.V, qt.QWEN_VOCAB),
        tie_word_embeddings=cfg.tie_word_embeddings or grows,
        bos_token_id=qt.FIRST_ADDED,
        eos_token_ids=qt.EOS_IDS,
    )


def demo_model(seed: int = 0, revision: str | None = None) -> ModelSpec:
    """The built-in demo: the tiny preset's layers with Qwen3's vocabulary and tokenizer,
    seeded random weights. It speaks real tokens; what it says is noise."""
    from qwen3_spmd.model.checkpoint.random_weights import RandomWeights

    _names_hub("tiny", revision)  # --revision without --model: say it needs a hub id

    cfg = with_qwen_vocab(PRESETS["tiny"])
    return ModelSpec(
        cfg,
        RandomWeights(cfg, seed),
        None,
        "preset tiny with Qwen3's tokenizer and seeded RANDOM weights (not a trained model)",
        True,
        qwen_text=True,
    )


def open_model(spec: str | None, seed: int = 0, revision: str | None = None) -> ModelSpec:
    """A checkpoint folder (Hugging Face or orbax), a Hugging Face hub id (`org/name`,
    at `revision`), or a preset (random weights); None means the tiny demo. A local
    folder wins over a hub id of the same name."""
    from qwen3_spmd.model.checkpoint import orbax_io
    from qwen3_spmd.model.checkpoint.random_weights import RandomWeights
    from qwen3_spmd.run import conversion

    name = "tiny" if spec is None else spec
    if _names_hub(name, revision):
        folder = hub_folder(name, revision)
        return dataclasses.replace(
            _open_folder(folder, name), label=f"{name} ({folder})", hub_id=name
        )
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
    return _open_folder(folder, name)


def _open_folder(folder: Path, name: str) -> ModelSpec:
    """An existing path `folder` (given as --model `name`): an orbax or a Hugging Face
    checkpoint folder."""
    from qwen3_spmd.model.checkpoint import orbax_io
    from qwen3_spmd.model.checkpoint.hf import HFCheckpoint, bare_decoder, tensor_files

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
    headless = bare_decoder(tensor_files(folder))
    if headless:  # its lm_head is never computed: the embedding stands in for it
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return ModelSpec(cfg, HFCheckpoint(folder, cfg), folder, str(folder), False, headless=headless)
