"""A server's background compiles count down the shapes left, which /metrics shows
(`qwen3_spmd:engine_compiles_left`)."""

import jax
from reference import TINY

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.runtime.shapes import DecodeShape
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.sharding.mesh import make_mesh


def test_background_compiles_count_down_the_shapes_left():
    cfg = Qwen3Config.from_hf(TINY)
    engine = Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(1, 1, jax.devices()[:1]))
    sched = Scheduler(engine, max_batch=1)
    seen, left = {}, []
    # What each compile sees (no program is compiled here: the count is tested).
    sched._compile = lambda shape, announce: left.append(sched.compiles_left)
    shapes = [DecodeShape(1, False, False), DecodeShape(1, True, False)]

    def done(n, seconds, errors):
        seen.update(n=n, left=sched.compiles_left)

    assert sched.compiles_left == 0
    sched.compile_later(shapes, done)
    sched._compiler.join(timeout=60)
    assert left == [2, 1]
    assert seen == {"n": 2, "left": 0}
    sched.close()
