"""How the processes of one job agree on each scheduler round.

Every process runs the same programs with the same inputs, so every process's
scheduler must take the same decisions. Requests reach process 0 only (its server or
its caller); at the start of each round process 0 writes what is new (requests with
their ids, prompts and parameters, cancellations, or the end) under the round's key in
the coordination service's key-value store (`jax.distributed`), and every other
process reads it before its round runs. The rest of a round (admissions, chunk
length, retirements) follows from the decisions and the tokens, which every process
computes alike. A lost peer ends every survivor through the runtime's heartbeat, as
any collective does (`run.distributed`).
"""

from __future__ import annotations

import dataclasses
import json

from qwen3_spmd.pipeline.handles import Params
from qwen3_spmd.pipeline.sampling import Sampling

_PREFIX = "qwen3_spmd/round/"
_KEPT = 64  # rounds whose decisions stay in the store


@dataclasses.dataclass
class Decision:
    """What process 0 took in before round `n`."""

    submits: list[tuple[int, tuple[int, ...], Params]]  # (id, prompt ids, params)
    cancels: list[int]  # request ids
    close: bool = False  # the followers stop after this

    def to_json(self) -> str:
        def params(p: Params) -> dict:
            return {**dataclasses.asdict(p), "sampling": dataclasses.asdict(p.sampling)}

        submits = [[id, list(prompt), params(p)] for id, prompt, p in self.submits]
        return json.dumps({"submits": submits, "cancels": self.cancels, "close": self.close})

    @staticmethod
    def from_json(text: str) -> Decision:
        d = json.loads(text)
        submits = [
            (
                id,
                tuple(prompt),
                Params(
                    **{**p, "sampling": Sampling(**p["sampling"]), "eos_ids": tuple(p["eos_ids"])}
                ),
            )
            for id, prompt, p in d["submits"]
        ]
        return Decision(submits, d["cancels"], d["close"])


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

    def publish(self, n: int, decision: Decision) -> None:
        self.client.key_value_set(f"{_PREFIX}{n}", decision.to_json())
        # Rounds with programs keep the processes in step (collectives), and a round
        # without one is rare (only cancellations): no process lags this far behind.
        if n >= _KEPT:
            self.client.key_value_delete(f"{_PREFIX}{n - _KEPT}")

    def receive(self, n: int) -> Decision:
        """Round n's decision; waits while process 0 is idle (no round to run)."""
        import jax

        while True:
            try:
                return Decision.from_json(
                    self.client.blocking_key_value_get(f"{_PREFIX}{n}", self.wait_ms)
                )
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise  # not the wait timing out: process 0 has had nothing to do
