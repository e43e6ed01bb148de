"""Structured outputs (`pipeline.structured.constraints`, `run.serve.structured`): with random
weights (the tiny fixture, 1x1), every constrained answer parses and follows its
constraint.

- the mask as the programs apply it is llguidance's, on a whole vocabulary and on each
  block of one split over `tensor`;
- bounded JSON Schemas (drawn by hypothesis: enums, booleans, consts, bounded integers,
  arrays with maxItems, nested objects with required keys and no others) end with
  "stop" and validate; regexes and choices match; an unbounded answer cut by its budget
  is a prefix the grammar takes;
- speculative decoding under a constraint: drafts checked by the grammar without
  moving it, and verify passes that give the plain constrained answer;
- through the HTTP app: the `openai` client's `chat.completions.parse` with a Pydantic
  model, forced tool calls (`tool_choice` required and named) whose arguments validate,
  and a 400 naming the field for each kind of bad input.

One LLM (one engine, its scheduler's loop started) serves the module, over one decode
row, so that every request runs the same few programs (a prefill of one prompt, the
constrained decode chunk over one row): compiling is most of a test's time, the rounds
of a constrained row are milliseconds each. The app runs over its scheduler. The
meshes' agreement is in test_tensor.py, beside its engines.
"""

import dataclasses
import json
import re
from typing import Literal

import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from reference import TINY
from served import app_over, langchain_chat
from starlette.testclient import TestClient

from qwen3_spmd import LLM, SamplingParams, StructuredOutputsParams
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.programs.sampling import Sampling, only_allowed
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.speculative.draft_model import DraftModel
from qwen3_spmd.pipeline.speculative.policy import Unmeasured
from qwen3_spmd.pipeline.speculative.speculator import Speculator, make_speculator
from qwen3_spmd.pipeline.structured.constraints import Constraint, ConstraintError, RowMatcher

MAX_SEQ = 256  # as test_responses.py: the same programs, which the compile cache shares
# A chat template without the tools block (Qwen3's renders 500 tokens of tools in this
# byte-level tokenizer): a random model's call is forced by its grammar, not its prompt.
SHORT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
SETTINGS = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def llm():
    with LLM(str(TINY), mesh="1x1", max_seq_len=MAX_SEQ, max_batch=1, chunk=4) as llm:
        llm.start()  # the app's requests need the loop; generate waits on it
        yield llm


@pytest.fixture(scope="module")
def client(llm):
    app = app_over(
        llm, MAX_SEQ, SHORT_TEMPLATE, reasoning_parser="qwen3", tool_call_parser="hermes"
    )
    with TestClient(app) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )


# ---- the mask in the programs -------------------------------------------------------------


def _bits(masks: np.ndarray, V: int) -> np.ndarray:
    """[B, W] int32 -> [B, V] bool, bit i % 32 of word i // 32 (llguidance's layout)."""
    return np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)


def test_the_mask_is_llguidances_on_the_vocabulary_and_on_each_block():
    """Random bits (the sign bit included) over V = 70 (a last word half used): the
    masked logits are -inf exactly where the bit is clear, as llguidance's numpy
    reference applies them; a device's block [first, first + 30) of a split vocabulary
    reads its own bits; a row of all ones is unchanged. (Greedy and sampled choices
    within the mask: every answer below.)"""
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    B, V = 4, 70
    masks = rng.integers(-(2**31), 2**31, (B, 3), dtype=np.int64).astype(np.int32)
    masks[3] = -1
    logits = rng.normal(size=(B, V)).astype(np.float32)
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, masks)
    got = np.asarray(only_allowed(jnp.asarray(logits), jnp.asarray(masks)))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[3], logits[3])
    for first in (0, 30, 60):  # blocks that start inside a word
        cols = logits[:, first : first + 30]
        block = np.asarray(only_allowed(jnp.asarray(cols), masks, first))
        bits = _bits(masks, 96)[:, first : first + cols.shape[1]]
        np.testing.assert_array_equal(block, np.where(bits, cols, -np.inf))


# ---- constraints refused, in words ----------------------------------------------------------


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint.json_schema({"type": "thing"}), "Invalid type"),
        (Constraint.json_schema({"not": {"type": "string"}}), "not"),
        (Constraint.json_schema({"properties": {"a": {"$ref": "#/nope"}}}), "nope"),
        (Constraint.json_schema({"type": "string", "format": "colour"}), "colour"),
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("grammar", "start: missing"), "missing"),
        (Constraint("grammar", 'root ::= "a" | b'), "not found"),
        (Constraint.choice([]), "at least one"),
    ],
)
def test_a_constraint_the_engine_does_not_take_is_refused_naming_why(llm, constraint, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        llm.scheduler.compile_constraint(constraint)


def test_structured_outputs_params_take_exactly_one():
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(RequestError, match="json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")


def test_a_row_waits_for_the_token_that_starts_its_constraint(llm):
    """Qwen3's thinking: every token allowed until `</think>` (304 here), then the
    grammar's; the end comes where the grammar admits nothing more."""
    grammars = llm.scheduler.grammars
    target = "~|"
    row = grammars.matcher(Constraint.choice([target], after=304))
    masks = grammars.masks(1)
    for token in (5, 17, 304):
        row.fill(masks, 0)
        assert (masks == -1).all() and not row.take(token)
    row.fill(masks, 0)
    prefixes = {t for t in range(300) if target.startswith(llm.text.decode([t]))}
    assert set(_bits(masks, 331)[0].nonzero()[0].tolist()) == prefixes
    first, second = llm.text.encode("~")[0], llm.text.encode("|")[0]
    assert not row.take(first) and row.take(second)
    assert isinstance(row, RowMatcher)


# ---- answers with random weights --------------------------------------------------------------

WORDS = st.sampled_from(["a", "b", "xy", "ü", "no"])
LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(WORDS, min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
    st.sampled_from([{"const": 3}, {"const": "k"}, {"enum": [1, "one", True]}]),
    st.integers(-12, 12).flatmap(
        lambda lo: st.integers(lo, lo + 30).map(
            lambda hi: {"type": "integer", "minimum": lo, "maximum": hi}
        )
    ),
)


def _object(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }


BOUNDED = st.recursive(
    LEAF,
    lambda inner: (
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=2).map(
            _object
        )
        | inner.map(lambda items: {"type": "array", "items": items, "maxItems": 2})
    ),
    max_leaves=4,
).map(lambda s: s if s.get("type") == "object" else _object({"v": s}))
PROMPT = [5, 17, 42, 99, 3]


@SETTINGS
@given(st.lists(BOUNDED, min_size=4, max_size=4))
def test_bounded_schemas_end_with_stop_and_validate(llm, schemas):
    """Four schemas a batch, greedy and sampled rows together: each answer is compact
    JSON that validates, ended by its grammar ("stop") well within the budget."""
    params = [
        SamplingParams(
            max_tokens=100,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            structured_outputs=StructuredOutputsParams(json=s),
        )
        for i, s in enumerate(schemas)
    ]
    for out, schema in zip(llm.generate([PROMPT] * 4, params), schemas):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert not any(c.isspace() for c in out.text), out.text


PIECE = st.sampled_from(["[a-c]{1,3}", "(x|yz)", "[0-9]{2}", "ab?", "-", "(no|yes)!?"])


@SETTINGS
@given(
    st.lists(PIECE, min_size=1, max_size=3).map("".join),
    st.lists(st.text("abc xyü", min_size=1, max_size=4), min_size=1, max_size=4, unique=True),
)
def test_regex_and_choice_answers_match(llm, regex, choices):
    params = [
        SamplingParams(
            max_tokens=30,
            temperature=t,
            seed=1,
            structured_outputs=StructuredOutputsParams(**kw),
        )
        for kw in ({"regex": regex}, {"choice": choices})
        for t in (0.0, 1.0)
    ]
    outs = llm.generate([PROMPT] * 4, params)
    for out in outs[:2]:
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", (regex, out.text)
    for out in outs[2:]:
        assert out.text in choices and out.finish_reason == "stop", (choices, out.text)


def test_an_unbounded_answer_cut_by_its_budget_is_a_prefix_the_grammar_takes(llm):
    schema = _object({"s": {"type": "string"}})
    params = SamplingParams(
        max_tokens=10, temperature=1.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    out = llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert out.text.startswith('{"s":"')
    matcher = llm.scheduler.grammars.matcher(Constraint.json_schema(schema)).matcher
    assert matcher.try_consume_tokens(out.token_ids) == 10 and not matcher.is_error()


# ---- speculative decoding under a constraint ------------------------------------------------


def test_a_draft_is_checked_by_the_grammar_without_moving_it(llm):
    """`RowMatcher.along`: the drafts up to the first the grammar refuses, each
    position's mask the one plain decoding would fill there, the thinking before
    `</think>` (304) free; the row's state afterwards is the state before."""
    grammars = llm.scheduler.grammars
    constraint = Constraint("regex", "ab(c|d)e", after=304)
    row = grammars.matcher(constraint)
    a, b, c, e, z = (llm.text.encode(x)[0] for x in "abcez")
    before = grammars.masks(1)
    row.fill(before, 0)
    for drafts, n in (([7, 304, a, b, z, e], 4), ([304, a, b, c, e, a], 5), ([a], 1)):
        masks = grammars.masks(len(drafts) + 1)
        assert row.along(drafts, masks) == n
        step = grammars.matcher(constraint)
        want = grammars.masks(n + 1)
        for i in range(n):
            step.fill(want, i)
            done = step.take(drafts[i])
        if done:  # the answer ends at its last draft: the pass's next choice is moot
            want[n] = -1
        else:
            step.fill(want, n)
        np.testing.assert_array_equal(masks[: n + 1], want)
        after = grammars.masks(1)
        row.fill(after, 0)
        np.testing.assert_array_equal(after, before)


@dataclasses.dataclass
class Drafter:
    """Drafts the plain run's tokens, with a token no answer here holds at (index) % 4
    == 2 (the grammar cuts the drafts there) and the next id at (index) % 5 == 3 (the
    grammar may take it; the model then decides); counts what it proposed."""

    run: list
    num_speculative_tokens: int = 3
    proposed: int = 0

    def propose(self, context, k):
        done = len(context) - len(PROMPT)
        out = []
        for i, t in enumerate(self.run[done : done + k], done):
            out.append(ILLEGAL if i % 4 == 2 else t + 1 if i % 5 == 3 else t)
        self.proposed += len(out)
        return out


ILLEGAL = 64  # "a": outside every answer of the schema below
# The answers speculated on below: short, ended by the grammar, greedy and seeded.
DRAFTED = _object(
    {
        "n": {"type": "integer", "minimum": 0, "maximum": 99999},
        "w": {"enum": ["xy", "no", "b"]},
        "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    }
)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_speculation_under_a_constraint_gives_the_plain_answer(llm, sampling):
    """A constrained row's verify passes: each position masked by the grammar after the
    drafts before it, the kept tokens taken by the grammar, the end where the answer is
    done. The tokens and the end are the plain constrained run's, greedy and seeded
    sampling; the grammar cut some drafts, the model kept others."""
    schema = DRAFTED
    params = Params(60, sampling, seed=5, constraint=Constraint.json_schema(schema))
    plain = llm.scheduler.submit(PROMPT, params)
    list(plain)
    assert plain.finish_reason == "stop"
    jsonschema.validate(json.loads(llm.text.decode(plain.tokens)), schema)
    drafter = Drafter(plain.tokens)
    llm.scheduler.speculator = Speculator(llm.engine, drafter)
    try:
        handle = llm.scheduler.submit(PROMPT, params)
        list(handle)
        m = llm.scheduler.speculator.metrics
    finally:
        llm.scheduler.speculator = None
    assert (handle.tokens, handle.finish_reason) == (plain.tokens, "stop")
    assert 0 < m.accepted_tokens and m.draft_tokens < drafter.proposed
    assert any(n.startswith("verify") and "constrained" in n for n in llm.engine.programs.compiled)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_a_draft_model_drafts_what_the_grammar_allows(llm, sampling):
    """A draft model's row under a constraint draws each draft among the tokens its
    grammar allows after the drafts before it. The model drafting for itself then
    proposes the constrained run's own tokens: the grammar cuts none and the model keeps
    every one (unsteered, its drafts were its unconstrained choices, which the grammar
    cut). The tokens and the end are the plain constrained run's, greedy and seeded."""
    params = Params(60, sampling, seed=5, constraint=Constraint.json_schema(DRAFTED))
    plain = llm.scheduler.submit(PROMPT, params)
    list(plain)
    assert plain.finish_reason == "stop"
    itself = {"method": "draft_model", "model": "itself", "num_speculative_tokens": 3}
    spec = make_speculator(llm.engine, itself, llm.engine)
    spec.rule = Unmeasured()  # every round drafts
    drafter, proposed = spec.drafter, []

    def propose(ctx, wants, n):
        out = DraftModel.propose(drafter, ctx, wants, n)
        proposed.extend(len(d) for d in out.values())
        return out

    drafter.propose = propose
    llm.scheduler.speculator = spec
    try:
        handle = llm.scheduler.submit(PROMPT, params)
        list(handle)
        m = spec.metrics
    finally:
        llm.scheduler.speculator = None
    assert (handle.tokens, handle.finish_reason) == (plain.tokens, "stop")
    assert 0 < m.draft_tokens == sum(proposed) and m.accepted_tokens == m.draft_tokens


# ---- through the HTTP app -----------------------------------------------------------------------

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Lights?"}]


class Verdict(BaseModel):
    ok: bool
    mood: Literal["calm", "busy"]
    level: int = Field(ge=0, le=9)


def test_openai_parse_returns_the_pydantic_object(client):
    """`chat.completions.parse` sends a strict json_schema: the answer is the model's
    JSON, compact, ended by its grammar."""
    out = client.chat.completions.parse(
        model="tiny",
        messages=ASK,
        response_format=Verdict,
        max_tokens=90,
        temperature=0,
        extra_body=NO_THINKING,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    assert choice.message.content == choice.message.parsed.model_dump_json()


def test_a_streamed_answer_is_the_whole_answer(client):
    """Streaming under a constraint: the deltas add up to the greedy answer that comes
    whole, and it validates."""
    schema = Verdict.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema}}
    ask = dict(model="tiny", messages=ASK, max_tokens=90, temperature=0, extra_body=NO_THINKING)
    whole = client.chat.completions.create(response_format=fmt, **ask).choices[0]
    chunks = list(client.chat.completions.create(response_format=fmt, stream=True, **ask))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), schema)


LIGHT = {
    "type": "function",
    "function": {
        "name": "set_light",
        "parameters": _object({"on": {"type": "boolean"}}),
    },
}
DIM = {
    "type": "function",
    "function": {
        "name": "dim",
        "parameters": _object({"level": {"type": "integer", "minimum": 0, "maximum": 9}}),
    },
}


def _forced(client, tools: list, choice):
    """The greedy choice of a chat whose tool_choice forces one call."""
    return client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
        extra_body=NO_THINKING,
    ).choices[0]


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "set_light"}}],
    ids=["required", "named"],
)
def test_a_forced_call_comes_back_as_tool_calls_that_validate(client, choice):
    out = _forced(client, [LIGHT, DIM] if choice == "required" else [DIM, LIGHT], choice)
    assert out.finish_reason == "tool_calls"
    (call,) = out.message.tool_calls
    if choice != "required":
        assert call.function.name == "set_light"
    tool = LIGHT if call.function.name == "set_light" else DIM
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_forced_tool_with_an_open_pydantic_schema_gets_the_listed_keys_only(client):
    """LangChain's with_structured_output(method="function_calling") forces a tool whose
    parameters are Pydantic's schema, which says nothing of other keys: objects are
    closed by default (--structured-outputs-config), so the call ends, by its grammar,
    with the model's keys only."""
    schema = Verdict.model_json_schema()
    assert "additionalProperties" not in schema
    tool = {"type": "function", "function": {"name": "Verdict", "parameters": schema}}
    out = _forced(client, [tool], {"type": "function", "function": {"name": "Verdict"}})
    assert out.finish_reason == "tool_calls"
    arguments = json.loads(out.message.tool_calls[0].function.arguments)
    assert set(arguments) == set(Verdict.model_fields)
    Verdict.model_validate(arguments)


def test_langchains_function_calling_structured_output_returns_the_object(llm):
    """LangChain's ChatOpenAI, unchanged, against an app whose
    --default-chat-template-kwargs turn thinking off (LangChain sends no
    chat_template_kwargs): with_structured_output(method="function_calling") forces a
    tool with Pydantic's open schema and gets the model object back."""
    app = app_over(
        llm,
        MAX_SEQ,
        SHORT_TEMPLATE,
        tool_call_parser="hermes",
        default_chat_template_kwargs={"enable_thinking": False},
    )
    with TestClient(app) as http:
        chat = langchain_chat(http, temperature=0, max_tokens=100)
        verdict = chat.with_structured_output(Verdict, method="function_calling").invoke("Hi")
    assert isinstance(verdict, Verdict)


def test_llm_and_generate_close_objects_unless_told_not_to(llm):
    """`LLM` (and generate, through the same `request_fields.constraint`) close a
    schema's objects by default; structured_outputs_config's
    disable_additional_properties false leaves them as sent."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    assert llm.closed_objects is True
    closed = params.params(llm.eos_ids, llm.closed_objects).constraint
    assert json.loads(closed.spec) == {**schema, "additionalProperties": False}
    assert json.loads(params.params(llm.eos_ids, closed=False).constraint.spec) == schema


def test_a_forced_call_wins_over_an_answer_format():
    """tool_choice required with a response_format (the Agents SDK sends both for an
    agent with an output_type whose tool use is required): the reply is the call, as in
    vLLM, constrained by the tools' grammar."""
    from qwen3_spmd.run.serve.protocol import ChatRequest
    from qwen3_spmd.run.serve.structured import constraint_of

    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "integer"}}}
    both = ChatRequest(messages=ASK, tools=[LIGHT], tool_choice="required", response_format=fmt)
    alone = ChatRequest(messages=ASK, tools=[LIGHT], tool_choice="required")
    assert constraint_of(both, read_tools=True) == constraint_of(alone, read_tools=True)
    assert constraint_of(both, read_tools=True)[1] == "tools"


@pytest.mark.parametrize("closed", [True, False])
def test_the_server_closes_objects_unless_told_not_to(closed):
    """constraint_of closes an answer format's objects and a tool's parameters, or
    (disable_additional_properties false) leaves both as sent."""
    from qwen3_spmd.run.serve.protocol import ChatRequest
    from qwen3_spmd.run.serve.structured import constraint_of

    schema = Verdict.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    answer = ChatRequest(messages=ASK, response_format=fmt)
    spec = json.loads(constraint_of(answer, closed=closed)[0].spec)
    assert spec == ({**schema, "additionalProperties": False} if closed else schema)
    tool = {"type": "function", "function": {"name": "Verdict", "parameters": schema}}
    call = ChatRequest(messages=ASK, tools=[tool], tool_choice="required")
    grammar = constraint_of(call, read_tools=True, closed=closed)[0].spec
    # the call's own object {name, arguments} is closed either way; the arguments only
    # when closed
    assert grammar.count('"additionalProperties":false') == (2 if closed else 1)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"not": {}}}}, "structured_outputs.json"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx"),
        ({"guided_json": "{nope"}, "guided_json"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
        (
            {"tools": [LIGHT], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"5": 3}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
    ],
)
def test_bad_structured_input_is_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"]


def test_completions_take_the_same_fields(client):
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    ).choices[0]
    assert out.text in ("left", "right") and out.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"guided_regex": "("}
        )
    assert e.value.body["param"] == "guided_regex"


# ---- generate's flags ----------------------------------------------------------------------


def test_generate_refuses_a_bad_constraint_in_one_line_before_loading(capsys):
    """`generate --json-schema FILE | --regex R | --choice A,B`: a constraint the engine
    does not take, an empty choice, two at once or a schema file that is no JSON end in
    one line, status 2, before any weight is read. (static_batch.generate's constrained
    answers: test_tensor.py.)"""
    from qwen3_spmd.run.cli import main

    argv = ["generate", "--model", str(TINY), "--mesh", "1x1", "--prompt-ids", "5,6,7"]
    for bad in (
        ["--regex", "("],
        ["--choice", ","],
        ["--regex", "a", "--choice", "b"],
        ["--json-schema", str(TINY / "tokenizer_config.json") + ".missing"],
    ):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:"), err
