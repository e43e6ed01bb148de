"""The install puts every package folder under the one import name `qwen3_spmd`."""

import tomllib
from pathlib import Path

from reference import ROOT


def test_pyproject_lists_every_package_folder():
    """A new subpackage missing from pyproject's explicit list would import in the source
    tree (an editable install maps the root) but be left out of a wheel: list them all."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"qwen3_spmd": "."}
    tops = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith((".", "tests"))]
    on_disk = {"qwen3_spmd"} | {
        ".".join(("qwen3_spmd", *init.parent.relative_to(ROOT).parts))
        for top in tops
        for init in top.rglob("__init__.py")
    }
    assert set(config["packages"]) == on_disk


def test_package_folders_import_under_one_name():
    import qwen3_spmd
    from qwen3_spmd.run import cli

    assert Path(qwen3_spmd.__file__).resolve().parent == ROOT
    assert Path(cli.__file__).resolve() == ROOT / "run" / "cli.py"


def test_package_data_is_there():
    """Files a wheel must carry beside the code (Qwen3's tokenizer): each one listed exists."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, names in config["package-data"].items():
        folder = ROOT.joinpath(*package.split(".")[1:])
        assert names and all((folder / name).is_file() for name in names), package
