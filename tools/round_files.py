"""Which of the package's files one steady decode round runs Python in.

    python tools/round_files.py            # plain decoding, then ngram speculation

A tiny random Qwen3 (the test fixture) on an emulated 2x2 CPU mesh: two requests are
admitted and decoded for a few rounds (compiles done), then one more round runs under a
profile hook that notes each package file a Python function of it runs in (the device
programs' own code runs compiled and is not counted). The figure is a newcomer's reading
path: how many modules a round crosses (docs/architecture.md, One decode round).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

import qwen3_spmd  # noqa: E402
from qwen3_spmd.model.checkpoint.hf import HFCheckpoint  # noqa: E402
from qwen3_spmd.model.config import Qwen3Config  # noqa: E402
from qwen3_spmd.pipeline.batch.handles import Params  # noqa: E402
from qwen3_spmd.pipeline.runtime.engine import Engine  # noqa: E402
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler  # noqa: E402
from qwen3_spmd.pipeline.speculative.speculator import make_speculator  # noqa: E402
from qwen3_spmd.sharding.mesh import make_mesh  # noqa: E402

PACKAGE = os.path.dirname(qwen3_spmd.__file__)
LOOKUP = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def round_files(engine: Engine, speculative: str | None, warm: int = 6) -> list[str]:
    """The package files (relative paths) a decode round runs in, after `warm` rounds."""
    sched = Scheduler(engine, max_batch=2, speculator=make_speculator(engine, speculative))
    sched.submit([5, 6, 7, 5, 6, 7, 5, 6], Params(200))
    sched.submit([9, 10, 9, 10, 9], Params(200))
    for _ in range(warm):
        sched.step()
    files = set()

    def note(frame, event, arg):
        if frame.f_code.co_filename.startswith(PACKAGE):
            files.add(os.path.relpath(frame.f_code.co_filename, PACKAGE))

    sys.setprofile(note)
    try:
        sched.step()
    finally:
        sys.setprofile(None)
    return sorted(files)


def main() -> None:
    tiny = ROOT / "tests" / "fixtures" / "tiny"
    cfg = Qwen3Config.from_hf(tiny)
    mesh = make_mesh(2, 2, jax.devices()[:4])
    engine = Engine(cfg, HFCheckpoint(tiny, cfg), mesh, max_seq_len=256)
    for name, speculative in (("plain", None), ("ngram", LOOKUP)):
        files = round_files(engine, speculative)
        print(f"{name}: {len(files)} files")
        for f in files:
            print(f"  {f}")


if __name__ == "__main__":
    main()
