"""From an API request to scheduler requests and back: choices as events.

A request with P prompts and `n` asks for P * n choices (index p * n + j), each its own
scheduler request with its own seed (seed + j, so `n` seeded choices differ and each
is reproducible). `Service.run` submits them all (or none: a full queue refuses the
request whole) and yields `Event`s as their tokens come: text deltas in whole
characters with stop strings applied, then each choice's finish reason. It cancels
every choice it started when its caller goes away (a disconnect), and `abort()` ends
the ones still running at shutdown with an error event.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from qwen3_spmd.pipeline.constraints import Constraint
from qwen3_spmd.pipeline.handles import Handle, Logprob, Params
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.sampling import MAX_BANNED, Sampling, SamplingError
from qwen3_spmd.pipeline.scheduler import QueueFull, Scheduler
from qwen3_spmd.run.flags import in_flags
from qwen3_spmd.run.serve.detok import Detokenizer, StopText
from qwen3_spmd.run.serve.metrics import Metrics
from qwen3_spmd.run.serve.protocol import MAX_LOGPROBS, MAX_N, APIError

SEEDS = 2**31  # a request's seed is taken modulo this (the sampling key's int32 seed)
# The library's parameter names (RequestError.params) as the API's fields; the rest
# (temperature, top_k, top_p, min_tokens) are the same in both.
FIELDS = {"max_new_tokens": "max_tokens", "prompts": "prompt", "eos_ids": "stop_token_ids"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the server was started with."""

    model_name: str
    max_seq_len: int
    vocab: int  # the model's vocabulary: prompt ids must be below it
    eos_ids: tuple[int, ...]
    defaults: Sampling  # a request's sampling when it names none (generation_config.json)
    retry_after_s: int = 1


@dataclasses.dataclass(frozen=True)
class Ask:
    """What an API request asks of each of its choices, as sent (None: the server's
    default); `Service.job` checks it."""

    n: int = 1
    max_tokens: int | None = None
    default_max_tokens: int | None = None  # the endpoint's, when max_tokens is None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    seed: int | None = None
    stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # top log-probabilities per token; None: none
    constraint: Constraint | None = None  # what the answer must follow (structured outputs)
    constraint_field: str | None = None  # the request's field it came from (for errors)


@dataclasses.dataclass
class Job:
    """One API request, checked: its prompts and what each of its choices asks."""

    prompts: list[list[int]]
    n: int
    max_tokens: list[int]  # per prompt
    sampling: Sampling
    seed: int
    stops: list[str]
    stop_ids: tuple[int, ...]  # the scheduler's end ids: EOS (unless ignored) + stop_token_ids
    min_tokens: int = 0
    logprobs: int | None = None  # top log-probabilities per token; None: none
    constraint: Constraint | None = None
    constraint_field: str | None = None


def _invalid(e: RequestError) -> APIError:
    """A 400 for the library's refusal, naming its parameter as the API's field."""
    code = "invalid_value" if e.param else None
    return APIError(400, e.spelled(FIELDS), FIELDS.get(e.param, e.param), code)


class TokenInfo(NamedTuple):
    """A generated token with its log-probabilities (requests that ask for them)."""

    id: int
    logprob: Logprob
    offset: int  # characters of the choice's text before this token's


@dataclasses.dataclass
class Event:
    """A choice's news: text to append, and its finish reason when it ends ("stop",
    "length"; "error" when the server ended it)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0  # at the end: tokens the choice generated
    tokens: list[TokenInfo] = dataclasses.field(default_factory=list)  # with logprobs only
    cached_tokens: int = 0  # at the end: its prompt's tokens the prefix cache gave


class Choice:
    """One generated sequence: a scheduler request and its text so far."""

    def __init__(self, index: int, handle: Handle, job: Job, decode):
        self.index, self.handle, self.job = index, handle, job
        self.submitted = time.perf_counter()
        self.detok = Detokenizer(decode)
        self.stop = StopText(job.stops)
        self.count = 0  # tokens taken (the one that ended the choice included)
        self.chars = 0  # characters decoded so far (held back ones included)
        self.pending: list[TokenInfo] = []  # tokens not yet sent with an event

    def feed(self, token: int) -> tuple[str, str | None]:
        """(text to show, finish reason or None) after one more token."""
        if self.job.logprobs is not None:
            lp = self.handle.logprobs[self.count]
            self.pending.append(TokenInfo(token, lp, self.chars))
        self.count += 1
        if self.handle.params.finish_reason(self.handle.tokens[: self.count]) == "stop":
            return self.end("stop")  # an end id: it ends the text, unshown
        armed = self.count >= self.job.min_tokens
        piece = self.detok.add(token)
        self.chars += len(piece)
        text = self.stop.add(piece, armed)
        if self.stop.stopped:
            return text, "stop"
        return text, None

    def end(self, reason: str) -> tuple[str, str]:
        """(the last text, the finish reason) when the choice ends: a stop token, its
        budget, or the server; text held back for a stop string goes out, unless the
        flush completes one."""
        text = self.stop.add(self.detok.flush())
        if self.stop.stopped:
            return text, "stop"
        return text + self.stop.flush(), reason

    def event(self, text: str, reason: str | None) -> Event:
        tokens, self.pending = self.pending, []
        cached = self.handle.cached_tokens if reason else 0
        return Event(self.index, text, reason, self.count, tokens, cached_tokens=cached)


class Service:
    """Runs API requests on a Scheduler (started: its background thread runs rounds)."""

    def __init__(self, scheduler: Scheduler, decode, settings: Settings):
        self.scheduler, self.decode, self.settings = scheduler, decode, settings
        self.draining = False
        # Choices ended, by finish reason ("cancelled": their client went away).
        self.finished: collections.Counter[str] = collections.Counter()
        self._aborted: set[Handle] = set()
        self.metrics = Metrics(self)  # GET /metrics

    # ---- checks ------------------------------------------------------------------------

    def job(self, prompts: list[list[int]], ask: Ask) -> Job:
        """A request's prompts and what it asks, checked (APIError 400 naming the field)."""
        s, n, max_tokens, min_tokens = self.settings, ask.n, ask.max_tokens, ask.min_tokens
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n {n} must be between 1 and {MAX_N}", "n", "invalid_value")
        for p in prompts:
            if not p:
                raise APIError(400, "a prompt is empty: send at least one token", "prompt")
            bad = next((t for t in p if not 0 <= t < s.vocab), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"prompt token id {bad} is outside the vocabulary [0, {s.vocab})",
                    "prompt",
                    "invalid_value",
                )
        budgets = [
            max_tokens
            if max_tokens is not None
            else ask.default_max_tokens or s.max_seq_len - len(p)
            for p in prompts
        ]
        for p, budget in zip(prompts, budgets):
            if budget < 1 and max_tokens is None:
                raise APIError(
                    400,
                    f"the prompt's {len(p)} tokens leave no room for an answer under the "
                    f"server's --max-seq-len {s.max_seq_len}: shorten the prompt",
                    "messages",
                    "context_length_exceeded",
                )
            if budget < 1:
                raise APIError(
                    400, f"max_tokens {budget} must be at least 1", "max_tokens", "invalid_value"
                )
            if len(p) + budget > s.max_seq_len:
                raise APIError(
                    400,
                    f"the prompt's {len(p)} tokens plus max_tokens {budget} exceed the "
                    f"server's --max-seq-len {s.max_seq_len}: shorten the prompt or lower "
                    "max_tokens",
                    "max_tokens",
                    "context_length_exceeded",
                )
        d = s.defaults
        try:
            sampling = Sampling(
                temperature=d.temperature if ask.temperature is None else ask.temperature,
                # Past the vocabulary, top-k keeps every token: the same as off (and
                # no int32 overflow on the device).
                top_k=d.top_k if ask.top_k is None else min(max(ask.top_k, 0), s.vocab),
                top_p=d.top_p if ask.top_p is None else ask.top_p,
            )
        except SamplingError as e:
            raise _invalid(e) from None
        if min_tokens < 0:
            raise APIError(400, f"min_tokens {min_tokens} must be >= 0", "min_tokens")
        min_tokens = min(min_tokens, max(budgets))  # past the budget it holds back nothing more
        if ask.logprobs is not None and not 0 <= ask.logprobs <= MAX_LOGPROBS:
            raise APIError(
                400, f"logprobs {ask.logprobs} must be between 0 and {MAX_LOGPROBS}", "logprobs"
            )
        extra = tuple(ask.stop_token_ids)
        for t in extra:
            if not 0 <= t < s.vocab:
                raise APIError(
                    400, f"stop token id {t} is outside the vocabulary", "stop_token_ids"
                )
        if any(not isinstance(x, str) or not x for x in ask.stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        stop_ids = tuple(dict.fromkeys((() if ask.ignore_eos else s.eos_ids) + extra))
        if min_tokens and len(stop_ids) > MAX_BANNED:
            raise APIError(
                400,
                f"min_tokens holds back at most {MAX_BANNED} end ids (EOS and "
                f"stop_token_ids), and this request has {len(stop_ids)}",
                "stop_token_ids",
            )
        return Job(
            prompts=prompts,
            n=n,
            max_tokens=budgets,
            sampling=sampling,
            seed=secrets.randbelow(SEEDS) if ask.seed is None else ask.seed % SEEDS,
            stops=list(ask.stops),
            stop_ids=stop_ids,
            min_tokens=min_tokens,
            logprobs=ask.logprobs,
            constraint=ask.constraint,
            constraint_field=ask.constraint_field,
        )

    async def compile(self, job: Job) -> None:
        """Compiles the job's constraint on a thread (the grammar engine's cache then
        has it when `submit` asks): a 400 naming its field when the engine refuses it
        or it takes too long to compile."""
        if job.constraint is None:
            return
        try:
            await asyncio.to_thread(self.scheduler.compile_constraint, job.constraint)
        except RequestError as e:
            field = job.constraint_field
            raise APIError(400, f"{field}: {e}", field, "invalid_value") from None

    # ---- running -----------------------------------------------------------------------

    def submit(self, job: Job) -> list[Choice]:
        """Every choice of `job` queued, or none (APIError 503 when the queue is full)."""
        if self.draining:
            raise self.unavailable("the server is shutting down")
        choices = []
        try:
            for p, prompt in enumerate(job.prompts):
                for j in range(job.n):
                    params = Params(
                        max_new_tokens=job.max_tokens[p],
                        sampling=job.sampling,
                        seed=(job.seed + j) % SEEDS,
                        eos_ids=job.stop_ids,
                        min_tokens=job.min_tokens,
                        logprobs=job.logprobs is not None,
                        constraint=job.constraint,
                    )
                    handle = self.scheduler.submit(prompt, params)
                    choices.append(Choice(p * job.n + j, handle, job, self.decode))
        except QueueFull as e:
            self.cancel(choices)
            self.metrics.rejected("queue_full")
            raise self.unavailable(in_flags(e), "queue_full") from None  # the server's flag
        except RequestError as e:
            self.cancel(choices)
            raise _invalid(e) from None
        return choices

    def unavailable(self, message: str, code: str = "unavailable") -> APIError:
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        return APIError(503, message, None, code, retry)

    def cancel(self, choices: list[Choice]) -> None:
        for c in choices:
            try:
                self.scheduler.cancel(c.handle)
            except RequestError:
                pass  # it finished meanwhile

    async def run(self, choices: list[Choice]) -> AsyncIterator[Event]:
        """Events of every choice as they come; the choices still running are
        cancelled when the caller stops reading (a disconnect)."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        tasks = [asyncio.create_task(self._follow(c, queue)) for c in choices]
        running = {c.index: c for c in choices}
        try:
            while running:
                event = await queue.get()
                if event.finish_reason is not None:
                    self.finished[event.finish_reason] += 1
                    self.metrics.ended(running.pop(event.index), event.finish_reason)
                yield event
        finally:
            for t in tasks:
                t.cancel()
            self.finished["cancelled"] += len(running)
            for c in running.values():
                self.metrics.ended(c, "cancelled")
            self.cancel([c for c in choices if not c.handle.done])

    async def _follow(self, choice: Choice, queue: asyncio.Queue) -> None:
        try:
            await self._follow_tokens(choice, queue)
        except Exception:  # the client gets an error event rather than a stream that hangs
            self.cancel([choice])
            queue.put_nowait(choice.event("", "error"))
            raise

    async def _follow_tokens(self, choice: Choice, queue: asyncio.Queue) -> None:
        async for token in choice.handle.stream():
            text, reason = choice.feed(token)
            if text or reason:
                queue.put_nowait(choice.event(text, reason))
            if reason:
                self.cancel([choice])  # a stop string: the scheduler may not know yet
                return
        if choice.handle in self._aborted or choice.handle.finish_reason == "error":
            ended = "error"
        else:
            ended = "stop" if choice.handle.finish_reason == "stop" else "length"
        text, reason = choice.end(ended)
        queue.put_nowait(choice.event(text, reason))

    # ---- shutdown ----------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> int:
        """Refuses new requests and waits up to `timeout_s` for the running ones;
        returns how many were still running (then ended: `abort`)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.scheduler.idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.abort()

    def abort(self) -> int:
        """Ends every running request (its stream gets an error event)."""
        handles = list(self.scheduler.handles())
        self._aborted.update(handles)
        for h in handles:
            try:
                self.scheduler.cancel(h)
            except RequestError:
                pass
        return len(handles)
