"""Which of the package's files one steady decode round runs Python in.

    python tools/round_files.py            # plain decoding, then ngram speculation

A tiny random Qwen3 (the test fixture) on an emulated 2x2 CPU mesh: two requests are
admitted and decoded for a few rounds, then rounds run under a profile hook that notes
each package file a Python function of it runs in (the device programs' own code runs
compiled and is not counted; a round that compiles is skipped). The figure is a newcomer's reading
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
# The package's own floors (a virtual environment or tools/ may sit beside them).
ROOMS = ("model", "ops", "sharding", "ring", "pipeline", "run")
LOOKUP = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def round_files(engine: Engine, speculative: str | None, warm: int = 6) -> dict[str, list[str]]:
    """{kind of round: the package files it runs in} of the first steady decode round of
    each kind seen in 60 rounds after `warm`: plain without a drafter; with one, a round
    of one verify pass and a round that loops passes on the device. A round that compiles a
    program (the first of its shape; it runs the model's Python to trace it) is skipped."""
    sched = Scheduler(engine, max_batch=2, speculator=make_speculator(engine, speculative))
    sched.submit([5, 6, 7, 5, 6, 7, 5, 6], Params(200))
    sched.submit([9, 10, 9, 10, 9], Params(200))
    for _ in range(warm):
        sched.step()
    decode, rounds = sched.executor.decode, []

    def noting(round):
        rounds.append(round)
        return decode(round)

    sched.executor.decode = noting
    files, kinds = set(), {}

    def note(frame, event, arg):
        path = os.path.relpath(frame.f_code.co_filename, PACKAGE)
        if path.split(os.sep)[0] in ROOMS:
            files.add(path)

    wanted = ["plain"] if speculative is None else ["one pass", "loop"]
    for _ in range(60):
        files.clear()
        sys.setprofile(note)
        try:
            sched.step()
        finally:
            sys.setprofile(None)
        spec = rounds[-1].decode.spec if rounds and rounds[-1].decode else None
        kind = "plain" if spec is None else "loop" if spec.rounds > 1 else "one pass"
        if kind in wanted and kind not in kinds and not any(f.startswith("model") for f in files):
            kinds[kind] = sorted(files)
        if len(kinds) == len(wanted):
            return kinds
    if not kinds:
        raise SystemExit(f"no steady round of the kinds {wanted} in 60 rounds")
    return kinds


def main() -> None:
    tiny = ROOT / "tests" / "fixtures" / "tiny"
    cfg = Qwen3Config.from_hf(tiny)
    mesh = make_mesh(2, 2, jax.devices()[:4])
    engine = Engine(cfg, HFCheckpoint(tiny, cfg), mesh, max_seq_len=256)
    for name, speculative in (("plain", None), ("ngram", LOOKUP)):
        for kind, files in round_files(engine, speculative).items():
            print(f"{name}, {kind}: {len(files)} files")
            for f in files:
                print(f"  {f}")


if __name__ == "__main__":
    main()
