"""Ports for the HTTP servers and jax.distributed coordinators that tests start.

A test picks a port and hands it to a subprocess, which binds it seconds later (after
importing JAX). A port from the kernel's ephemeral range (a bind to port 0) could be
taken in between: by the other pytest-xdist worker's bind to port 0, or by any
outgoing connection (the HTTP clients of the other worker's tests). Worse, two
coordinators handed one port both bind it (gRPC sets SO_REUSEPORT) and split each
other's peers. So the ports come from below the ephemeral range (Linux's starts at
32768, macOS's and Windows' at 49152), where the kernel assigns none by itself: a
block of 500 per worker, from a random start (two sessions on one machine seldom
meet), in turn (a port is not handed out twice in a session), each checked free by a
bind when it is picked.
"""

import itertools
import os
import random
import socket

_FIRST = 20000
_BLOCK = 500
_BLOCKS = 25  # 20000-32499: below 32768


def _worker() -> int:
    """This process's pytest-xdist worker number (gw0, gw1, ...); 0 without xdist."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % _BLOCKS


_offsets = itertools.count(random.randrange(_BLOCK))


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now and that no other test of this
    session is handed (in any of up to 25 workers)."""
    base = _FIRST + _BLOCK * _worker()
    for _ in range(_BLOCK):
        port = base + next(_offsets) % _BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT is skipped
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}-{base + _BLOCK - 1}")
