"""How the processes of one job share each scheduler round.

Every process runs the same programs with the same inputs, so every process must run
the same rounds. Requests reach process 0 only (its server or its caller); process 0
plans each round (`pipeline.scheduling.planner`) and writes the `Round` itself under the round's
key in the coordination service's key-value store (`jax.distributed`); every other
process reads it and executes it. Followers never plan, so a planning rule may read
anything process 0 has (a clock, a measured cost) without putting them out of step.
A lost peer ends every survivor through the runtime's heartbeat, as any collective does
(`run.distributed`).
"""

from __future__ import annotations

from qwen3_spmd.pipeline.scheduling.planner import Round

_PREFIX = "qwen3_spmd/round/"
_KEPT = 64  # rounds whose plans stay in the store


class SharedDecisions:
    """Round decisions through the coordination service (`jax.distributed` must be
    initialized). Process 0 publishes, the others receive."""

    def __init__(self, wait_s: float = 60.0):
        from jax._src import distributed

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("SharedDecisions needs jax.distributed.initialize() first")
        self.leader = distributed.global_state.process_id == 0
        self.wait_ms = int(wait_s * 1000)

    def publish(self, n: int, round: Round) -> None:
        self.client.key_value_set(f"{_PREFIX}{n}", round.to_json())
        # Rounds with programs keep the processes in step (collectives), and a round
        # without one is rare (only cancellations): no process lags this far behind.
        if n >= _KEPT:
            self.client.key_value_delete(f"{_PREFIX}{n - _KEPT}")

    def receive(self, n: int) -> Round:
        """Round n; waits while process 0 is idle (no round to run)."""
        import jax

        while True:
            try:
                return Round.from_json(
                    self.client.blocking_key_value_get(f"{_PREFIX}{n}", self.wait_ms)
                )
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise  # not the wait timing out: process 0 has had nothing to do
