"""run.cpu_threads: which native threads work, and the lowest priority for some of them
(what serve does to XLA's compile threads before compiling in the background). Linux
only: elsewhere the platform says nothing and nothing is lowered."""

import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen3_spmd.run import cpu_threads

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/task is Linux's")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_is_seen_and_lowered_once():
    before = cpu_threads.cpu_ticks()
    assert threading.get_native_id() in before
    ready, go_on = threading.Event(), threading.Event()
    seen = {}

    def work():
        _spin(0.1)
        seen["priority"] = None
        ready.set()
        go_on.wait(10)
        seen["priority"] = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's own
        seen["policy"] = os.sched_getscheduler(0)

    t = threading.Thread(target=work)
    t.start()
    ready.wait(10)
    busy = cpu_threads.busy_since(before)
    assert t.native_id in busy and t.native_id in cpu_threads.python_threads()
    assert cpu_threads.lower_priority({t.native_id}) == [t.native_id]
    assert cpu_threads.lower_priority({t.native_id}) == []  # already there
    go_on.set()
    t.join()
    assert seen["priority"] == cpu_threads.LOWEST and seen["policy"] == os.SCHED_IDLE
    assert cpu_threads.lower_priority({t.native_id}) == []  # gone
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < cpu_threads.LOWEST


def test_compile_threads_are_not_the_threads_that_run_programs():
    """A compile that runs nothing, then runs that compile nothing: the threads found
    compiled, are not Python's, and ran no program (nothing is lowered here: this
    process goes on compiling the suite's programs)."""
    salt = float(np.random.default_rng().integers(1 << 20))  # a program no cache holds

    def f(x):
        for i in range(40):
            x = jnp.tanh(x @ x + i * salt)
        return x

    x = jnp.ones((64, 64))
    threads = cpu_threads.CompileThreads()
    program = jax.jit(f).lower(x).compile()
    threads.compiled()
    for _ in range(200):
        y = program(x)
    y.block_until_ready()
    threads.ran()
    found = threads.found()
    assert found, "no thread compiled"
    assert not found & cpu_threads.python_threads()
    assert not found & threads._ran
