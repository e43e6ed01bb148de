"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) over
the chat path: a request's input items become chat messages (`to_chat`), and the
reply's message deltas (`message.ChatReply`) become output items, whole or as the API's
stream of events (`response_items`); stored responses (`Store`) keep the conversation a
later one continues.

    input         a string (one user message), or items: messages (role user, system,
                  developer or assistant; content a string or text parts),
                  function_call items (an earlier turn's calls), function_call_output
                  items (their results); reasoning items are taken and left out (Qwen3's
                  template drops earlier turns' thinking)
    instructions  a system message first (not carried to a later response)
    tools         function tools (name, description, parameters, strict); tool_choice
                  auto, none, required or {"type": "function", "name": N}, as on chat
    text.format   text, json_object or json_schema, constrained as response_format is
    reasoning     effort none or minimal: thinking off (enable_thinking false); low to
                  xhigh: on; no effort: the server's default. The thinking comes
                  back as a reasoning item's reasoning_text (no summary is written)
    previous_response_id  a stored response's conversation (input and output) first
    store         kept in memory (the last STORED responses): GET and DELETE by id

A field this server does not know, or a known one holding a value that would change the
answer and is not served (`NEUTRAL`), is a 400 naming it: nothing is dropped unsaid.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from qwen3_spmd.run.serve.protocol import APIError, ChatRequest

STORED = 1024  # responses kept for previous_response_id and GET, the oldest dropped first
THINKING_OFF = ("none", "minimal")
# The chat fields `to_chat` fills, by the Responses fields they come from.
CHAT_NAMES = {
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextConfig(_Strict):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None  # taken: the thinking comes back whole, not summarized
    generate_summary: str | None = None  # its older name


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's
    seed: int | None = None  # vLLM's
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to hide
    # Hints that change no answer here.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # Served only with the value that changes nothing (NEUTRAL).
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None


# field -> (the values served, what to do instead)
NEUTRAL = {
    "include": (lambda v: not v, "no extra output is written here: leave it out"),
    "truncation": (
        lambda v: v in (None, "disabled"),
        'the input is never cut to fit: leave it out or send "disabled"',
    ),
    "background": (lambda v: not v, "responses run while the request waits: leave it out"),
    "top_logprobs": (lambda v: v in (None, 0), "use /v1/chat/completions for log-probabilities"),
    "max_tool_calls": (lambda v: v is None, "leave it out"),
    "conversation": (lambda v: v is None, "send previous_response_id instead"),
    "prompt": (lambda v: v is None, "no stored prompts here: send input and instructions"),
    "context_management": (lambda v: v is None, "leave it out"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "leave it out"),
    "text.verbosity": (lambda v: v is None, "leave it out"),
}


def check(body: ResponsesRequest) -> None:
    """A 400 naming the first NEUTRAL field whose value is not served, or a bad effort."""
    for field, (served, instead) in NEUTRAL.items():
        if field == "text.verbosity":
            value = body.text.verbosity if body.text else None
        else:
            value = getattr(body, field)
        if not served(value):
            raise APIError(
                400,
                f"{field} {value!r} is not served by this server: {instead}",
                field,
                "unsupported_value",
            )
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None and effort not in EFFORTS:
        raise APIError(
            400,
            f"reasoning.effort {effort!r} is not one of {', '.join(EFFORTS)}",
            "reasoning.effort",
            "invalid_value",
        )


# ---- the request as a chat ---------------------------------------------------------------


def to_chat(body: ResponsesRequest, earlier: list[dict]) -> tuple[ChatRequest, list[dict]]:
    """(the chat request `body` asks for, the conversation to store: `earlier` messages
    and the input's, without the instructions). earlier: a stored response's."""
    check(body)
    said = earlier + input_messages(body.input)
    if not said:
        raise APIError(400, "input is empty: send text or items", "input", "invalid_value")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = dict(
        messages=system + said,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        tools=_chat_tools(body.tools),
        tool_choice=_chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
    )
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": effort not in THINKING_OFF}
    try:
        chat = ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # named as the Responses API names the field
        error = APIError.from_validation(e)
        for chat_name, name in CHAT_NAMES.items():
            if error.param and error.param.startswith(chat_name):
                param = name + error.param[len(chat_name) :]
                error = APIError(400, error.message.replace(error.param, param), param, error.code)
        raise error from None
    return chat, said


def input_messages(given: str | list[dict]) -> list[dict]:
    """The chat messages of a Responses input: a string, or its items."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict] = []
    for i, item in enumerate(given):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role", f"{role!r} is not user, system, developer or assistant")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _chat_call(
                _string(item, "call_id", where),
                _string(item, "name", where),
                _string(item, "arguments", where),
            )
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # else the same turn's
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind != "reasoning":
            raise _bad(
                f"{where}.type",
                f"{kind!r} is not an input item served here (message, function_call, "
                "function_call_output, reasoning)",
            )
    return messages


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "a message's content is a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise _bad(
                f"{where}.content.{j}.type",
                f"{kind!r} is not served: this model reads text parts only (input_text)",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _bad(f"{where}.content.{j}.text", "a text part's text is a string")
        texts.append(text)
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise _bad(f"{where}.{key}", f"a {item.get('type')} item needs {key}, a string")
    return item[key]


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools ({type, name, parameters, ...}) in chat's form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(
                f"tools.{i}.type",
                f"{tool.get('type')!r} tools are not run by this server: send function tools",
            )
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools.{i}.name", "a function tool needs a name")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice):
    """Responses' tool_choice in chat's form ({"type": "function", "name"} nests)."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(
        "tool_choice",
        'send "auto", "none", "required" or {"type": "function", "name": ...}',
    )


def _response_format(text: TextConfig | None) -> dict | None:
    """text.format in chat's response_format form."""
    fmt = text.format if text else None
    if fmt is None:
        return None
    if fmt.get("type") == "json_schema":
        named = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": named}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise _bad("text.format.type", f"{fmt.get('type')!r} is not text, json_object or json_schema")


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param, "invalid_value")


# ---- the conversation a later response continues ------------------------------------


def said_back(items: list[dict]) -> list[dict]:
    """The chat messages of a response's output (what a later turn reads): the text and
    the calls as one assistant message."""
    message: dict = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            call = _chat_call(item["call_id"], item["name"], item["arguments"])
            message.setdefault("tool_calls", []).append(call)
    return [message]


def _chat_call(call_id: str, name: str, arguments: str) -> dict:
    """A call as a chat message's tool_calls hold it."""
    function = {"name": name, "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


# ---- stored responses --------------------------------------------------------------------


class Store:
    """The last STORED responses (store true): each response object and the
    conversation a later response continues (`previous_response_id`)."""

    def __init__(self, size: int = STORED):
        self.size = size
        self._kept: collections.OrderedDict[str, tuple[dict, list[dict]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def keep(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._kept[response["id"]] = (response, conversation)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def get(self, id: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        """(the response, its conversation), or a 404 naming `param`."""
        with self._lock:
            found = self._kept.get(id)
        if found is None:
            raise APIError(
                404,
                f"no stored response {id!r} (it was not stored, was deleted, or is one of "
                f"the oldest past the last {self.size})",
                param,
                "response_not_found",
            )
        return found

    def delete(self, id: str) -> None:
        self.get(id)
        with self._lock:
            self._kept.pop(id, None)
