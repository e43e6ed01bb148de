"""serve's reasoning and tool-call parsers (`--reasoning-parser qwen3`, `--tool-call-parser
hermes`) against their rules written out for a whole reply (`_expected`):

- on text cut at every pair of positions, and on the real Qwen3 tokenizer's token
  streams (`<think>` and `<tool_call>` as the single added tokens, spelled by ordinary
  tokens cut at every character, and one token per UTF-8 byte);
- through the HTTP app, read by the `openai` client: a scripted scheduler answers with
  chosen token ids (a random model will not call a tool), the Service and the routes
  run as they do;
- tools and tool results rendered by the app as transformers' `apply_chat_template`
  renders them, on a Qwen3-style template written here (the checkpoint's own runs in
  production) and on the Qwen3 template the package ships.
"""

import functools
import itertools
import json
import re

import openai
import pytest
from starlette.testclient import TestClient

from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.pipeline.batch.handles import Handle, Request
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.requests import check_request
from qwen3_spmd.run import qwen_tokenizer
from qwen3_spmd.run.models import with_qwen_vocab
from qwen3_spmd.run.serve.app import ServerState, make_app
from qwen3_spmd.run.serve.detok import Detokenizer
from qwen3_spmd.run.serve.message import ChatReply, fold
from qwen3_spmd.run.serve.reasoning import Qwen3Reasoning
from qwen3_spmd.run.serve.service import Service, Settings
from qwen3_spmd.run.serve.tools import HermesToolCalls
from qwen3_spmd.run.text import Text

THINK, TOOL_CALL, IM_END = 151667, 151657, 151645

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "when": "明日", "unit": "°C"}}'
REPLIES = [
    # thinking, an answer, two calls (the second with empty arguments)
    "<think>\nLet me 想想 — the weather.\n</think>\n\nI'll check.\n<tool_call>\n"
    + WEATHER
    + '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    # cut off in the thinking, a partial end tag last
    "<think>\nHmm, 日本語 is </thi",
    # no thinking; tags mentioned in the text; an unclosed call that is no JSON
    "Plain answer: <think> and </think> and a <tool_call> mention.",
    # a malformed call (arguments not an object) stays text, with the text around it
    '<think>\n\n</think>\n\nSee:\n<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call> ok',
    # thinking only; then the start of the tag only
    "<think>x</think>",
    "<thi",
    # a call left unclosed at the end whose JSON is whole: a call
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"</tool_call\\"}"}',
]


def _call(body: str):
    """(name, arguments) of a call's text, or None: the rules in words (a JSON object
    with a non-empty string name and arguments an object or a string holding one)."""
    try:
        call = json.loads(body)
        args = call.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
    except (ValueError, AttributeError):
        return None
    if not isinstance(call.get("name"), str) or not call["name"] or not isinstance(args, dict):
        return None
    return call["name"], json.dumps(args, ensure_ascii=False)


def _expected(text: str, state: str = "start") -> dict:
    """The message a whole reply gives, from the rules written out: the text between
    `<think>` (first) and `</think>` is reasoning, newlines next to the tags dropped;
    each `<tool_call>...</tool_call>` (or unclosed at the end) whose JSON holds a call
    is one, whitespace next to it dropped; the rest is content."""
    reasoning = None
    if state == "start" and text.startswith("<think>"):
        state, text = "thinking", text[len("<think>") :]
    if state == "thinking":
        thought, end, text = text.partition("</think>")
        reasoning = thought.strip("\n") if end else thought.lstrip("\n")
        text = text.lstrip("\n")
    content, calls, pos, after_call = "", [], 0, False
    for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.S):
        between = text[pos : m.start()]
        between = between.lstrip() if after_call else between
        call = _call(m.group(1))
        after_call = call is not None
        content += between.rstrip() if after_call else between + m.group(0)
        calls += [call] if call else []
        pos = m.end()
    content += text[pos:].lstrip() if after_call else text[pos:]
    message = {"role": "assistant", "content": content or (None if reasoning or calls else "")}
    message["reasoning_content"] = reasoning or None
    if calls:
        ids = (f"call_{i}" for i in itertools.count())
        message["tool_calls"] = [
            {"id": next(ids), "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in calls
        ]
    return message


def _reply(state: str = "start") -> ChatReply:
    ids = (f"call_{i}" for i in itertools.count())
    return ChatReply(Qwen3Reasoning(state), HermesToolCalls(lambda: next(ids)))


def _parsed(deltas_of_text, state: str = "start") -> dict:
    reply = _reply(state)
    deltas = [d for piece in deltas_of_text for d in reply.add(piece)] + reply.end()
    return fold(deltas, reasoning=True)


# ---- the parsers on text and on token streams --------------------------------------------


@pytest.mark.parametrize("text", REPLIES)
@pytest.mark.parametrize("state", ["start", "thinking", "answer"])
def test_text_cut_at_every_position(text, state):
    """Deltas cut anywhere (a tag split any way): the message they give is the whole
    reply's, and the whole reply's is the rules'. Three deltas cut at every i <= j
    from the start state (the others: two deltas, and one character each)."""
    expected = _expected(text, state)
    assert _parsed([text], state) == expected
    assert _parsed(list(text), state) == expected
    for i in range(len(text) + 1):
        cuts = range(i, len(text) + 1) if state == "start" else [i]
        for j in cuts:
            assert _parsed([text[:i], text[i:j], text[j:]], state) == expected, (i, j)


@pytest.fixture(scope="module")
def qwen():
    return Text.qwen()


def _token_streams(qwen, text):
    """Token ids that decode to `text`: the tokenizer's own (the tags as single added
    tokens), the text encoded in two parts cut at every character (a tag spelled by
    several ordinary tokens), and one token per UTF-8 byte (every character split)."""
    yield qwen.encode(text)
    for i in range(1, len(text)):
        yield qwen.encode(text[:i]) + qwen.encode(text[i:])
    byte_token = {
        b: qwen.tokenizer.token_to_id(ch) for ch, b in qwen_tokenizer.bytes_of_symbols().items()
    }
    yield [byte_token[b] for b in text.encode()]


@pytest.mark.parametrize("text", REPLIES[:4])
def test_token_streams_as_the_server_decodes_them(qwen, text):
    """Token by token through the server's detokenizer (whole characters only), then the
    parsers: every stream gives the whole reply's message."""
    if "<think>" in text:
        assert THINK in qwen.encode(text)
    if "<tool_call>" in text:
        assert TOOL_CALL in qwen.encode(text)
    expected = _expected(text)
    for ids in _token_streams(qwen, text):
        detok = Detokenizer(lambda x: qwen.decode(x, skip_special=True))
        pieces = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(pieces) == text
        assert _parsed(pieces) == expected, ids


def test_prompt_decides_where_the_reply_starts():
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert Qwen3Reasoning.for_prompt(chat).state == "start"
    assert Qwen3Reasoning.for_prompt(chat + "<think>\n").state == "thinking"
    # enable_thinking false: the template closed an empty thinking block
    assert Qwen3Reasoning.for_prompt(chat + "<think>\n\n</think>\n\n").state == "answer"
    # an earlier turn's thinking does not count
    earlier = "<|im_start|>assistant\n<think>\na\n</think>\n\nb<|im_end|>\n"
    assert Qwen3Reasoning.for_prompt(earlier + chat).state == "start"


# ---- through the HTTP app, read by the openai client ---------------------------------------


class Scripted:
    """A scheduler that answers every request with `reply` (token ids, then <|im_end|>)
    at once, within max_tokens, and keeps the prompts it was given: the Service and the
    routes run as they do, with no model."""

    def __init__(self):
        self.reply: list[int] = []
        self.prompts: list[list[int]] = []
        self.params = []
        self._ids = itertools.count()

    def compile_constraint(self, constraint):
        pass  # the reply is scripted: any constraint is taken

    def submit(self, prompt, params):
        self.prompts.append(list(prompt))
        self.params.append(params)
        handle = Handle(Request(next(self._ids), tuple(prompt), params), drive=lambda: False)
        tokens = []
        for t in self.reply + [IM_END]:
            tokens.append(t)
            if params.finish_reason(tokens):
                break
        handle._deliver(tokens, params.finish_reason(tokens))
        return handle

    def submit_all(self, requests):
        return [self.submit(prompt, params) for prompt, params, _ in requests]

    def cancel(self, handle):
        pass


def _client(qwen, scheduler, text=None, reasoning="qwen3", tools="hermes") -> openai.OpenAI:
    settings = Settings(
        "qwen3",
        4096,
        qwen_tokenizer.QWEN_VOCAB,
        qwen_tokenizer.EOS_IDS,
        Sampling(),
        check=functools.partial(check_request, with_qwen_vocab(PRESETS["tiny"]), 1, 4096),
    )
    service = Service(scheduler, lambda ids: qwen.decode(ids, skip_special=True), settings)
    state = ServerState(
        "qwen3",
        service=service,
        text=text or qwen,
        status="ready",
        reasoning_parser=reasoning,
        tool_call_parser=tools,
    )
    http = TestClient(make_app(state))
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "when": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": "Weather in Zürich tomorrow?"}]


def _streamed(client, **kw) -> tuple[dict, str, list]:
    """(the message a stream adds up to, its finish reason, its tool-call deltas)."""
    content, reasoning, calls, deltas, reason = "", "", [], [], None
    for chunk in client.chat.completions.create(model="qwen3", stream=True, **kw):
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        content += choice.delta.content or ""
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for call in choice.delta.tool_calls or []:
            deltas.append(call)
            if call.id:
                calls.append({"id": call.id, "type": call.type, "function": {"arguments": ""}})
                calls[call.index]["function"]["name"] = call.function.name
            calls[call.index]["function"]["arguments"] += call.function.arguments
    message = {"role": "assistant", "content": content or (None if reasoning or calls else "")}
    message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = calls
    return message, reason, deltas


def _without_ids(message: dict) -> dict:
    calls = [{**c, "id": "-"} for c in message.get("tool_calls") or []]
    return {**message, **({"tool_calls": calls} if calls else {})}


def test_openai_client_reads_tool_calls_and_reasoning(qwen):
    scheduler = Scripted()
    client = _client(qwen, scheduler)
    scheduler.reply = qwen.encode(REPLIES[0])
    out = client.chat.completions.create(model="qwen3", messages=ASK, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.model_extra["reasoning_content"] == "Let me 想想 — the weather."
    assert message.content == "I'll check."
    weather, now = message.tool_calls
    assert weather.type == "function" and weather.id.startswith("call_") and weather.id != now.id
    assert weather.function.name == "get_weather"
    assert json.loads(weather.function.arguments) == json.loads(WEATHER)["arguments"]
    assert (now.function.name, now.function.arguments) == ("now", "{}")

    streamed, reason, deltas = _streamed(client, messages=ASK, tools=TOOLS)
    assert reason == "tool_calls"
    # as OpenAI streams a call: its id, type and name first, then the arguments
    first = deltas[0]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert deltas[1].id is None and deltas[1].function.name is None
    assert _without_ids(streamed) == _without_ids(_expected(REPLIES[0]))


@pytest.mark.parametrize("text", REPLIES)
def test_streamed_message_is_the_whole_message(qwen, text):
    scheduler = Scripted()
    client = _client(qwen, scheduler)
    scheduler.reply = qwen.encode(text)
    whole = client.chat.completions.create(model="qwen3", messages=ASK, tools=TOOLS)
    streamed, reason, _ = _streamed(client, messages=ASK, tools=TOOLS)
    assert reason == whole.choices[0].finish_reason
    message = whole.choices[0].message.model_dump(exclude_none=True)
    message.setdefault("content", None)  # null content is left out by exclude_none
    message.setdefault("reasoning_content", None)
    assert _without_ids(streamed) == _without_ids(message) == _without_ids(_expected(text))


def test_thinking_off_cut_off_malformed_and_tool_choice_none(qwen):
    scheduler = Scripted()
    client = _client(qwen, scheduler)
    create = client.chat.completions.create

    # enable_thinking false: the template closes the thinking, the reply is all content
    scheduler.reply = qwen.encode(REPLIES[0])
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = create(model="qwen3", messages=ASK, extra_body=off).choices[0]
    assert qwen.decode(scheduler.prompts[-1]).endswith("<think>\n\n</think>\n\n")
    assert out.message.content == REPLIES[0] and out.finish_reason == "stop"
    assert out.message.model_extra["reasoning_content"] is None

    # cut off in the thinking: reasoning only
    scheduler.reply = qwen.encode("<think>\nFirst, 日本 then more and more")
    out = create(model="qwen3", messages=ASK, max_tokens=5).choices[0]
    assert out.finish_reason == "length" and out.message.content is None
    thought = qwen.decode(scheduler.reply[:5]).removeprefix("<think>\n")
    assert out.message.model_extra["reasoning_content"] == thought and "First" in thought

    # a malformed call: text, a 200, finish_reason stop
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    scheduler.reply = qwen.encode(bad)
    out = create(model="qwen3", messages=ASK, tools=TOOLS).choices[0]
    assert out.message.content == bad and out.message.tool_calls is None
    assert out.finish_reason == "stop"

    # tool_choice none: the tools reach the template, the calls stay text
    scheduler.reply = qwen.encode(REPLIES[0].split("</think>\n\n")[1])
    out = create(model="qwen3", messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
    assert "<tools>" in qwen.decode(scheduler.prompts[-1])
    assert out.message.tool_calls is None and out.message.content.startswith("I'll check.\n<")


def test_tools_the_server_cannot_serve_are_400(qwen):
    scheduler = Scripted()
    create = _client(qwen, scheduler).chat.completions.create
    named = {"type": "function", "function": {"name": "book_flight"}}
    for kw, param in [
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": named}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools.0.function.name",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            create(model="qwen3", messages=ASK, **{"tools": TOOLS, **kw})
        assert e.value.body["param"] == param, e.value.body
    without = _client(qwen, scheduler, tools=None).chat.completions.create
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser hermes"):
        without(model="qwen3", messages=ASK, tools=TOOLS)
    named = {"type": "function", "function": {"name": "now"}}
    create(model="qwen3", messages=ASK, tools=TOOLS, tool_choice=named)  # served
    create(model="qwen3", messages=ASK, tools=TOOLS, tool_choice="required")  # served
    assert len(scheduler.prompts) == 2  # the refused ones never reached the scheduler
    assert all(p.constraint.kind == "grammar" for p in scheduler.params)


def test_with_thinking_on_the_constraint_starts_after_the_thinking(qwen):
    """The reasoning parser and thinking on: the answer's constraint starts at Qwen3's
    `</think>` token (the thinking is free), its content is the answer; with
    enable_thinking false it holds from the first token."""
    scheduler = Scripted()
    create = _client(qwen, scheduler).chat.completions.create
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    scheduler.reply = qwen.encode('<think>\nHmm.\n</think>\n\n{"ok":true}')
    out = create(model="qwen3", messages=ASK, response_format=fmt).choices[0]
    assert scheduler.params[-1].constraint.after == qwen.tokenizer.token_to_id("</think>")
    assert json.loads(out.message.content) == {"ok": True}
    assert out.message.model_extra["reasoning_content"] == "Hmm."
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    create(model="qwen3", messages=ASK, response_format=fmt, extra_body=off)
    assert scheduler.params[-1].constraint.after is None
    closed = {**schema, "additionalProperties": False}  # objects closed by default
    assert json.loads(scheduler.params[-1].constraint.spec) == closed


# ---- tools and tool results through the template ----------------------------------------

# Qwen3's format, written small: the tools in a <tools> block of the system turn, calls
# as <tool_call> JSON, results as <tool_response> in a user turn.
TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>' }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{%- if call.function.arguments is string %}{{- call.function.arguments }}
{%- else %}{{- call.function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.mark.parametrize("template", ["written here", "shipped"])
def test_tools_and_results_render_as_transformers_renders_them(qwen, template):
    """A conversation of a call and its results, sent back as the openai client sends
    it (the assistant turn with null content, arguments as a JSON string): the prompt
    the scheduler gets is transformers' apply_chat_template of it, token for token."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    config = qwen_tokenizer.tokenizer_config()
    source = TEMPLATE if template == "written here" else config["chat_template"]
    text = Text.qwen()
    text.config = {**config, "chat_template": source}
    scheduler = Scripted()
    scheduler.reply = qwen.encode("It is 18 °C.")
    client = _client(qwen, scheduler, text=text)
    arguments = json.dumps({"city": "Zürich", "when": "明日"}, ensure_ascii=False)
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    messages = [
        {"role": "system", "content": "You are terse."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18, "unit": "°C"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    out = client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS)
    assert out.choices[0].message.content == "It is 18 °C."

    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(qwen_tokenizer.tokenizer_json()),
        chat_template=source,
    )
    # the template's side of OpenAI's null content: the empty text
    sent = [{**m, "content": m["content"] or ""} for m in messages]
    rendered = hf.apply_chat_template(sent, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    for piece in ("<tools>", '"name": "get_weather"', "<tool_call>", arguments, "<tool_response>"):
        assert piece in rendered
    assert scheduler.prompts[-1] == qwen.encode(rendered)
    assert out.usage.prompt_tokens == len(scheduler.prompts[-1])


def test_a_forced_call_names_qwen3s_tags_as_their_tokens(qwen):
    """tool_choice required through the app, its grammar on Qwen3's tokenizer: the first
    token allowed is the added `<tool_call>` alone (llguidance never spells an added
    token with text), and Qwen3's call, compact, is taken whole and ends the grammar."""
    import numpy as np

    from qwen3_spmd.pipeline.structured.constraints import Grammars

    scheduler = Scripted()
    create = _client(qwen, scheduler).chat.completions.create
    create(
        model="qwen3", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    grammars = Grammars.of_text(qwen, qwen_tokenizer.QWEN_VOCAB, qwen_tokenizer.EOS_IDS)
    row = grammars.matcher(scheduler.params[-1].constraint)
    assert row.after is None or row.waiting  # thinking on: it starts after </think>
    row.waiting = False
    masks = grammars.masks(1)
    row.fill(masks, 0)
    bits = np.unpackbits(masks.view(np.uint8), bitorder="little")
    assert bits.nonzero()[0].tolist() == [TOOL_CALL]
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Zürich"}}\n</tool_call>'
    done = [row.take(t) for t in qwen.encode(call)]
    assert done[-1] and not any(done[:-1])
