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
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from qwen3_spmd.pipeline.batch.handles import Handle, Logprob, Params
from qwen3_spmd.pipeline.programs.sampling import TOP_LOGPROBS, Sampling, SamplingError
from qwen3_spmd.pipeline.requests import SEEDS, RequestError, key_seed
from qwen3_spmd.pipeline.scheduling.scheduler import QueueFull, Scheduler
from qwen3_spmd.pipeline.structured.constraints import Constraint
from qwen3_spmd.run.flags import in_flags
from qwen3_spmd.run.pooled import POOLED, check_all
from qwen3_spmd.run.request_fields import end_ids
from qwen3_spmd.run.serve.detok import Detokenizer, StopText
from qwen3_spmd.run.serve.metrics import Metrics
from qwen3_spmd.run.serve.protocol import MAX_N, APIError

# The library's parameter names (RequestError.params) as the API's fields; the rest
# (temperature, top_k, top_p, min_tokens) are the same in both. max_seq_len is no field:
# the server's setting, named as its flag (a refusal's field is then the next one named).
FIELDS = {
    "max_new_tokens": "max_tokens",
    "prompts": "prompt",
    "eos_ids": "stop_token_ids",
    "max_seq_len": "the server's --max-seq-len",
}
SETTINGS = ("max_seq_len",)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the server was started with."""

    model_name: str
    max_seq_len: int
    vocab: int  # the model's vocabulary: stop token ids must be below it
    eos_ids: tuple[int, ...]
    defaults: Sampling  # a request's sampling when it names none (generation_config.json)
    # The one request check (Engine.check: requests.check_request), called with
    # (prompts, max_new_tokens, min_tokens, eos_ids); RequestError when it refuses.
    check: Callable[..., None]
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
    echo: bool = False  # completions: the prompt comes first (with logprobs, its tokens too)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's, with k top; None: none
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
    echo: bool = False  # the answer's text and logprobs start with the prompt's
    prompt_logprobs: int | None = None  # the prompt's log-probabilities, k top; None: none
    # max_tokens 0 with echo: the prompt (and its log-probabilities) only; the one token
    # each choice's request runs for is not shown
    prompt_only: bool = False
    constraint: Constraint | None = None
    constraint_field: str | None = None

    @property
    def scores_prompt(self) -> bool:
        """Whether its requests need their prompts' log-probabilities."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


def _invalid(e: RequestError, fields: dict = FIELDS) -> APIError:
    """A 400 for the library's refusal, naming its parameters as the API's `fields`; a
    prompt too long for the server's --max-seq-len is context_length_exceeded."""
    field = next((fields.get(p, p) for p in e.params if p not in SETTINGS), None)
    if "max_seq_len" in e.params:
        code = "context_length_exceeded"
    else:
        code = "invalid_value" if field else None
    return APIError(400, e.spelled(fields), field, code)


class TokenInfo(NamedTuple):
    """A token with its log-probabilities (requests that ask for them): a generated one,
    or with echo a prompt token (the first has none: None)."""

    id: int
    logprob: Logprob | None
    offset: int  # characters of the choice's text (with echo, the prompt's first) before it


@dataclasses.dataclass
class Event:
    """A choice's news: text to append, and its finish reason when it ends ("stop",
    "length"; "error" when the server ended it)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0  # tokens the choice has generated so far
    tokens: list[TokenInfo] = dataclasses.field(default_factory=list)  # with logprobs only
    cached_tokens: int = 0  # at the end: its prompt's tokens the prefix cache gave
    ids: list[int] | None = None  # at the end: every token id the choice generated
    # with the choice's first event, when its job asks: each prompt token's after the first
    prompt_logprobs: list[Logprob] | None = None


class Choice:
    """One generated sequence: a scheduler request and its text so far."""

    def __init__(self, index: int, handle: Handle, job: Job, decode):
        self.index, self.handle, self.job = index, handle, job
        self.submitted = time.perf_counter()
        self.detok = Detokenizer(decode)
        self.stop = StopText(job.stops)
        self.count = 0  # tokens taken (the one that ended the choice included)
        # characters decoded so far (held back ones included), after the echoed prompt
        self.chars = len(decode(handle.prompt)) if job.echo else 0
        self.pending: list[TokenInfo] = []  # tokens not yet sent with an event
        self.prompt: list[Logprob] | None = None  # the prompt's, until an event sends them

    def feed(self, token: int) -> tuple[str, str | None]:
        """(text to show, finish reason or None) after one more token."""
        if self.count == 0 and self.job.scores_prompt:  # they came with the first token
            self.prompt = self.handle.prompt_logprobs
            if self.job.echo and self.job.logprobs is not None:
                self.pending += self._prompt_tokens()
        if self.job.prompt_only:  # the token is not part of the answer
            return "", "length"
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

    def _prompt_tokens(self) -> list[TokenInfo]:
        """The echoed prompt's tokens with their log-probabilities (the first: None) and
        offsets into its text, in whole characters as the answer's."""
        detok, chars, infos = Detokenizer(self.detok.decode), 0, []
        for id, lp in zip(self.handle.prompt, [None, *self.prompt]):
            infos.append(TokenInfo(id, lp, chars))
            chars += len(detok.add(id))
        return infos

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
        prompt, self.prompt = self.prompt, None
        cached = self.handle.cached_tokens if reason else 0
        ids = list(self.handle.tokens[: self.count]) if reason else None
        return Event(
            self.index,
            text,
            reason,
            completion_tokens=self.count,
            tokens=tokens,
            cached_tokens=cached,
            prompt_logprobs=prompt,
            ids=ids,
        )


class Service:
    """Runs API requests on a Scheduler (started: its background thread runs rounds)."""

    def __init__(self, scheduler: Scheduler, decode, settings: Settings, pooling=None):
        self.scheduler, self.decode, self.settings = scheduler, decode, settings
        self.pooling = pooling  # the pooling runner's pipeline.pooling.Pooling, else None
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
        budgets = [
            max_tokens
            if max_tokens is not None
            else ask.default_max_tokens or s.max_seq_len - len(p)
            for p in prompts
        ]
        prompt_only = max_tokens == 0 and ask.echo
        if prompt_only:  # each request runs for one token, which no one is shown
            budgets = [1] * len(prompts)
        if max_tokens == 0 and not ask.echo:
            raise APIError(
                400,
                "max_tokens 0 generates nothing: it needs echo true (the prompt and, with "
                "logprobs, its log-probabilities only)",
                "max_tokens",
                "invalid_value",
            )
        for p, budget in zip(prompts, budgets):
            if budget < 1 and max_tokens is None:
                raise APIError(
                    400,
                    f"the prompt's {len(p)} tokens leave no room for an answer under the "
                    f"server's --max-seq-len {s.max_seq_len}: shorten the prompt",
                    "messages",
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
        if min_tokens < 0:  # before it is capped below
            raise APIError(400, f"min_tokens {min_tokens} must be >= 0", "min_tokens")
        min_tokens = min(min_tokens, max(budgets))  # past the budget it holds back nothing more
        for field, k in (("logprobs", ask.logprobs), ("prompt_logprobs", ask.prompt_logprobs)):
            # At most the top log-probabilities the engine computes a token (the
            # completions API's legacy limit is the same 5).
            if k is not None and not 0 <= k <= TOP_LOGPROBS:
                raise APIError(
                    400, f"{field} {k} must be between 0 and {TOP_LOGPROBS}", field, "invalid_value"
                )
        extra = tuple(ask.stop_token_ids)
        for t in extra:
            if not 0 <= t < s.vocab:
                raise APIError(
                    400, f"stop token id {t} is outside the vocabulary", "stop_token_ids"
                )
        if any(not isinstance(x, str) or not x for x in ask.stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        stop_ids = end_ids(s.eos_ids, extra, ask.ignore_eos)
        for i, (p, budget) in enumerate(zip(prompts, budgets)):
            try:  # prompts, lengths, end ids: the check every door calls
                s.check([p], budget, min_tokens, stop_ids)
            except RequestError as e:
                raise _invalid(e.at_prompt(i)) from None
        return Job(
            prompts=prompts,
            n=n,
            max_tokens=budgets,
            sampling=sampling,
            seed=secrets.randbelow(SEEDS) if ask.seed is None else key_seed(ask.seed),
            stops=list(ask.stops),
            stop_ids=stop_ids,
            min_tokens=min_tokens,
            logprobs=ask.logprobs,
            echo=ask.echo,
            prompt_logprobs=ask.prompt_logprobs,
            prompt_only=prompt_only,
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
        requests = []
        for p, prompt in enumerate(job.prompts):
            for j in range(job.n):
                params = Params(
                    max_new_tokens=job.max_tokens[p],
                    sampling=job.sampling,
                    seed=key_seed(job.seed + j),
                    eos_ids=job.stop_ids,
                    min_tokens=job.min_tokens,
                    logprobs=job.logprobs is not None,
                    prompt_logprobs=job.scores_prompt,
                    constraint=job.constraint,
                )
                requests.append((prompt, params, 0))
        try:
            handles = self.scheduler.submit_all(requests)
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise self.unavailable(in_flags(e), "queue_full") from None  # the server's flag
        except RequestError as e:
            raise _invalid(e) from None
        return [Choice(i, handle, job, self.decode) for i, handle in enumerate(handles)]

    async def pool(self, prompts: list[list[int]], field: str) -> list:
        """Each prompt's hidden state, as a pooling runner's requests (`run.pooled`):
        all checked and queued, or none (a 400 naming `field`, the API's name of the
        prompts; a 503 when the queue is full or the server ends them)."""
        if self.draining:
            raise self.unavailable("the server is shutting down")
        fields = {**FIELDS, "prompts": field}
        submitted = time.perf_counter()
        try:
            check_all(self.settings.check, prompts)
            handles = self.scheduler.submit_all([(p, POOLED, 0) for p in prompts])
        except QueueFull as e:
            self.metrics.rejected("queue_full")
            raise self.unavailable(in_flags(e), "queue_full") from None
        except RequestError as e:
            raise _invalid(e, fields) from None
        for handle in handles:
            async for _ in handle.stream():  # none: it ends with its hidden state
                pass
            self.finished[handle.finish_reason] += 1
            self.metrics.pooled(handle, submitted)
        if any(h.pooled is None for h in handles):
            raise APIError(503, "the server ended the request (shutdown, or an engine error)")
        return [h.pooled for h in handles]

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
