"""The HTTP side (FastAPI): routes, the API key, error bodies, server-sent events and
disconnects. Everything about generating lives in `service`.

    GET  /health               200 when serving; 503 while loading or shutting down
    GET  /metrics              Prometheus' text format (`metrics`); 503 until serving
    GET  /v1/models            the one served model
    POST /v1/completions       prompt: text, texts, token ids, or lists of token ids
    POST /v1/chat/completions  messages rendered with the checkpoint's chat template
    POST /v1/responses         OpenAI's Responses API over the chat path (`responses`);
    GET, DELETE /v1/responses/{id}  a stored response
    POST /v1/embeddings        the pooling runner's (`embeddings`): OpenAI's embeddings
    POST /v1/score, /score     vLLM's: text_1 against text_2, a reranker's P(yes)
    POST /v1/rerank, /rerank, /v2/rerank  vLLM's, Cohere's shape: documents by score
    POST /tokenize             vLLM's: a prompt or chat messages -> token ids
    POST /detokenize           vLLM's: token ids -> text
    GET  /tokenizer_info       the tokenizer's settings (lm-evaluation-harness reads it)

The prompt's log-probabilities (echo with logprobs; vLLM's prompt_logprobs) come from
the prefill (`pipeline.programs.prefill`), which scores every prompt token for such a request;
`protocol` writes every log-probability object.

A stream is `data: <json>\\n\\n` chunks ending with `data: [DONE]\\n\\n`. A client that
goes away mid-request (streamed or not) cancels its choices, which frees their rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from qwen3_spmd.run.serve import (
    embeddings,
    protocol,
    response_items,
    responses,
    structured,
    tools,
)
from qwen3_spmd.run.serve.message import ChatReply, fold
from qwen3_spmd.run.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from qwen3_spmd.run.serve.reasoning import END as THINK_END
from qwen3_spmd.run.serve.reasoning import Qwen3Reasoning
from qwen3_spmd.run.serve.responses import ResponsesRequest
from qwen3_spmd.run.serve.service import Ask, Event, Service
from qwen3_spmd.run.text import TextError

_log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks its client
SHUTDOWN = APIError(
    503, "the server ended the request before it finished (shutdown, or an engine error)"
)


@dataclasses.dataclass
class ServerState:
    """What the routes read: set by the command as loading goes on."""

    model_name: str
    api_key: str | None = None
    service: Service | None = None  # None until the model is loaded and compiled
    text: object | None = None  # run.text.Text, or None without tokenizer.json
    status: str = "loading"  # loading, ready, draining, failed
    reasoning_parser: str | None = None  # "qwen3": thinking -> reasoning_content
    tool_call_parser: str | None = None  # "hermes": <tool_call> -> tool_calls
    # --structured-outputs-config's disable_additional_properties (`request_fields`)
    closed_objects: bool = True
    # --default-chat-template-kwargs: under each request's own chat_template_kwargs
    default_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    stored: responses.Store = dataclasses.field(default_factory=responses.Store)  # /v1/responses


def make_app(state: ServerState) -> FastAPI:
    """The app over `state`, which every route reads as `request.app.state.server`."""
    app = FastAPI(title="qwen3-spmd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_left)
    for method, path, route in ROUTES:
        app.add_api_route(path, route, methods=[method])
    return app


def _server(request: Request) -> ServerState:
    return request.app.state.server


# ---- errors ------------------------------------------------------------------------------


async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: HTTPException):  # unknown routes, methods
    return JSONResponse(APIError(e.status_code, str(e.detail)).body(), e.status_code)


async def _client_left(request: Request, e: ClientDisconnect):
    # Normal traffic, not a server error: a line at INFO rather than uvicorn's
    # "Exception in ASGI application" traceback. No one reads the answer.
    _log.info("%s %s: the client left mid-body", request.method, request.url.path)
    return JSONResponse(_client_gone().body(), 400)


# ---- routes ------------------------------------------------------------------------------


async def health(request: Request):
    state = _server(request)
    if state.status != "ready":
        return JSONResponse({"status": state.status}, status_code=503)
    service = state.service
    return {
        "status": "ok",
        "running": service.scheduler.running,
        "waiting": service.scheduler.waiting,
        "finished": dict(service.finished),
    }


async def metrics(request: Request):  # no API key, as /health and vLLM's /metrics
    state = _server(request)
    if state.service is None:
        return JSONResponse({"status": state.status}, status_code=503)
    registry = state.service.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request):
    state = _server(request)
    service = _ready(state, request)
    model = {
        "id": state.model_name,
        "object": "model",
        "created": protocol.now(),
        "owned_by": "qwen3-spmd",
        "max_model_len": service.settings.max_seq_len,
    }
    return {"object": "list", "data": [model]}


async def completions(request: Request):
    state = _server(request)
    service = _generating(state, request)
    body = protocol.parse(CompletionRequest, await request.body())
    _check_model(state, body.model)
    prompts = _prompt_ids(state, body.prompt)
    constraint = structured.constraint_of(body, closed=state.closed_objects)
    ask = _ask(body, 16, logprobs=body.logprobs, echo=body.echo, constraint=constraint)
    job = service.job(prompts, ask)
    await service.compile(job)
    meta = _Meta(protocol.new_id("cmpl"), "text_completion", state.model_name)
    echo = [service.decode(p) if body.echo else "" for p in prompts for _ in range(job.n)]
    events = service.run(service.submit(job))
    prompt_tokens = sum(len(p) for p in prompts)
    as_ids = body.return_tokens_as_token_ids

    def choice(i, text, reason, tokens, prompt=None):
        logprobs = None
        if job.logprobs is not None:
            logprobs = protocol.completion_logprobs(state.text, tokens, job.logprobs, as_ids)
        out = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if prompt is not None and job.prompt_logprobs is not None:
            ids = job.prompts[i // job.n]
            out["prompt_logprobs"] = protocol.prompt_logprobs(
                state.text, ids, prompt, job.prompt_logprobs
            )
        return out

    if body.stream:
        pieces = lambda e, reason: ([e.text] if e.text else [], reason)
        return _sse(_chunks(events, meta, prompt_tokens, body, choice, echo, pieces, job.n))
    out = await _collect(request, events, len(echo))
    choices = [
        choice(i, echo[i] + t, r, ts, p) for i, (t, r, ts, p) in enumerate(zip(*out[:3], out[5]))
    ]
    cached = _cached_tokens(out[4], job.n)
    usage = protocol.usage(prompt_tokens, out[3], cached)
    return {**meta.head(), "choices": choices, "usage": usage}


@dataclasses.dataclass
class _ChatRun:
    """A chat request under way: its job, its choices' events, its prompt (text and
    ids), and whether its replies are read for tool calls."""

    job: object  # service.Job
    events: AsyncIterator[Event]
    rendered: str
    prompt: list[int]
    read_tools: bool

    def reply(self, state: ServerState) -> ChatReply:
        """A reader of one choice's text (a fresh one per choice)."""
        reasoning = Qwen3Reasoning.for_prompt(self.rendered) if state.reasoning_parser else None
        return ChatReply(reasoning, tools.HermesToolCalls() if self.read_tools else None)


async def _start_chat(state: ServerState, service: Service, body: ChatRequest) -> _ChatRun:
    """The chat `body` checked, rendered, constrained and submitted (chat completions and
    responses alike)."""
    read_tools = tools.check_request(body.tools, body.tool_choice, state.tool_call_parser)
    rendered, prompt = _render_chat(state, body)
    constraint = structured.constraint_of(
        body, read_tools, _think_end(state, rendered), _tag_tokens(state), state.closed_objects
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    ask = _ask(body, None, logprobs=top, constraint=constraint)
    if body.max_completion_tokens is not None:  # the newer name wins
        ask = dataclasses.replace(ask, max_tokens=body.max_completion_tokens)
    job = service.job([prompt], ask)
    await service.compile(job)
    return _ChatRun(job, service.run(service.submit(job)), rendered, prompt, read_tools)


async def chat(request: Request):
    state = _server(request)
    service = _generating(state, request)
    body = protocol.parse(ChatRequest, await request.body())
    _check_model(state, body.model)
    run = await _start_chat(state, service, body)
    job, events, prompt = run.job, run.events, run.prompt
    top = (body.top_logprobs or 0) if body.logprobs else None
    meta = _Meta(protocol.new_id("chatcmpl"), "chat.completion", state.model_name)

    def choice(i, piece, reason, tokens, prompt=None, key="delta"):
        logprobs = protocol.chat_logprobs(state.text, tokens, top) if top is not None else None
        out = {"index": i, key: piece, "logprobs": logprobs, "finish_reason": reason}
        if prompt is not None and job.prompt_logprobs is not None:  # a stream's chunk
            out["prompt_logprobs"] = protocol.prompt_logprobs(
                state.text, job.prompts[0], prompt, job.prompt_logprobs
            )
        return out

    def reply() -> ChatReply:  # one per choice
        return run.reply(state)

    if body.stream:
        first = [{"role": "assistant", "content": ""}] * job.n
        replies = [reply() for _ in range(job.n)]

        def pieces(e, reason):
            r = replies[e.index]
            return r.add(e.text) + (r.end() if e.finish_reason else []), r.finish_reason(reason)

        return _sse(_chunks(events, meta, len(prompt), body, choice, first, pieces, job.n))
    out = await _collect(request, events, job.n)
    return _chat_body(state, meta, job, prompt, out, choice, reply)


def _chat_body(state: ServerState, meta, job, prompt: list[int], out, choice, reply) -> dict:
    """A chat completion's whole (not streamed) body from what `_collect` gathered:
    each choice's message read by a fresh `reply()`, the usage, and (vLLM's, beside the
    choices) the one prompt's log-probabilities."""
    choices = []
    for i, (t, r, ts) in enumerate(zip(*out[:3])):
        whole = reply()
        message = fold(whole.add(t) + whole.end(), reasoning=bool(state.reasoning_parser))
        choices.append(choice(i, message, whole.finish_reason(r), ts, key="message"))
    usage = protocol.usage(len(prompt), out[3], _cached_tokens(out[4], job.n))
    body = {**meta.head(), "choices": choices, "usage": usage}
    scored = next((p for p in out[5] if p is not None), None)
    if job.prompt_logprobs is not None and scored is not None:
        body["prompt_logprobs"] = protocol.prompt_logprobs(
            state.text, prompt, scored, job.prompt_logprobs
        )
    return body


# ---- the Responses API (`responses`: the request as a chat, the reply as output items) ----


async def create_response(request: Request):
    state = _server(request)
    service = _generating(state, request)
    body = protocol.parse(ResponsesRequest, await request.body())
    _check_model(state, body.model)
    earlier = []
    if body.previous_response_id is not None:
        earlier = state.stored.get(body.previous_response_id, "previous_response_id")[1]
    chat_body, said = responses.to_chat(body, earlier)
    run = await _start_chat(state, service, chat_body)
    id, created = response_items.new_id("resp"), protocol.now()

    def finished(output: list[dict], reason, ids, cached: int, error=None) -> dict:
        """The response object once the reply has ended (kept when body.store). ids: the
        generated token ids."""
        status, why = response_items.status_of(reason)
        thinking = _thinking_tokens(state, run.rendered, ids)
        response = response_items.response_object(
            id,
            body,
            state.model_name,
            created,
            "failed" if error else status,
            output,
            response_items.usage(len(run.prompt), len(ids), cached, thinking),
            why,
            error,
        )
        if body.store and error is None:
            state.stored.keep(response, said + responses.said_back(output))
        return response

    if body.stream:
        head = response_items.response_object(
            id, body, state.model_name, created, "in_progress", [], None
        )
        return _sse(_response_events(state, run, head, finished), named=True)
    out = await _collect(request, run.events, 1)
    reply = run.reply(state)
    message = fold(reply.add(out[0][0]) + reply.end(), reasoning=True)
    reason = reply.finish_reason(out[1][0])
    output = response_items.output_items(message, response_items.status_of(reason)[0])
    return finished(output, reason, out[6][0], out[4][0])


async def _response_events(state: ServerState, run: _ChatRun, head: dict, finished):
    """A streamed response's events: created, in progress, each output item's, and
    completed (incomplete at the token budget; failed when the server ended it)."""
    stream, reply = response_items.EventStream(), run.reply(state)
    yield stream.event("response.created", response=head)
    yield stream.event("response.in_progress", response=head)
    reason, ids, cached = None, [], 0
    async with contextlib.aclosing(run.events):
        async for e in run.events:
            reason, cached, ids = e.finish_reason, e.cached_tokens, e.ids or ids
            if reason == "error":
                break
            for delta in reply.add(e.text) + (reply.end() if reason else []):
                for event in stream.add(delta):
                    yield event
    if reason == "error":
        for event in stream.close("incomplete"):
            yield event
        error = {"code": "server_error", "message": SHUTDOWN.message}
        yield stream.event("response.failed", response=finished(stream.items, None, ids, 0, error))
        return
    reason = reply.finish_reason(reason)
    status, _ = response_items.status_of(reason)
    if not stream.items and not stream.writing:  # no text and no call: an empty message
        for event in stream.add({"content": ""}):
            yield event
    for event in stream.close(status):
        yield event
    response = finished(stream.items, reason, ids, cached)
    yield stream.event(f"response.{status}", response=response)


def _thinking_tokens(state: ServerState, rendered: str, ids: list[int]) -> int:
    """Tokens of a reply's thinking, its `</think>` included (all of them when it was cut
    while thinking); 0 without the reasoning parser or with thinking off."""
    end = _think_end(state, rendered)
    if end is None:
        return 0
    return ids.index(end) + 1 if end in ids else len(ids)


async def get_response(request: Request, response_id: str):
    state = _server(request)
    _ready(state, request)
    return state.stored.get(response_id)[0]


async def delete_response(request: Request, response_id: str):
    state = _server(request)
    _ready(state, request)
    state.stored.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


# ---- the pooling runner's (`embeddings`)


async def _pooled(request: Request, model, answer):
    """A pooling endpoint: the body parsed as `model` and answered by `answer` (one of
    `embeddings`' embeddings, score, rerank) on the service."""
    state = _server(request)
    service = _ready(state, request)
    body = protocol.parse(model, await request.body())
    _check_model(state, body.model)
    return await answer(service, state.text, state.model_name, body)


async def create_embeddings(request: Request):
    return await _pooled(request, embeddings.EmbeddingRequest, embeddings.embeddings)


async def score(request: Request):
    return await _pooled(request, embeddings.ScoreRequest, embeddings.score)


async def rerank(request: Request):
    return await _pooled(request, embeddings.RerankRequest, embeddings.rerank)


# ---- the tokenizer (vLLM's endpoints; outside /v1, so without the API key, as vLLM's):
# what an evaluation harness needs instead of tokenizer files of its own


async def tokenize(request: Request):
    state = _server(request)
    text = _tokenizer(state)
    body = protocol.parse(TokenizeRequest, await request.body())
    _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send one of prompt or messages", "prompt", "invalid_value")
    if body.messages is not None:
        chat = ChatRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        tokens = _render_chat(state, chat)[1]
    else:
        tokens = text.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    max_len = state.service.settings.max_seq_len if state.service is not None else None
    return {"count": len(tokens), "max_model_len": max_len, "tokens": tokens}


async def detokenize(request: Request):
    state = _server(request)
    text = _tokenizer(state)
    body = protocol.parse(DetokenizeRequest, await request.body())
    _check_model(state, body.model)
    bad = next((t for t in body.tokens if t < 0), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is negative", "tokens", "invalid_value")
    return {"prompt": text.decode(body.tokens)}


async def tokenizer_info(request: Request):
    config = _tokenizer(_server(request)).config
    info = {
        "tokenizer_class": config.get("tokenizer_class"),
        "model_max_length": config.get("model_max_length"),
        "chat_template": config.get("chat_template"),
    }
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        token = config.get(name)
        info[name] = token.get("content") if isinstance(token, dict) else token
    return info


# (method, path, route): the module docstring's table.
ROUTES = (
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat),
    ("POST", "/v1/responses", create_response),
    ("GET", "/v1/responses/{response_id}", get_response),
    ("DELETE", "/v1/responses/{response_id}", delete_response),
    ("POST", "/v1/embeddings", create_embeddings),
    ("POST", "/v1/score", score),
    ("POST", "/score", score),
    ("POST", "/v1/rerank", rerank),
    ("POST", "/rerank", rerank),
    ("POST", "/v2/rerank", rerank),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("GET", "/tokenizer_info", tokenizer_info),
)


# ---- checks ------------------------------------------------------------------------------


def _client_gone() -> APIError:
    return APIError(400, "the client disconnected", None, "client_disconnected")


def _ready(state: ServerState, request: Request) -> Service:
    """The service, once the key is right and the server serves (else 401 or 503)."""
    if state.api_key is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                "with the server's --api-key",
                None,
                "invalid_api_key",
            )
    if state.status != "ready":
        why = {"loading": "the server is still loading the model", "failed": "loading failed"}
        message = why.get(state.status, "the server is shutting down")
        raise APIError(503, message, None, state.status, {"Retry-After": "5"})
    return state.service


def _generating(state: ServerState, request: Request) -> Service:
    """`_ready`'s service, on a server that generates (a 400 on a pooling runner's)."""
    service = _ready(state, request)
    if service.pooling is not None:
        raise APIError(
            400,
            f"this server runs the pooling runner ({service.pooling.task}): it generates no "
            "text; "
            + (
                "use POST /v1/score or /v1/rerank"
                if service.pooling.task == "score"
                else "use POST /v1/embeddings"
            ),
            "model",
            "invalid_value",
        )
    return service


def _tokenizer(state: ServerState):
    """The checkpoint's Text (a 503 while loading, a 400 without tokenizer.json)."""
    if state.text is not None:
        return state.text
    if state.status == "loading":
        raise APIError(503, "the server is still loading the model", None, "loading")
    raise APIError(400, "this checkpoint has no tokenizer.json: send and read token ids")


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"the model {name!r} is not served here: this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )


def _prompt_ids(state: ServerState, prompt) -> list[list[int]]:
    """A completion's prompt field -> token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: send text or token ids", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    if state.text is None:
        raise APIError(
            400,
            "this checkpoint has no tokenizer.json, so text cannot be encoded: send the "
            "prompt as token ids",
            "prompt",
        )
    return [state.text.encode(p) for p in prompt]


def _render_chat(state: ServerState, body: ChatRequest) -> tuple[str, list[int]]:
    """The prompt as text and as token ids: the messages, and the tools, rendered with
    the chat template."""
    if state.text is None:
        raise APIError(
            400, "this checkpoint has no tokenizer.json: use /v1/completions with token ids"
        )
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    # Content parts: their texts, joined (the template takes text).
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            texts = [p.get("text", "") if isinstance(p, dict) else "" for p in m["content"]]
            j = next((j for j, t in enumerate(texts) if not isinstance(t, str)), None)
            if j is not None:
                param = f"messages.{i}.content.{j}.text"
                raise APIError(400, f"{param} must be a string", param, "invalid_value")
            m["content"] = "".join(texts)
        if m["role"] == "assistant":  # a turn of tool calls only has null content
            m.setdefault("content", "")
    # The request's chat_template_kwargs win over the server's defaults, and the body's
    # own fields over both.
    asked = {**state.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    kwargs = {k: v for k, v in asked.items() if k not in ("messages", "add_generation_prompt")}
    if body.tools:  # as sent; Qwen3's template lists them in the system turn
        kwargs["tools"] = body.tools
    if body.tool_choice is not None:
        kwargs["tool_choice"] = body.tool_choice
    try:
        rendered = state.text.render(messages, body.add_generation_prompt, **kwargs)
    except TextError as e:
        raise APIError(400, str(e), "messages") from None
    return rendered, state.text.encode(rendered)


def _think_end(state: ServerState, rendered: str) -> int | None:
    """The token that starts a reply's constraint: with the reasoning parser and
    thinking on, Qwen3's `</think>` (the thinking stays free text); None (from the
    first token) without, or where the prompt has closed the thinking already
    (enable_thinking false)."""
    if not state.reasoning_parser or Qwen3Reasoning.for_prompt(rendered).state == "answer":
        return None
    return state.text.tokenizer.token_to_id(THINK_END)


def _tag_tokens(state: ServerState) -> bool:
    """Whether the tokenizer has `<tool_call>` and `</tool_call>` as added tokens (Qwen3's
    has), which a forced call's grammar then names as tokens."""
    added = {t.content for t in state.text.tokenizer.get_added_tokens_decoder().values()}
    return tools.OPEN in added and tools.CLOSE in added


def _ask(
    body,
    default_max_tokens: int | None,
    logprobs: int | None,
    echo: bool = False,
    constraint: tuple = (None, None),
) -> Ask:
    """What the body asks of each choice (the fields both endpoints share); constraint:
    (Constraint, its field) or (None, None)."""
    return Ask(
        constraint=constraint[0],
        constraint_field=constraint[1],
        n=body.n,
        max_tokens=body.max_tokens,
        default_max_tokens=default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stops=tuple(body.stops),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=logprobs,
        echo=echo,
        prompt_logprobs=body.prompt_logprobs,
    )


# ---- responses ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Meta:
    id: str
    object: str  # text_completion or chat.completion
    model: str
    created: int = dataclasses.field(default_factory=protocol.now)

    def head(self, chunk: bool = False) -> dict:
        kind = self.object + (".chunk" if chunk and self.object.startswith("chat") else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


async def _collect(request: Request, events: AsyncIterator[Event], n: int):
    """Every choice's whole text, finish reason and tokens (with logprobs), the tokens
    generated in all, each choice's prompt tokens from the prefix cache, its prompt's
    log-probabilities (None unless asked) and its generated token ids; cancels
    them if the client goes away meanwhile (FastAPI would not notice it)."""
    texts, reasons, tokens, used = [""] * n, [None] * n, [[] for _ in range(n)], [0]
    cached, prompts, ids = [0] * n, [None] * n, [[] for _ in range(n)]

    async def read():
        async with contextlib.aclosing(events):
            async for e in events:
                texts[e.index] += e.text
                tokens[e.index] += e.tokens
                if e.prompt_logprobs is not None:
                    prompts[e.index] = e.prompt_logprobs
                if e.finish_reason:
                    reasons[e.index] = e.finish_reason
                    used[0] += e.completion_tokens
                    cached[e.index] = e.cached_tokens
                    ids[e.index] = e.ids or []

    task = asyncio.create_task(read())
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise _client_gone()
    task.result()
    if "error" in reasons:
        raise SHUTDOWN
    return texts, reasons, tokens, used[0], cached, prompts, ids


def _sse(chunks: AsyncIterator[dict], named: bool = False) -> StreamingResponse:
    """Server-sent events of `chunks`, then `[DONE]`; named: each event is named by its
    chunk's type, and no `[DONE]` follows (the Responses API's stream)."""

    async def lines():
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                name = f"event: {chunk['type']}\n" if named else ""
                yield f"{name}data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


async def _chunks(
    events: AsyncIterator[Event],
    meta: _Meta,
    prompt_tokens: int,
    body,
    choice: Callable[..., dict],
    first: list,
    pieces: Callable[[Event, str | None], tuple[list, str | None]],
    n: int,
):
    """A stream's chunks: each choice's `first` piece (the echoed prompt, the chat
    role), its deltas and finish reason, then the usage (include_usage; in every chunk
    too with continuous_usage_stats) or, when the server ended the request, an error.
    pieces(event, finish reason): what to send for an event (texts, or chat deltas:
    several, or none while a parser holds text back) and the finish reason to send; an
    event's tokens (logprobs) go with the next chunk of their choice, and its prompt's
    log-probabilities (prompt_logprobs) with the first. n: choices per prompt."""
    chat = meta.object.startswith("chat")
    made, failed, tokens, cached = [0] * len(first), False, [[] for _ in first], [0] * len(first)
    prompts: list = [None] * len(first)

    def chunk(choices: list) -> dict:
        out = {**meta.head(chat), "choices": choices}
        if body.continuous_usage:  # the tokens so far (vLLM's continuous_usage_stats)
            out["usage"] = protocol.usage(prompt_tokens, sum(made), _cached_tokens(cached, n))
        return out

    for i, piece in enumerate(first):
        if piece:
            yield chunk([choice(i, piece, None, [])])
    async with contextlib.aclosing(events):
        async for e in events:
            failed |= e.finish_reason == "error"
            sent, reason = pieces(e, None if e.finish_reason == "error" else e.finish_reason)
            tokens[e.index] += e.tokens
            made[e.index] = e.completion_tokens
            if e.prompt_logprobs is not None:
                prompts[e.index] = e.prompt_logprobs
            if e.finish_reason:
                cached[e.index] = e.cached_tokens
            if reason and not sent:
                sent = [{} if chat else ""]
            for k, piece in enumerate(sent):
                last = reason if k == len(sent) - 1 else None
                yield chunk([choice(e.index, piece, last, tokens[e.index], prompts[e.index])])
                tokens[e.index], prompts[e.index] = [], None
    if failed:
        yield SHUTDOWN.body()
    elif body.include_usage:
        usage = protocol.usage(prompt_tokens, sum(made), _cached_tokens(cached, n))
        yield {**meta.head(chat), "choices": [], "usage": usage}


def _cached_tokens(per_choice: list[int], n: int) -> int:
    """Prompt tokens the prefix cache gave, each prompt counted once as prompt_tokens
    counts it (its n choices are requests of their own; the most any of them got)."""
    return sum(max(per_choice[i : i + n]) for i in range(0, len(per_choice), n))
