"""The OpenAI API's shapes: request bodies (pydantic, unknown fields ignored), the
error body, and the response and stream-chunk objects, log-probabilities included.

Only what the server reads is modelled; a field of the wrong type is a 400 that names
it (`APIError.from_validation`), a field the server does not know is ignored, as the
OpenAI API and vLLM do, but for the known fields that would change the answer and are
not served (`NEUTRAL`), which are a 400 naming them.

In a top_logprobs dict each token id has its own key: a token whose text another id of
the same dict already has is keyed "token_id:N" (vLLM's return_tokens_as_token_ids
spelling), so harnesses that read "greedy" off those dicts lose no id.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 16  # choices per request, at most


class APIError(Exception):
    """An error response: HTTP status, OpenAI's error body, extra headers."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "service_unavailable_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_validation(cls, e: ValidationError) -> APIError:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        return cls(400, f"{param or 'the body'}: {first['msg']}", param, "invalid_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format (an unknown type is a 400 naming response_format.type)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object
    (`run.serve.structured`); a key it does not know is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    # JSON is compact here whatever these say (no whitespace between tokens).
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


# Fields of OpenAI's or vLLM's requests that change the answer and that this server does
# not serve: each is refused with a 400 naming it (`unserved`) unless it holds the value
# that changes nothing, rather than dropped as an unknown field would be.
NEUTRAL = {
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "min_p": lambda v: v in (None, 0),
    "best_of": lambda v: v in (None, 1),
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v in (None, 1),
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "suffix": lambda v: not v,
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
}


def unserved(body: dict) -> None:
    """A 400 naming the first field of a body that would change the answer and is not
    served."""
    for field, neutral in NEUTRAL.items():
        if field in body and not neutral(body[field]):
            raise APIError(
                400,
                f"{field} is not served by this server: leave it out",
                field,
                "unsupported_parameter",
            )


class _Request(BaseModel):
    """The fields both endpoints share. None: the server's default."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off (vLLM's -1 accepted)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's log-probabilities, k top
    # Structured outputs (`run.serve.structured`).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk, the tokens so far (vLLM's, with include_usage only)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # with logprobs, the prompt's tokens and log-probabilities first
    logprobs: int | None = None  # top log-probabilities per token (0..5)
    # vLLM's: every token and top_logprobs key spelled "token_id:N"
    return_tokens_as_token_ids: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool calls and the like reach the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # as sent: the template renders them
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: a forced call is one call


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a text prompt, or chat messages in the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    """A request body -> the model, or a 400 naming what is wrong."""
    try:
        body = json.loads(raw)
        where = _not_text(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON ({e})", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    unserved(body)
    if where is not None:
        param = ".".join(where)
        raise APIError(
            400,
            f"{param}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not text: send valid Unicode",
            param,
            "invalid_value",
        )
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise APIError.from_validation(e) from None


def _not_text(value, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The path to the first string of a JSON value (keys too) that is not text: one
    holding a lone surrogate, which JSON's escapes can spell but no tokenizer or UTF-8
    encoder takes. A key that is not text is named by its escaped spelling."""
    if isinstance(value, str):
        return None if value.isascii() or _utf8(value) else path
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for key, v in items:
        if not _utf8(key):
            return (*path, key.encode("utf-8", "backslashreplace").decode())
        found = _not_text(v, (*path, key))
        if found is not None:
            return found
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache gave."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# ---- log-probabilities, as each API writes them ------------------------------------------
# `text` is the checkpoint's run.text.Text, or None without tokenizer.json (tokens are
# then "<|id:N|>"); `tokens` a choice's service.TokenInfo list.


def completion_logprobs(text, tokens, k: int, as_ids: bool = False) -> dict:
    """The completions API's (legacy) logprobs object, as vLLM writes it: per token its
    text, log-probability and a dict of the token itself and the k most likely (an
    echoed prompt's first token has none: null), and its offset into the text (the
    echo's included). as_ids: every token spelled "token_id:N"."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(_key(text, t.id, as_ids))
        out["text_offset"].append(t.offset)
        if t.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(t.logprob.chosen))
        top: dict[str, float] = {}
        seen = set()
        for id, value in [(t.id, t.logprob.chosen), *t.logprob.top[:k]]:
            if id in seen:
                continue
            seen.add(id)
            key = _key(text, id, as_ids)
            top[f"token_id:{id}" if key in top else key] = _finite(value)  # one key an id
        out["top_logprobs"].append(top)
    return out


def _key(text, id: int, as_ids: bool) -> str:
    """A token as the completions API names it: its text, or "token_id:N"."""
    return f"token_id:{id}" if as_ids else _token(text, id)[0]


def prompt_logprobs(text, ids: list[int], scored, k: int) -> list:
    """vLLM's prompt_logprobs: null for the first token, then per token {id: {logprob,
    rank, decoded_token}} of the token itself and its position's k most likely."""
    from qwen3_spmd.pipeline.batch.handles import prompt_positions

    def entry(id: int, logprob: float, rank: int) -> dict:
        shown = text.decode([id]) if text is not None else f"<|id:{id}|>"
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": shown}

    return prompt_positions(ids, scored, k, entry)


def chat_logprobs(text, tokens, k: int) -> dict:
    """The chat API's logprobs object: per token its text, log-probability and bytes,
    and the k most likely as the same."""

    def entry(id: int, logprob: float) -> dict:
        shown, raw = _token(text, id)
        return {"token": shown, "logprob": _finite(logprob), "bytes": list(raw)}

    return {
        "content": [
            {
                **entry(t.id, t.logprob.chosen),
                "top_logprobs": [entry(*x) for x in t.logprob.top[:k]],
            }
            for t in tokens
        ]
    }


def _token(text, id: int) -> tuple[str, bytes]:
    """A token as text and as bytes. A token holding part of a character is
    'bytes:\\xe6\\x97' (as the OpenAI API writes it): distinct tokens, distinct keys."""
    raw = text.token_bytes(id) if text is not None else f"<|id:{id}|>".encode()
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf (vLLM's floor)
