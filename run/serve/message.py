"""A chat choice's text -> the API's assistant message: `content`, and with the
server's parsers `reasoning_content` (`reasoning.Qwen3Reasoning`) and `tool_calls`
(`tools.HermesToolCalls`), the second reading what the first calls content.

Both a stream and a whole response are built from the same deltas: a stream sends
them as they come, a whole response is them folded into one message (`fold`), the way
a client adds up a stream. So the two always agree.
"""

from __future__ import annotations

from qwen3_spmd.run.serve.reasoning import Qwen3Reasoning
from qwen3_spmd.run.serve.tools import HermesToolCalls, ToolCall


class ChatReply:
    """One choice's text deltas -> the API's message deltas (dicts, as a stream's
    `choices[].delta` carries them)."""

    def __init__(
        self, reasoning: Qwen3Reasoning | None = None, tools: HermesToolCalls | None = None
    ):
        self.reasoning, self.tools = reasoning, tools
        self._calls = 0  # tool calls sent: the next one's index

    def add(self, text: str) -> list[dict]:
        """The deltas that `text`, after what came before, settles."""
        if not text:
            return []
        thought, content = self.reasoning.add(text) if self.reasoning else ("", text)
        return self._deltas(thought, self.tools.add(content) if self.tools else [content])

    def end(self) -> list[dict]:
        """The deltas held back when the text ends."""
        thought, content = self.reasoning.end() if self.reasoning else ("", "")
        pieces = (self.tools.add(content) + self.tools.end()) if self.tools else [content]
        return self._deltas(thought, pieces)

    def finish_reason(self, reason: str | None) -> str | None:
        """A reply that ends with calls made ends for "tool_calls" (OpenAI's reason)."""
        return "tool_calls" if reason == "stop" and self._calls else reason

    def _deltas(self, thought: str, pieces: list[str | ToolCall]) -> list[dict]:
        out = [{"reasoning_content": thought}] if thought else []
        for piece in pieces:
            if isinstance(piece, str):
                out += [{"content": piece}] if piece else []
                continue
            named = {"name": piece.name, "arguments": ""}
            head = {"index": self._calls, "id": piece.id, "type": "function", "function": named}
            arguments = {"index": self._calls, "function": {"arguments": piece.arguments}}
            out += [{"tool_calls": [head]}, {"tool_calls": [arguments]}]  # the name first
            self._calls += 1
        return out


def fold(deltas: list[dict], reasoning: bool) -> dict:
    """The assistant message that `deltas` add up to. reasoning: the server reads
    reasoning (the message has `reasoning_content`, None when there was none)."""
    content, thought, calls = "", "", []
    for d in deltas:
        content += d.get("content", "")
        thought += d.get("reasoning_content", "")
        for call in d.get("tool_calls", ()):
            if "id" in call:
                named = {"name": call["function"]["name"], "arguments": ""}
                calls.append({"id": call["id"], "type": "function", "function": named})
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    message = {"role": "assistant", "content": content or (None if thought or calls else "")}
    if reasoning:
        message["reasoning_content"] = thought or None
    if calls:
        message["tool_calls"] = calls
    return message
