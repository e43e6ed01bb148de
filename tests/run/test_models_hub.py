"""`--model org/name`: a Hugging Face hub id resolved through huggingface_hub, offline,
against a hub cache laid out as huggingface_hub lays it out
(`$HF_HOME/hub/models--org--name/snapshots/<commit>/...`, `refs/main` holding the
commit), with HF_HUB_OFFLINE=1. No network is touched."""

from pathlib import Path

import pytest
from huggingface_hub import constants
from reference import FIXTURES

from qwen3_spmd.model.config import ConfigError, Qwen3Config
from qwen3_spmd.run import cli
from qwen3_spmd.run.models import is_hub_id, local_folder, open_model

TINY = FIXTURES / "tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A hub cache in tmp_path/hf holding org/name at COMMIT (symlinks to the tiny
    fixture, as the cache's snapshots link into its blobs); offline. Returns the
    snapshot folder."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--org--name"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in TINY.iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import: what the environment above means.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return snapshot


def test_hub_id_resolves_to_the_cached_snapshot(hub):
    spec = open_model("org/name")
    assert spec.folder == hub and spec.hub_id == "org/name" and not spec.random
    assert spec.cfg == Qwen3Config.from_hf(TINY)
    assert "org/name" in spec.label
    assert spec.eos_ids()  # the snapshot's generation_config.json is read
    assert open_model("org/name", revision=COMMIT).folder == hub
    assert local_folder("org/name") == str(hub)


def test_hub_id_not_cached_offline_is_a_one_line_error(hub):
    with pytest.raises(ConfigError) as e:
        open_model("org/missing")
    msg = str(e.value)
    assert "\n" not in msg
    assert "--model org/missing" in msg and "HF_HUB_OFFLINE" in msg
    assert "hf download org/missing --local-dir DIR" in msg
    with pytest.raises(ConfigError, match="at revision v2: no such folder"):
        open_model("org/name", revision="v2")


def test_a_local_folder_of_that_name_wins(hub, tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(TINY, target_is_directory=True)
    spec = open_model("org/name")
    assert spec.folder == Path("org/name") and spec.hub_id is None
    assert local_folder("org/name") == "org/name"
    with pytest.raises(ConfigError, match="--revision main needs a Hugging Face hub id"):
        open_model("org/name", revision="main")


def test_not_a_hub_id_is_no_such_folder(hub):
    assert is_hub_id("Qwen/Qwen3-0.6B")
    for name in ("org/na me", "a/b/c", "/abs", "../up", "org/x..y"):
        assert not is_hub_id(name), name
    with pytest.raises(ConfigError, match="--model org/na me: no such folder, and not a preset"):
        open_model("org/na me")
    with pytest.raises(ConfigError, match="--revision main needs"):
        open_model("tiny", revision="main")


def test_convert_prints_the_one_line_error(hub, capsys):
    # The command line's path to it: a hub id neither here nor reachable, before any work.
    assert cli.main(["convert", "--model", "org/missing", "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model org/missing: no such folder, and not in the hub cache")
    assert err.count("\n") == 1
    assert not Path("out").exists()
