"""serve's FastAPI app in this process (fastapi's TestClient, no server subprocess) over
one small engine: the tiny fixture on 1x1, one decode row, 40 positions, so the few
programs its requests meet compile once for the whole module. Each test builds its own
app (its own Service, scheduler and metrics registry) over that engine: two apps in one
process count apart.

- `GET /metrics`: counters and histograms move by exactly a small load;
- text that is not text (a lone surrogate) is a 400 naming its field, and odd values
  that once gave 500 are served;
- a client that leaves mid-body leaves no traceback;
- any body, drawn by hypothesis, gets a 2xx or a 4xx with OpenAI's error body.
"""

import asyncio
import json
import logging
import math

import jax
import jax.numpy as jnp
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from reference import FIXTURES

from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.pipeline.structured.constraints import Grammars
from qwen3_spmd.run.models import open_model
from qwen3_spmd.run.serve.app import ServerState, make_app
from qwen3_spmd.run.serve.command import _service
from qwen3_spmd.sharding.mesh import make_mesh

FIXTURE = FIXTURES / "tiny"
# The chat template's 17 tokens, a short answer, and room for a few length buckets: a
# request whose budget does not fit its bucket is padded to its own length (its own
# program), so every request here names a small max_tokens.
MAX_SEQ = 40
P = "qwen3_spmd:"
SERVER_LOGGERS = ("qwen3_spmd", "uvicorn", "starlette", "fastapi")


@pytest.fixture(scope="module")
def engine():
    spec = open_model(str(FIXTURE))
    mesh = make_mesh(1, 1, jax.devices()[:1])
    return spec, Engine(spec.cfg, spec.source, mesh, jnp.float32, MAX_SEQ, chunk=4, block_size=8)


@pytest.fixture
def serve(engine):
    """serve(max_queue, prefix_caching=False, speculator=None, **state) -> a TestClient of
    a new app over the module's engine (one row; a prefix cache of 8-token blocks, a
    page's, when asked; speculating with `speculator`; `state`: more ServerState fields); every
    scheduler built is closed at the test's end."""
    spec, eng = engine
    schedulers, clients = [], []

    def make(max_queue: int, prefix_caching=False, speculator=None, **state) -> TestClient:
        scheduler = Scheduler(
            eng,
            1,
            max_queue=max_queue,
            prefix_caching=prefix_caching,
            grammars=Grammars.of_text(spec.text(), spec.cfg.V, spec.eos_ids()),
            speculator=speculator,
        )
        scheduler.start()
        schedulers.append(scheduler)
        text = spec.text()
        service = _service(scheduler, spec, text, "tiny", MAX_SEQ)
        served = ServerState("tiny", service=service, text=text, status="ready", **state)
        client = TestClient(make_app(served), raise_server_exceptions=True)
        clients.append(client.__enter__())  # one event loop for the client's requests
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
    for scheduler in schedulers:
        scheduler.close()


def _scrape(client) -> dict:
    """{(sample name, its labels but model_name): value} of GET /metrics."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.pop("model_name") == "tiny"
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (P + name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


# ---- /metrics ----------------------------------------------------------------------------


def test_metrics_move_by_exactly_the_load(serve, engine):
    """Three requests (four choices: a completion of ids, one of text with n=2, a
    streamed chat) and one refused by the full queue (n=3 over one row and one queue
    place): the token counters move by the responses' usage, each histogram by a
    sample a choice, the rejections by one; the gauges read an idle server."""
    client = serve(max_queue=1)
    before = _scrape(client)
    greedy = {"temperature": 0, "ignore_eos": True}
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, **greedy})
    two = client.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "n": 2, **greedy}
    )
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **greedy}
    streamed = client.post(
        "/v1/chat/completions",
        json={**chat, "stream": True, "stream_options": {"include_usage": True}},
    )
    full = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1, "n": 3})
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    assert ids.status_code == two.status_code == streamed.status_code == 200
    last = json.loads(streamed.text.split("\n\n")[-3][len("data: ") :])
    usages = [(ids.json()["usage"], 1), (two.json()["usage"], 2), (last["usage"], 1)]
    after = _scrape(client)

    # A choice prefills its prompt (usage counts a request's prompt once).
    prompt = sum(u["prompt_tokens"] * n for u, n in usages)
    assert _moved(before, after, "prompt_tokens_total") == prompt
    generated = sum(u["completion_tokens"] for u, _ in usages)
    assert _moved(before, after, "generation_tokens_total") == generated == 4 + 6 + 3
    assert _moved(before, after, "request_success_total", finished_reason="length") == 4
    assert _moved(before, after, "request_rejected_total", reason="queue_full") == 1
    assert _moved(before, after, "replica_requests_started_total", engine="0") == 4  # D = 1
    for h in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert _moved(before, after, f"{h}_seconds_count") == 4
        assert _moved(before, after, f"{h}_seconds_sum") > 0
        assert _moved(before, after, f"{h}_seconds_bucket", le="+Inf") == 4
    for gauge in ("num_requests_running", "num_requests_waiting", "num_rows_busy"):
        assert after[(P + gauge, ())] == 0
    assert after[(P + "num_rows", ())] == 1
    compiled = len(engine[1].programs.compiled)
    assert after[(P + "engine_compiles_total", ())] == compiled > 0
    assert not math.isnan(after[(P + "engine_compile_wait_seconds_total", ())])
    assert after[(P + "engine_compiles_left", ())] == 0  # no background compiles here


def test_a_repeated_chat_reports_its_cached_tokens_and_the_metrics_count_them(serve, engine):
    """The same chat twice with a prefix cache of 8-token blocks: the first computes its
    whole prompt, the second shares every whole block but the one holding its last
    token; usage.prompt_tokens_details.cached_tokens says so (streamed too), the texts
    agree, and /metrics' prefix cache counters move by exactly that."""
    client = serve(max_queue=4, prefix_caching=True)
    before = _scrape(client)
    chat = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    first = client.post("/v1/chat/completions", json=chat).json()
    second = client.post("/v1/chat/completions", json=chat).json()
    streamed = client.post(
        "/v1/chat/completions",
        json={**chat, "stream": True, "stream_options": {"include_usage": True}},
    )
    last = json.loads(streamed.text.split("\n\n")[-3][len("data: ") :])
    prompt = first["usage"]["prompt_tokens"]
    hit = (prompt - 1) // 8 * 8
    assert prompt > 16 and hit >= 16
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    after = _scrape(client)
    assert _moved(before, after, "prefix_cache_queries_total") == 3 * prompt
    assert _moved(before, after, "prefix_cache_hits_total") == 2 * hit
    # the blocks of the prompt and the reply but its last token (the same each time)
    assert after[(P + "prefix_cache_blocks", ())] == (prompt + 2) // 8


def test_speculation_serves_the_plain_tokens_and_counts_its_drafts(serve, engine):
    """The server with `--speculative-config` (ngram, k = 3, on a prompt whose greedy
    answer loops on one token for a while: drafts kept, then refused): the same
    completion, streamed too, as without it, and /metrics counts the drafts and the
    accepted tokens with vLLM's names."""
    from qwen3_spmd.pipeline.speculative.speculator import make_speculator

    body = {"prompt": [256, 256, 256], "max_tokens": 12, "temperature": 0}
    body.update(ignore_eos=True, logprobs=1, return_tokens_as_token_ids=True)
    plain = serve(max_queue=2).post("/v1/completions", json=body).json()["choices"][0]
    _, eng = engine
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    client = serve(max_queue=2, speculator=make_speculator(eng, config))
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    metrics = _scrape(client)
    assert got["text"] == plain["text"] and len(got["logprobs"]["tokens"]) == 12
    assert got["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    events = [json.loads(e[len("data: ") :]) for e in streamed.text.split("\n\n")[:-2]]
    assert "".join(e["choices"][0]["text"] for e in events) == plain["text"]
    drafts = metrics[(P + "spec_decode_num_draft_tokens_total", ())]
    assert 0 < metrics[(P + "spec_decode_num_accepted_tokens_total", ())] < drafts


def test_metrics_wait_for_the_model():
    """While loading there is no service to count: 503, as /health says."""
    client = TestClient(make_app(ServerState("tiny")))
    r = client.get("/metrics")
    assert r.status_code == 503 and r.json() == {"status": "loading"}


# ---- the tokenizer endpoints ---------------------------------------------------------------


def test_tokenizer_endpoints_as_vllm_and_lm_eval_read_them(serve, engine):
    """POST /tokenize (a prompt, or messages in the chat template), POST /detokenize and
    GET /tokenizer_info with vLLM's bodies; outside /v1, so no API key is asked (the app
    here has none either way). Bad bodies are a 400 naming the field."""
    spec, _ = engine
    text = spec.text()
    client = serve(max_queue=1)
    r = client.post(
        "/tokenize", json={"prompt": "The quick brown fox", "add_special_tokens": False}
    )
    ids = text.encode("The quick brown fox")
    assert r.status_code == 200
    assert r.json() == {"count": len(ids), "max_model_len": MAX_SEQ, "tokens": ids}
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert chat["tokens"] == text.encode(text.render(messages, True))
    back = client.post("/detokenize", json={"tokens": ids + [302]}).json()
    assert back == {"prompt": "The quick brown fox<|im_end|>"}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|endoftext|>"
    assert "{%" in info["chat_template"]
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = client.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_default_chat_template_kwargs_sit_under_the_requests_own(serve, engine):
    """--default-chat-template-kwargs renders every chat as the request's own
    chat_template_kwargs would, and those win where they name the same key: /tokenize
    and a chat's prompt_tokens say so."""
    spec, _ = engine
    text = spec.text()
    messages = [{"role": "user", "content": "Hi"}]
    thinking, quiet = (
        text.encode(text.render(messages, True, enable_thinking=on)) for on in (True, False)
    )
    assert thinking != quiet
    client = serve(max_queue=1, default_chat_template_kwargs={"enable_thinking": False})

    def tokens(**extra):
        return client.post("/tokenize", json={"messages": messages, **extra}).json()["tokens"]

    assert tokens() == quiet
    assert tokens(chat_template_kwargs={"enable_thinking": True}) == thinking
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == len(quiet)


# ---- streamed usage ----------------------------------------------------------------------


def test_continuous_usage_stats_put_the_tokens_so_far_in_every_chunk(serve):
    """stream_options.continuous_usage_stats (vLLM's; guidellm sends it, with
    include_usage): every chunk carries the usage so far, its completion tokens counting
    up to the finishing chunk's 4, which the last chunk's usage repeats; without it only
    the last chunk has usage. The text is the same both ways."""
    client = serve(max_queue=1)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    def chunks(options: dict) -> list[dict]:
        r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": options})
        lines = r.text.split("\n\n")
        return [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: {")]

    every = chunks({"include_usage": True, "continuous_usage_stats": True})
    once = chunks({"include_usage": True})
    counts = [c["usage"]["completion_tokens"] for c in every]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c["usage"]["prompt_tokens"] == 3 for c in every)
    (finished,) = [c for c in every if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finished["usage"]["completion_tokens"] == 4 and every[-1]["choices"] == []
    assert ["usage" in c for c in once] == [False] * (len(once) - 1) + [True]
    assert once[-1]["usage"] == every[-1]["usage"]
    joined = ["".join(c["choices"][0]["text"] for c in cs if c["choices"]) for cs in (every, once)]
    assert joined[0] == joined[1]


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt.1"),
        ("/v1/completions", {"prompt": [1], "stop": ["\ud800"]}, "stop.0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800b"}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(serve, path, body, param):
    """JSON's \\ud800 escape is valid JSON but no text: 400, not the tokenizer's 500."""
    raw = json.dumps(body)  # ensure_ascii: the surrogate goes as its escape
    assert "\\ud" in raw
    r = serve(max_queue=1).post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_content_part_of_no_text_is_400_naming_it(serve):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    r = serve(max_queue=1).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.text"


@pytest.mark.parametrize(
    "path, extra",
    [
        ("/v1/completions", {"top_k": 2**31}),  # past the vocabulary: off (was an int32 overflow)
        ("/v1/completions", {"min_tokens": 2**40}),  # past the budget: the budget
        ("/v1/chat/completions", {"chat_template_kwargs": {"messages": 3}}),  # the body's win
        ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": 3}}),
    ],
)
def test_odd_values_in_range_are_served(serve, path, extra):
    """Values that answered 500 (an int32 overflow on the way to the device, a
    keyword given twice to the template): each is a request that can be served."""
    body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    body.update(
        {"prompt": [5, 6, 7]}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    r = serve(max_queue=1).post(path, json={**body, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_a_client_gone_mid_body_leaves_no_traceback(serve, caplog):
    """The body stops halfway and the client goes (http.disconnect): the app answers
    without raising (uvicorn would log a traceback for what it raises) and logs at
    most one line, below WARNING."""
    app = serve(max_queue=1).app
    messages = iter(
        [
            {"type": "http.request", "body": b'{"prompt": [1, 2', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))  # raises what the app lets out
    assert sent[0]["status"] == 400
    lines = [r for r in caplog.records if r.name.split(".")[0] in SERVER_LOGGERS]
    assert len(lines) <= 1 and all(r.levelno < logging.WARNING and not r.exc_info for r in lines)


# ---- any body ----------------------------------------------------------------------------

# Text as clients send it; any JSON, with text that is not (lone surrogates, which
# JSON's escapes can spell); and values at the edges (past int32 and int64, the
# extremes of a double, empty, null).
TEXT = st.text(max_size=6) | st.sampled_from(["Hi", "<|im_end|>", "\n"])
EDGE = st.sampled_from(
    [-1, 0, 2**31, 2**63, -(2**63), 10**30, 1e308, 5e-324, None, "", "a\ud800b", [], {}]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT | EDGE,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
ANY = EDGE | JSON
VOCAB = 331  # the tiny fixture's
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | TEXT | ANY})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={
        "content": TEXT | st.lists(PART, max_size=2) | st.none(),
        "tool_calls": ANY,  # fields the template may read
        "reasoning_content": ANY,
    },
)
TEMPLATE_KWARGS = st.fixed_dictionaries({"enable_thinking": st.booleans()}) | st.dictionaries(
    st.sampled_from(["enable_thinking", "tools", "messages", "add_generation_prompt"]),
    ANY,
    max_size=2,
)
SCHEMA = st.sampled_from(
    [
        {"type": "boolean"},
        {"enum": ["a", "b"]},
        {"type": "object", "properties": {"x": {"type": "integer"}}},
        {"type": "nonsense"},
        {"not": {}},
        {"$ref": "#/missing"},
    ]
)
REGEX = st.sampled_from(["[ab]{1,2}", "x|y", "(", "[0-9]+"])
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# Each field's values of the right type and in range: a drawn request mostly runs.
# Values out of range, of other types, and text that is not text come from ANY.
SHARED = {
    "model": st.sampled_from(["tiny"] * 7 + ["other"]),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.integers(-1, 50),
    "n": st.integers(1, 3),
    "stop": TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=2),
    "seed": st.integers(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    # Structured outputs (small answers: a few tokens of budget end most of them).
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})},
    ),
    "structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "structural_tag"]),
        SCHEMA | REGEX | st.lists(TEXT, max_size=2) | st.booleans(),
        max_size=2,
    ),
    "guided_json": SCHEMA,
    "guided_regex": REGEX,
    "guided_choice": st.lists(TEXT, max_size=2),
    "guided_grammar": st.sampled_from(['start: "a" | "b"', "root ::= [0-9]", "start: ("]),
    "logit_bias": st.dictionaries(st.sampled_from(["5", "x"]), st.integers(-2, 2), max_size=1),
    "presence_penalty": st.sampled_from([0, 0.5]),
}
ENDPOINTS = {
    "/v1/completions": (
        {
            "prompt": TEXT.filter(bool) | IDS | st.lists(IDS, min_size=1, max_size=2),
            "max_tokens": st.integers(1, 5),
        },
        {**SHARED, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
    ),
    "/v1/chat/completions": (
        {
            "messages": st.lists(MESSAGE, min_size=1, max_size=2),
            "max_tokens": st.integers(1, 5),
        },
        {
            **SHARED,
            "max_completion_tokens": st.integers(1, 4),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 5),
            "chat_template_kwargs": TEMPLATE_KWARGS,
            "add_generation_prompt": st.booleans(),
            "tools": st.lists(st.just(TOOL), max_size=1),
            "tool_choice": st.sampled_from(
                ["none", "auto", "required", "any", {"type": "function", "function": {"name": "f"}}]
            ),
            "parallel_tool_calls": st.booleans(),
        },
    ),
}


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """(endpoint, body): a request of well-typed fields, with one field's value (or
    the body) replaced by any JSON, or its prompt or messages dropped, or bytes that
    are not JSON."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    required, optional = ENDPOINTS[path]
    body = draw(st.fixed_dictionaries(required, optional=optional))
    how = draw(st.sampled_from(["as drawn"] * 2 + ["one field"] * 2 + ["drop", "body", "bytes"]))
    if how == "one field":
        body[draw(st.sampled_from(sorted({*required, *optional})))] = draw(ANY)
    elif how == "drop":
        body.pop(next(iter(required)))
    elif how == "body":
        body = draw(ANY)
    elif how == "bytes":
        return path, draw(st.binary(max_size=12))
    return path, json.dumps(body).encode()


def test_any_body_is_answered_with_2xx_or_4xx(serve):
    """Bodies drawn by hypothesis at both endpoints: each gets a 2xx, or a 4xx with
    OpenAI's error body, and nothing raises in the app (TestClient re-raises it); the
    server then answers a plain request as before. Derandomized and bounded: the same
    examples every run, a few seconds."""
    client = serve(max_queue=16)  # n <= 16 choices always find a place on an idle server
    plain = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    first = client.post("/v1/completions", json=plain).json()["choices"][0]["text"]

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    def answered(case):
        path, raw = case
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code < 500, (raw, r.text)
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text
        else:
            assert r.json()["choices"]

    answered()
    again = client.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    assert again == first
