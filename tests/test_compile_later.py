"""A server's background compiles run at the lowest CPU priority a thread can have, so
they take the cycles the rounds leave idle (issue: serving at full speed from the first
minute), and the count of shapes left is what /metrics shows."""

import os
import sys
import threading

import jax
import pytest
from reference import TINY

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.engine import Engine
from qwen3_spmd.pipeline.scheduler import Scheduler
from qwen3_spmd.pipeline.shapes import DecodeShape
from qwen3_spmd.sharding.mesh import make_mesh


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice is Linux's")
def test_background_compiles_run_at_the_lowest_priority_and_count_down():
    cfg = Qwen3Config.from_hf(TINY)
    engine = Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]))
    sched = Scheduler(engine, max_batch=1)
    seen, left = {}, []
    # What each compile sees (no program is compiled here: the thread's rules are tested).
    sched._compile = lambda shape, announce: left.append((sched.compiles_left, _nice()))
    shapes = [DecodeShape(1, False, False), DecodeShape(1, True, False)]
    before = _nice()

    def done(n, seconds, errors):
        seen.update(nice=_nice(), n=n, left=sched.compiles_left)

    sched.compile_later(shapes, done)
    sched._compiler.join(timeout=60)
    assert left == [(2, 19), (1, 19)]
    assert seen == {"nice": 19, "n": 2, "left": 0}
    assert _nice() == before  # the caller's thread (the rounds') keeps its priority
    sched.close()
