"""Tool calls: the request's `tools` and `tool_choice`, and Qwen3's calls read back from
its text (`serve --tool-call-parser hermes`, vLLM's name for the format).

Qwen3 calls a function by writing, possibly several times in one reply,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`HermesToolCalls` reads one choice's content as it streams, a delta at a time, and
gives back content text and whole `ToolCall`s. A call goes out only once its closing
tag has come and its JSON has parsed: a malformed call (bad JSON, no name, arguments
that are no object) then still goes out as the text it was, and the streamed pieces of
a reply always add up to the reply read whole. A call's arguments are therefore sent
in one fragment, after the delta that names the function.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable

from qwen3_spmd.run.serve.detok import partial_end
from qwen3_spmd.run.serve.protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)
CHOICES = ("none", "auto", "required")  # required, or a named function: a forced call


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (the API's function.arguments)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HermesToolCalls:
    """One choice's content deltas -> pieces: content text (str) and `ToolCall`s.

    States:
        text   outside a call: content, until `<tool_call>`
        call   inside one: its text is kept until `</tool_call>`, then parsed

    Whitespace next to a call that parsed belongs to no piece (Qwen3 puts newlines
    between calls); next to a malformed one it stays, with the call's text. Held back
    for the next delta: in text, an end that may be `<tool_call>` and the whitespace
    before it.
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.new_id = new_id
        self.state = "text"
        self._held = ""  # text: may be whitespace + the start of OPEN; call: its text
        self._before = ""  # the whitespace before the open call
        self._strip = False  # whitespace after a call: dropped

    def add(self, text: str) -> list[str | ToolCall]:
        """The pieces that `text`, after what came before, settles."""
        text, self._held = self._held + text, ""
        out: list[str | ToolCall] = []
        while text:
            if self.state == "text":
                text = self._lstrip(text)
                start = text.find(OPEN)
                if start < 0:
                    cut = len(text) - partial_end(text, OPEN)
                    cut = len(text[:cut].rstrip())  # whitespace that may come before OPEN
                    out.append(text[:cut])
                    self._held = text[cut:]
                    break
                body = text[:start].rstrip()
                out.append(body)
                self._before = text[len(body) : start]
                self.state, text = "call", text[start + len(OPEN) :]
            else:
                stop = text.find(CLOSE)
                if stop < 0:
                    self._held = text
                    break
                out.append(self._close(text[:stop], CLOSE))
                self.state, text = "text", text[stop + len(CLOSE) :]
        return [p for p in out if p]

    def end(self) -> list[str | ToolCall]:
        """The pieces held back when the text ends. A call cut off before its closing
        tag still counts if its JSON is whole."""
        held, self._held = self._held, ""
        if self.state == "call":
            self.state = "text"
            return [self._close(held, "")]
        return [held] if held else []

    def _close(self, body: str, close: str) -> str | ToolCall:
        """The call whose text (between the tags) is `body`, or that text as content."""
        call = _parse(body)
        if call is None:
            self._strip = False
            return self._before + OPEN + body + close
        self._strip = True
        return ToolCall(self.new_id(), *call)

    def _lstrip(self, text: str) -> str:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text


def _parse(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of `{"name": ..., "arguments": {...}}`, or None."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the object as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def check_request(tools: list | None, tool_choice, parser: str | None) -> bool:
    """Whether a chat request's reply is read for tool calls: it sends `tools` and does
    not say tool_choice "none". A 400 for tools the template cannot take, a choice
    serve does not offer, a function the tools do not have, or tools to a server that
    reads no calls. (A forced call, "required" or named, is a constraint:
    `run.serve.structured`.)"""
    names = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise APIError(
                400,
                'a tool must be {"type": "function", "function": {"name": ...}}',
                f"tools.{i}",
                "invalid_value",
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, "a function needs a name", f"tools.{i}.function.name")
        names.append(function["name"])
    if tool_choice is None:
        tool_choice = "auto" if names else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
                "invalid_value",
            )
        if name not in names:
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"sent ({', '.join(names) or 'none'})",
                "tool_choice",
                "invalid_value",
            )
    elif tool_choice not in CHOICES:
        raise APIError(
            400,
            f"tool_choice {tool_choice!r} is not served here: send 'auto', 'none', "
            "'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
            "invalid_value",
        )
    if tool_choice == "required" and not names:
        raise APIError(400, "tool_choice 'required' needs tools", "tool_choice", "invalid_value")
    if tool_choice == "none" or not names:
        return False
    if parser is None:
        raise APIError(
            400,
            "this server reads no tool calls: start it with --tool-call-parser hermes, or "
            "send tool_choice 'none'",
            "tool_choice",
        )
    return True
