"""A request in the continuous-batching scheduler, as its caller sees it.

`Params` says what a request asks besides its prompt; `Handle` is what `submit` gives
back: the tokens so far, the finish reason, the counts and times, and two ways to
stream the token ids, a blocking iterator and an async one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NamedTuple

from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.structured.constraints import Constraint

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclasses.dataclass(frozen=True)
class Params:
    """max_new_tokens counts every generated token (the first comes from the prefill);
    an EOS id ends the request and is kept as its last token. min_tokens: no EOS id
    before that many tokens (they are banned from sampling until then). logprobs: each
    token's log-probability and the top ones come with it (Handle.logprobs).
    prompt_logprobs: the prompt's too, each token's after the first under the tokens
    before it (Handle.prompt_logprobs); such a prompt is prefilled whole, never from the
    prefix cache (a hit would skip the positions it asks for). constraint: what the
    answer must follow (a structured output); it ends with "stop" where its grammar
    admits nothing more."""

    max_new_tokens: int = 16
    sampling: Sampling = Sampling()
    seed: int = 0
    eos_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: bool = False
    prompt_logprobs: bool = False
    constraint: Constraint | None = None

    def finish_reason(self, tokens: list[int]) -> str | None:
        """Why a request that has generated `tokens` ends: "stop" (the last is an EOS
        id), "length" (its budget), or None (it goes on). The one home of that rule."""
        if tokens and tokens[-1] in self.eos_ids:
            return "stop"
        if len(tokens) >= self.max_new_tokens:
            return "length"
        return None


@dataclasses.dataclass(frozen=True)
class Request:
    """What a scheduler runs for one submit: its id, prompt ids and parameters.
    sample_index is folded into its sampling key after the seed: 0 for a request on
    its own (key (seed, 0, step)), the row's index in a static batch of `generate`.
    made: a preempted request's tokens so far, which its prompt ends with when it is
    queued again (`resumed`): its steps (keys, bans) count from there."""

    id: int
    prompt: tuple[int, ...]
    params: Params
    sample_index: int = 0
    made: int = 0

    def resumed(self, generated: list[int]) -> Request:
        """This request preempted after `generated` tokens, to be prefilled again (vLLM's
        recompute): its prompt and those tokens as its prompt, the tokens left as its
        budget, its prompt's log-probabilities not asked again."""
        params = dataclasses.replace(
            self.params,
            max_new_tokens=self.params.max_new_tokens - len(generated),
            prompt_logprobs=False,
        )
        made = self.made + len(generated)
        return Request(self.id, self.prompt + tuple(generated), params, self.sample_index, made)


class Logprob(NamedTuple):
    """A token's log-probability under the model (the raw logits) and the
    sampling.TOP_LOGPROBS most likely (id, log-probability), in decreasing order; a
    prompt token's also its rank among all (1: the most likely)."""

    chosen: float
    top: list[tuple[int, float]]
    rank: int | None = None


def prompt_positions(ids: list[int], scored: list[Logprob], k: int, entry) -> list:
    """vLLM's prompt_logprobs layout, each door writing its own entries: None for the
    first prompt token, then per later token {id: entry(id, logprob, rank)} of the token
    itself first and its position's k most likely (ranks 1..k) after it."""
    out: list = [None]
    for id, lp in zip(ids[1:], scored):
        position = {id: entry(id, lp.chosen, lp.rank)}
        for rank, (top_id, value) in enumerate(lp.top[:k], start=1):
            position.setdefault(top_id, entry(top_id, value, rank))
        out.append(position)
    return out


class Handle:
    """One submitted request. Read it from any thread; the scheduler writes it.

    tokens: the generated ids so far; finish_reason: None while it runs, then "stop"
    (an EOS id), "length" (the budget), "cancelled", or "error" (the scheduler's loop
    failed). Times are seconds since submit.
    """

    def __init__(self, request: Request, drive: Callable[[], bool]):
        self.request = request
        self.id, self.prompt, self.params = request.id, request.prompt, request.params
        self.tokens: list[int] = []
        self.logprobs: list[Logprob] = []  # one per token, when params.logprobs
        # One per prompt token after the first, when params.prompt_logprobs (set with
        # the first token).
        self.prompt_logprobs: list[Logprob] | None = None
        self.finish_reason: str | None = None
        self.token_times_s: list[float] = []  # when each token reached the host
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        # A pooling runner's request: its last prompt token's hidden state after the
        # final norm, [D] float32, set as it finishes (`model.pooling` reads it).
        self.pooled = None
        self._submitted = time.perf_counter()
        self._changed = threading.Condition()
        # drive() runs one round and says True, or says False when a background loop
        # runs the rounds (a blocking reader then waits for it).
        self._drive = drive
        self._listeners: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def time_to_first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    def _deliver(
        self,
        tokens: list[int],
        finish_reason: str | None,
        logprobs: list[Logprob] | None = None,
        prompt_logprobs: list[Logprob] | None = None,
        pooled=None,
    ) -> None:
        """The scheduler's side: new tokens (and their Logprobs; with the first, the
        prompt's) and, at the end, the finish reason (and a pooled request's hidden
        state)."""
        now = time.perf_counter() - self._submitted
        with self._changed:
            if prompt_logprobs is not None:
                self.prompt_logprobs = prompt_logprobs
            if pooled is not None:
                self.pooled = pooled
            self.logprobs += logprobs or []
            self.tokens += tokens
            self.token_times_s += [now] * len(tokens)
            self.finish_reason = finish_reason
            self._changed.notify_all()
            listeners = list(self._listeners)
        for notify in listeners:
            notify()

    def __iter__(self) -> Iterator[int]:
        """The token ids as they come, blocking; runs the scheduler's rounds itself when
        no background loop is running (Scheduler.start)."""
        i = 0
        while True:
            with self._changed:
                new, done = self.tokens[i:], self.done
            i += len(new)
            yield from new
            if done:  # read together with the tokens: nothing comes after
                return
            if new or self._drive():  # read what came, or ran a round ourselves
                continue
            with self._changed:  # a background loop runs the rounds: wait for it
                if i == len(self.tokens) and not self.done:
                    self._changed.wait()

    async def stream(self) -> AsyncIterator[int]:
        """The token ids as they come, for asyncio callers; needs the scheduler's
        background loop (Scheduler.start)."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def notify():
            loop.call_soon_threadsafe(changed.set)

        with self._changed:
            self._listeners.append(notify)
        try:
            i = 0
            while True:
                changed.clear()
                with self._changed:
                    new, done = self.tokens[i:], self.done
                i += len(new)
                for t in new:
                    yield t
                if done:  # read together with the tokens: nothing comes after
                    return
                await changed.wait()
        finally:
            with self._changed:
                self._listeners.remove(notify)
