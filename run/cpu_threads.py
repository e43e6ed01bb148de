"""XLA's compile threads at the lowest CPU priority, so that compiling in the background
takes only the cores the rounds leave idle (issue 47).

XLA's CPU client compiles on a pool of native threads it starts with the backend, apart
from the threads that run programs (Eigen's pool and the client's workers); the Python
thread that asks for a compile does little of the work, which is why lowering only that
thread's priority changed nothing. Linux keeps a nice value per thread and lets a
process raise its own threads' (lowering it again needs privilege, so the choice is for
the process's life). serve therefore reads which native threads work while it compiles
its first programs and runs none, leaves out those that then run a request and every
Python thread, and gives the rest, with its compile-later thread, nice 19 and the
SCHED_IDLE policy. A round then takes the cores first (a thread of the rounds that wakes
preempts a SCHED_IDLE one at once; nice 19 alone only weighs it less); a compile runs at
full speed whenever nothing else wants them (the server idle, or a round waiting on that
compile). Where /proc/self/task is absent
(not Linux) nothing is found and nothing changes.
"""

import os
import threading

LOWEST = 19  # the lowest priority a Linux thread can have


def cpu_ticks() -> dict[int, int]:
    """{native thread id: CPU ticks (user + system) so far} for this process's threads;
    {} where the platform does not say."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    ticks = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                # After the command name's ")": state, ..., utime and stime are 12th, 13th.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def busy_since(before: dict[int, int], min_ticks: int = 2) -> set[int]:
    """Threads that used at least min_ticks of CPU since `before` (a cpu_ticks())."""
    return {t for t, n in cpu_ticks().items() if n - before.get(t, 0) >= min_ticks}


def python_threads() -> set[int]:
    """Native ids of the threads Python started (the server's own: never lowered)."""
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def lower_priority(tids) -> list[int]:
    """Gives each thread of `tids` the lowest priority: nice 19, and Linux's SCHED_IDLE
    policy where there is one (the thread then runs only on a core no other thread
    wants, and a round's thread that wakes takes its core at once); returns those it
    changed (a thread already there, or gone, is left)."""
    changed = []
    for tid in sorted(tids):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < LOWEST:
                os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
                if hasattr(os, "SCHED_IDLE"):
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                changed.append(tid)
        except OSError:  # ended, or a platform without per-thread priorities
            continue
    return changed


class CompileThreads:
    """XLA's compile threads, told from the rest by what they do: made, then compiles
    that run no program, compiled(), a request's rounds that compile nothing, ran();
    then found() is what compiled and did not run."""

    def __init__(self):
        self._compiled: set[int] = set()
        self._ran: set[int] = set()
        self._since = cpu_ticks()

    def compiled(self) -> None:
        """The window since the last mark (or since made) compiled and ran nothing."""
        self._compiled |= busy_since(self._since)
        self._since = cpu_ticks()

    def ran(self) -> None:
        """The window since the last mark ran programs and compiled nothing."""
        self._ran |= busy_since(self._since)
        self._since = cpu_ticks()

    def found(self) -> set[int]:
        """The threads that compiled and did not run, none of them Python's."""
        return self._compiled - self._ran - python_threads()
