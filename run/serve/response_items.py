"""The Responses API's output: items (reasoning, message, function_call), the response
object and its usage, whole or as the API's stream of events (`EventStream`), built from
the chat reply's message deltas (`message.ChatReply`, `message.fold`). The request side
is `responses`."""

from __future__ import annotations

import uuid

from qwen3_spmd.run.serve.responses import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict, status: str) -> list[dict]:
    """The output items of a folded assistant message (`message.fold`): its thinking, its
    text (an empty one when there is nothing else), its calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    for call in calls:
        function = call["function"]
        items.append(
            call_item(new_id("fc"), call["id"], function["name"], function["arguments"], status)
        )
    return items


def reasoning_item(id: str, text: str | None) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": id, "type": "reasoning", "summary": [], "content": content}


def message_item(id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"id": id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    id: str,
    body: ResponsesRequest,
    model: str,
    created: int,
    status: str,
    output: list[dict],
    usage: dict | None,
    incomplete: str | None = None,
    error: dict | None = None,
) -> dict:
    """The API's response object."""
    effort = body.reasoning.effort if body.reasoning else None
    return {
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "text": {
            "format": (body.text.format if body.text and body.text.format else None)
            or {"type": "text"}
        },
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning: int) -> dict:
    """The Responses API's usage object; reasoning: the output's thinking tokens."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt_tokens + output_tokens,
    }


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(the response's status, its incomplete_details reason) for a finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


# ---- the stream --------------------------------------------------------------------------


class EventStream:
    """The Responses API's events for one reply, from the chat message deltas: each run
    of one kind of delta is an output item (reasoning, message, or one function call),
    opened with output_item.added and closed with its .done events before the next."""

    def __init__(self):
        self.sequence = 0
        self.items: list[dict] = []  # closed output items, in order
        self._open: dict | None = None  # the item being written

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def add(self, delta: dict) -> list[dict]:
        """The events of one message delta (`message.ChatReply`)."""
        out = []
        if "reasoning_content" in delta:
            out += self._into("reasoning")
            text = delta["reasoning_content"]
            self._open["content"][0]["text"] += text
            out.append(self._delta("response.reasoning_text.delta", text))
        elif "content" in delta:
            out += self._into("message")
            text = delta["content"]
            self._open["content"][0]["text"] += text
            if text:  # an empty message has no delta
                out.append(self._delta("response.output_text.delta", text, logprobs=[]))
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if "id" in call:  # a new call: its name first
                out += self._close()
                item = call_item(new_id("fc"), call["id"], function["name"], "", "in_progress")
                out += self._opened(item)
            elif function.get("arguments"):
                self._open["arguments"] += function["arguments"]
                delta = function["arguments"]
                out.append(
                    self._of(self._open, "response.function_call_arguments.delta", delta=delta)
                )
        return out

    @property
    def writing(self) -> bool:
        """Whether an item is open."""
        return self._open is not None

    def close(self, status: str) -> list[dict]:
        """The events that end the reply (the open item done, with `status`)."""
        return self._close(status)

    def _into(self, kind: str) -> list[dict]:
        """Events that make the open item one of `kind` (the other closed, this opened)."""
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._close()
        if kind == "reasoning":
            out += self._opened(reasoning_item(new_id("rs"), None))
            part = {"type": "reasoning_text", "text": ""}
        else:
            out += self._opened(message_item(new_id("msg"), None, "in_progress"))
            part = _text_part("")
            out.append(self._part("response.content_part.added", part))
        self._open["content"].append(part)
        return out

    def _opened(self, item: dict) -> list[dict]:
        self._open = item
        added = self.event(
            "response.output_item.added", output_index=len(self.items), item=_copy(item)
        )
        return [added]

    def _delta(self, kind: str, text: str, **extra) -> dict:
        return self._of(self._open, kind, content_index=0, delta=text, **extra)

    def _part(self, kind: str, part: dict) -> dict:
        return self._of(self._open, kind, content_index=0, part=dict(part))

    def _of(self, item: dict, kind: str, **fields) -> dict:
        """An event of `item`, the one being written (its index: the items closed)."""
        return self.event(kind, item_id=item["id"], output_index=len(self.items), **fields)

    def _close(self, status: str = "completed") -> list[dict]:
        item, out = self._open, []
        if item is None:
            return out
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self._of(item, "response.reasoning_text.done", content_index=0, text=text))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            done = "response.output_text.done"
            out.append(self._of(item, done, content_index=0, text=text, logprobs=[]))
            out.append(self._part("response.content_part.done", item["content"][0]))
            item["status"] = status
        else:
            done = "response.function_call_arguments.done"
            out.append(self._of(item, done, name=item["name"], arguments=item["arguments"]))
            item["status"] = status
        index = len(self.items)
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        self.items.append(item)
        self._open = None
        return out


def _copy(item: dict) -> dict:
    """An item as it stands (later deltas change the open one)."""
    return {k: ([dict(p) for p in v] if k == "content" else v) for k, v in item.items()}
