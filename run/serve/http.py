"""uvicorn's server with a draining shutdown: the first SIGTERM or SIGINT refuses new
requests (503), gives the running ones --shutdown-timeout seconds, ends the rest with
an error event and exits 0; a second signal exits at once."""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from qwen3_spmd.run.serve.app import ServerState, make_app


class Server(uvicorn.Server):
    def __init__(self, state: ServerState, shutdown_timeout: float, keep_alive: float):
        config = uvicorn.Config(
            make_app(state), log_level="warning", lifespan="off", timeout_keep_alive=keep_alive
        )
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.stopped_by_signal = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        # Not uvicorn's: it re-raises the signal after shutting down, which would end
        # the process by the signal rather than with status 0.
        if self.stopped_by_signal:  # a second signal: now
            return super().handle_exit(sig, frame)
        self.stopped_by_signal = True
        print(
            "shutting down: finishing the running requests (a second signal stops at once)",
            file=sys.stderr,
            flush=True,
        )
        serving = self.state.status == "ready"
        self.state.status = "draining"
        if not serving or self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self):
        left = await self.state.service.drain(self.shutdown_timeout)
        if left:
            print(
                f"shutdown: {left} requests ended unfinished after --shutdown-timeout",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(0.5)  # their error events go out
        self.should_exit = True
