"""OpenAI's Responses API (`run.serve.responses`) through the `openai` client and the
Agents SDK's default model, over serve's app in this process: the tiny fixture with
random weights on 1x1, one decode row, the reasoning and tool-call parsers on, and a
chat template without the tools block (the byte-level tokenizer spells Qwen3's in 500
tokens), so a random model's calls are forced by their grammar; with thinking on it
opens `<think>` for the model.

- a request's input items (messages, text parts, an earlier turn's calls and their
  outputs) render as the chat messages they stand for: the usage's input tokens are
  those messages' tokens;
- a stream's events come in the API's order with consecutive sequence numbers, and add
  up to the response that comes whole;
- a stored response is fetched, continued with previous_response_id and deleted;
- `responses.parse` with a Pydantic model, a forced call, the Agents SDK (a plain run,
  an output_type, a required tool across two turns), LangChain's responses mode;
- each field or value not served is a 400 naming it.
"""

import asyncio
import json

import agents
import httpx
import openai
import pytest
from openai.types.shared import Reasoning
from pydantic import BaseModel, Field
from reference import TINY
from served import app_over, langchain_chat
from starlette.testclient import TestClient

from qwen3_spmd import LLM

MAX_SEQ = 256  # a call, its result and a second turn; as test_structured.py, so they share programs
SHORT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
QUIET = {"effort": "minimal"}  # thinking off: the answer, or its format, from the first token


class Verdict(BaseModel):
    ok: bool
    level: int = Field(ge=0, le=9)


LIGHT = {
    "type": "function",
    "name": "set_light",
    "parameters": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}},
        "required": ["on"],
    },
}


@pytest.fixture(scope="module")
def app():
    with LLM(str(TINY), mesh="1x1", max_seq_len=MAX_SEQ, max_batch=1, chunk=4) as llm:
        llm.start()
        yield app_over(
            llm, MAX_SEQ, SHORT_TEMPLATE, reasoning_parser="qwen3", tool_call_parser="hermes"
        )


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app) as http:
        yield http


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


def _tokens(http, messages: list[dict], thinking: bool) -> int:
    """The prompt tokens of chat `messages` (/tokenize)."""
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}}
    return http.post("/tokenize", json=body).json()["count"]


def test_input_items_render_as_the_chat_they_stand_for(client, http):
    """instructions, a developer message, text parts, an earlier assistant turn with a
    call and its output: the input tokens are those of the chat messages they stand
    for; the budget ends the answer (incomplete, max_output_tokens)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "go"}
    items = [
        {"role": "developer", "content": "Brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "On"}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok.", "annotations": []}], "id": "msg_1", "status": "completed"},
        {**call, "arguments": '{"on":true}', "id": "fc_1", "status": "completed"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
    ]  # fmt: skip
    out = client.responses.create(
        model="tiny",
        instructions="Lamp.",
        input=items,
        reasoning=QUIET,
        max_output_tokens=5,
        temperature=0,
    )
    chat = [
        {"role": "system", "content": "Lamp."},
        {"role": "system", "content": "Brief."},
        {"role": "user", "content": "On?"},
        {
            "role": "assistant",
            "content": "Ok.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "go", "arguments": '{"on":true}'},
                }
            ],
        },
        {"role": "tool", "content": "done", "tool_call_id": "call_1"},
    ]
    assert out.usage.input_tokens == _tokens(http, chat, thinking=False)
    assert out.usage.output_tokens == 5 and out.usage.total_tokens == out.usage.input_tokens + 5
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (message,) = out.output
    assert message.type == "message" and message.content[0].text == out.output_text


def test_a_stream_is_the_apis_events_in_order_and_adds_up_to_the_whole(client):
    """The same greedy request streamed and whole: created, in_progress, the message
    item's added / part added / deltas / text done / part done / item done, then
    incomplete (the budget); sequence numbers count from 0; the deltas, the done
    text and the final response's text are the whole response's."""
    ask = dict(model="tiny", input="Hi", reasoning=QUIET, max_output_tokens=6, temperature=0)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(stream=True, **ask))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens == 6


def test_thinking_comes_back_as_a_reasoning_item_and_counts(client):
    """reasoning.effort low turns Qwen3's thinking on: a random model never closes it,
    so the whole budget is a reasoning item's text, and every output token a reasoning
    token; streamed, its text comes as reasoning_text deltas."""
    ask = dict(
        model="tiny", input="Hi", reasoning={"effort": "low"}, max_output_tokens=4, temperature=0
    )
    out = client.responses.create(**ask)
    (item,) = out.output
    assert item.type == "reasoning" and item.content[0].text and out.output_text == ""
    assert out.usage.output_tokens_details.reasoning_tokens == out.usage.output_tokens == 4
    events = list(client.responses.create(stream=True, **ask))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == item.content[0].text == events[-1].response.output[0].content[0].text


def test_a_stored_response_is_fetched_continued_and_deleted(client, http):
    """store (the default): GET returns the response; previous_response_id puts its
    input and output before the new input (the input tokens say so, without the first
    request's instructions); DELETE removes it, and then both are a 404."""
    first = client.responses.create(
        model="tiny",
        instructions="Say yes.",
        input="Lights?",
        reasoning=QUIET,
        max_output_tokens=3,
        temperature=0,
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input="And now?",
        reasoning=QUIET,
        max_output_tokens=2,
    )
    chat = [
        {"role": "user", "content": "Lights?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And now?"},
    ]
    assert second.usage.input_tokens == _tokens(http, chat, thinking=False)
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": first.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_parse_returns_the_pydantic_object(client):
    out = client.responses.parse(
        model="tiny", input="Verdict?", text_format=Verdict, reasoning=QUIET, max_output_tokens=40
    )
    assert out.status == "completed"
    assert isinstance(out.output_parsed, Verdict)
    assert out.output_text == out.output_parsed.model_dump_json()


def test_a_forced_call_comes_back_as_a_function_call_item_streamed_too(client):
    """tool_choice required: the output is one function_call item whose arguments
    validate; streamed, its name comes with the item and the arguments as deltas."""
    ask = dict(
        model="tiny",
        input="Lights?",
        tools=[LIGHT],
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning=QUIET,
        max_output_tokens=90,
        temperature=0,
    )
    out = client.responses.create(**ask)
    (call,) = out.output
    assert out.status == "completed" and call.type == "function_call"
    assert call.name == "set_light" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["on"], bool)
    events = list(client.responses.create(stream=True, **ask))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.type, added.item.name) == ("function_call", "set_light")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments and events[-1].type == "response.completed"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
        ({"input": [{"type": "computer_call"}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"temprature": 0.5}, "temprature"),
    ],
)  # fmt: skip
def test_a_field_or_value_not_served_is_a_400_naming_it(http, extra, param):
    r = http.post("/v1/responses", json={"model": "tiny", "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_agents_sdks_default_model_runs_against_serve(app):
    """The OpenAI Agents SDK's Responses model, unchanged, against the app: a plain run,
    an output_type (a Pydantic object), and a tool the first turn must call, whose call
    and result the second turn's input carries back. The SDK takes a response cut by
    its budget as an error, and random weights never end free text, so the plain run's
    answer is held to a choice (a text.format through the SDK's extra_args); on the
    second turn (tool_choice auto) calling again or answering is the weights' choice."""
    agents.set_tracing_disabled(True)
    sent = []

    async def note(request):  # the bodies the SDK sends
        sent.append(json.loads(request.content))

    base = openai.AsyncOpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://testserver",
            event_hooks={"request": [note]},
        ),
        max_retries=0,
    )
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=base)
    greedy = agents.ModelSettings(reasoning=Reasoning(effort="minimal"), temperature=0)
    choice = {"type": "json_schema", "name": "yes_no", "schema": {"enum": ["yes", "no"]}}
    called = []

    @agents.function_tool
    def set_light(on: bool) -> str:
        """Switch the light."""
        called.append(on)
        return "done"

    plain = agents.Agent(
        name="plain",
        instructions="Say yes or no.",
        model=model,
        model_settings=greedy.resolve(
            agents.ModelSettings(extra_args={"text": {"format": choice}})
        ),
    )
    typed = agents.Agent(name="typed", model=model, output_type=Verdict, model_settings=greedy)
    tool = agents.Agent(
        name="tool",
        model=model,
        tools=[set_light],
        output_type=Verdict,
        # one call a turn (a random model would go on calling until its budget ends)
        model_settings=greedy.resolve(
            agents.ModelSettings(tool_choice="required", parallel_tool_calls=False)
        ),
    )

    async def runs():
        done = [await agents.Runner.run(a, "Lights?") for a in (plain, typed)]
        sent.clear()
        try:
            result = await agents.Runner.run(tool, "Lights?", max_turns=2)
            return done, result.raw_responses, result.final_output
        except agents.MaxTurnsExceeded as e:  # the second turn called again
            return done, e.run_data.raw_responses, None

    (plain_run, typed_run), responses, final = asyncio.run(runs())
    assert json.loads(plain_run.final_output) in ("yes", "no")
    assert isinstance(typed_run.final_output, Verdict)
    assert len(called) >= 1 and isinstance(called[0], bool)
    first, second = (r.output for r in responses)
    (call,) = first
    assert call.type == "function_call" and json.loads(call.arguments) == {"on": called[0]}
    carried = [(i.get("type"), i.get("call_id")) for i in sent[1]["input"]]
    assert carried[1:] == [("function_call", call.call_id), ("function_call_output", call.call_id)]
    assert sent[1].get("tool_choice") is None  # the SDK's reset: auto on the second turn
    assert final is None or isinstance(final, Verdict)
    assert all(item.type in ("message", "function_call") for item in second)


def test_langchain_in_responses_mode(http):
    """LangChain's ChatOpenAI(use_responses_api=True), unchanged: a plain invoke and a
    json_schema structured output."""
    chat = langchain_chat(
        http, use_responses_api=True, reasoning={"effort": "minimal"}, max_tokens=40
    )
    reply = chat.invoke("Hi")
    assert isinstance(reply.text, str) and reply.usage_metadata["output_tokens"] > 0
    assert isinstance(chat.with_structured_output(Verdict).invoke("Verdict?"), Verdict)


def test_a_generate_server_refuses_pooling_requests_naming_the_model(http):
    """Embeddings, scores and reranking need the pooling runner: a 400 that says so."""
    for path, body in (
        ("/v1/embeddings", {"input": "a"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "generates text" in r.json()["error"]["message"]
