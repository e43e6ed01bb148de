"""`qwen3-spmd generate`: the subcommand (`command`), registered by run.cli."""

from qwen3_spmd.run.generate.command import main, register

__all__ = ["main", "register"]
