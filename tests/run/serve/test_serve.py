"""`qwen3-spmd serve` end to end: a server subprocess on 127.0.0.1 (a free port), an
emulated 2x2 mesh, the tiny fixture (a real tokenizer and Qwen3's chat template),
driven by the official `openai` client and by raw HTTP for the SSE bytes. Every
request has a timeout; the module's last test stops the server with SIGTERM.

The servers here compile each program when a request first needs it (`--precompile
lazy`), in a fraction of the time it takes to compile every shape a round can run;
`--precompile all` and `first` (the default) have a test each with the fewest shapes
(and `Scheduler.precompile` its own in tests/pipeline/scheduling/test_scheduler.py)."""

import concurrent.futures
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from children import child_env
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from reference import ROOT

from qwen3_spmd.run.text import Text

FIXTURE = ROOT / "tests" / "fixtures" / "tiny"
KEY = "test-key"
MAX_QUEUE = 4
TIMEOUT = 120  # seconds, per request


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = child_env()
    argv = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--model", str(FIXTURE)]
    argv += ["--mesh", "2x2", "--cpu-devices", "4", "--port", str(port), "--api-key", KEY]
    argv += ["--max-batch", "4", "--max-queue", str(MAX_QUEUE), "--shutdown-timeout", "1"]
    argv += ["--chunk", "4"]  # a long request takes seconds: time to disconnect, to SIGTERM
    argv += ["--precompile", "lazy"]
    argv += ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]
    log = (
        open(ROOT / ".pytest_cache" / "serve.log", "w")
        if (ROOT / ".pytest_cache").is_dir()
        else None
    )
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log or subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    loading_seen = False
    while True:
        assert proc.poll() is None, "the server exited while starting"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.json()["status"] == "loading"
            loading_seen = True
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up in 300 s"
        time.sleep(0.5)
    yield {"url": url, "proc": proc, "loading_seen": loading_seen}
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(
        base_url=server["url"] + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0
    )


@pytest.fixture(scope="module")
def text():
    return Text(FIXTURE)


@pytest.fixture(scope="module")
def reference():
    ref = np.load(FIXTURE / "reference.npz")
    return [
        (ref[f"prompt_{i}"].tolist(), ref[f"greedy_tokens_{i}"].tolist())
        for i in range(int(ref["num_prompts"]))
    ]


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["url"] + path, json=body, headers=headers, timeout=TIMEOUT, **kw)


def _sse(server, path, body):
    """(the chunks as dicts, the raw bytes) of a streamed request."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server["url"] + path, json=body, headers=headers, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: ") :]) for e in events[:-2]], raw


def _joined(chunks, n=1, field=lambda c: c["text"]):
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += field(c)
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    return texts, reasons


def _greedy(prompt, max_tokens, **extra):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


# ---- serving ---------------------------------------------------------------------------


def test_health_and_models(server, client):
    # The port is bound before loading: /health said 503 "loading" meanwhile (the
    # fixture checked each answer), and said it at least once.
    assert server["loading_seen"]
    r = httpx.get(server["url"] + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_idle_connection_outlives_the_clients_expiry(server):
    """httpx (the openai client's transport) reuses a connection idle for up to 5 s:
    the server keeps it open longer, so a reuse never meets a connection the server is
    closing (uvicorn's own 5 s raced with it and failed a request)."""
    address = httpx.URL(server["url"])
    connection = http.client.HTTPConnection(address.host, address.port, timeout=TIMEOUT)
    connection.request("GET", "/health")
    assert connection.getresponse().read() and connection.sock is not None
    time.sleep(6)
    connection.request("GET", "/health")  # the same socket: no reconnect
    assert connection.getresponse().status == 200
    connection.close()


def test_taken_port_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--model", str(FIXTURE)]
        out = subprocess.run(
            argv + ["--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): choose "
        "another --port or --host"
    ]


def test_concurrent_greedy_completions_equal_transformers(server, client, text, reference):
    """The fixture's greedy tokens (transformers, 8 each, no EOS): sent at once, each
    completion is their text."""
    with concurrent.futures.ThreadPoolExecutor(len(reference)) as pool:
        futures = [
            pool.submit(
                client.completions.create,
                model="tiny",
                prompt=prompt,
                max_tokens=len(tokens),
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for prompt, tokens in reference
        ]
        results = [f.result() for f in futures]
    for (prompt, tokens), out in zip(reference, results):
        assert out.choices[0].text == text.decode(tokens, skip_special=True)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(tokens)


def test_greedy_equals_generate_with_a_stop_token(server, client, text, reference):
    """A stop token id ends a request as EOS does: the server stops where
    static_batch.generate (1x1 mesh, the id among its EOS ids) stops, and leaves it out of
    the text."""
    import jax
    import jax.numpy as jnp

    from qwen3_spmd.pipeline.programs.sampling import Sampling
    from qwen3_spmd.pipeline.runtime.engine import Engine
    from qwen3_spmd.pipeline.scheduling import static_batch
    from qwen3_spmd.run.models import open_model
    from qwen3_spmd.sharding.mesh import make_mesh

    spec = open_model(str(FIXTURE))
    engine = Engine(spec.cfg, spec.source, make_mesh(1, 1, jax.devices()[:1]), jnp.float32, 128)
    stop_id = reference[0][1][3]  # greedy emits it at step 3 of prompt 0
    prompts = [reference[0][0], [11, 13], [277, 4, 195, 110, 216, 14, 270]]
    ref = static_batch.generate(engine, prompts, 30, Sampling(), 0, spec.eos_ids() + (stop_id,))
    assert ref.completions[0].finish_reason == "stop"

    def ask(p):
        return client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=30,
            temperature=0,
            extra_body={"stop_token_ids": [stop_id]},
        )

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(ask, prompts))
    for c, out in zip(ref.completions, outs):
        ended = c.finish_reason == "stop"
        assert out.choices[0].finish_reason == ("stop" if ended else "length")
        shown = c.token_ids[:-1] if ended else c.token_ids
        assert out.choices[0].text == text.decode(shown, skip_special=True)
        assert out.usage.completion_tokens == len(c.token_ids)


def test_streamed_equals_whole_with_usage(server, reference):
    prompt, tokens = reference[4]
    body = _greedy(prompt, 24, ignore_eos=True, n=2)
    whole = _post(server, "/v1/completions", body).json()
    chunks, raw = _sse(
        server,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    cached = whole["usage"]["prompt_tokens_details"]["cached_tokens"]  # seen before or not
    assert 0 <= cached < len(prompt)
    assert whole["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 48,
        "total_tokens": len(prompt) + 48,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    texts, reasons = _joined(chunks[:-1], 2)
    assert texts == [c["text"] for c in whole["choices"]]
    assert reasons == ["length", "length"]
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_echo_prepends_the_prompt(server, text):
    """echo's text is the prompt's, then the very answer the same request gets without
    echo (greedy): nothing of the answer dropped or repeated."""
    body = _greedy("The quick", 3)
    plain = _post(server, "/v1/completions", body).json()["choices"][0]
    echoed = _post(server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == "The quick" + plain["text"]
    assert echoed["finish_reason"] == plain["finish_reason"]


def test_chat_prompt_tokens_are_the_template(server, client, text):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where does the river flow?"},
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    rendered = text.render(messages, True, enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")
    assert out.usage.prompt_tokens == len(text.encode(rendered))
    assert out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion"
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == out.choices[0].message.content


def test_chat_with_tools_reaches_the_parsers(server, client, text):
    """The flags reach the server (the parsers' rules: tests/run/serve/test_serve_parsers.py): the
    message has reasoning_content, and a request with tools passes the parser's check
    and is rendered with them (asked for too many tokens, so it is refused before the
    model runs: a prompt of ~400 tokens would compile a prefill of its own)."""
    messages = [  # test_chat_prompt_tokens_are_the_template's: its programs are compiled
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where does the river flow?"},
    ]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, extra_body=off
    )
    assert "reasoning_content" in out.choices[0].message.model_extra
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = _post(
        server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 512}
    )
    prompt = len(text.encode(text.render(messages, True, tools=tools)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert f"prompt 0 ({prompt} tokens) + max_tokens 512" in r.json()["error"]["message"]


def test_seeded_sampling_same_alone_and_under_load(server, client):
    ask = dict(
        model="tiny", prompt=[5, 17, 42, 99], max_tokens=12, temperature=0.9, top_p=0.9, seed=1234
    )
    alone = client.completions.create(**ask).choices[0].text
    others = [dict(ask, prompt=[i, i + 1], seed=i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, **o) for o in others]
        loaded = pool.submit(client.completions.create, **ask).result().choices[0].text
        [f.result() for f in futures]
    assert loaded == alone


def test_n_choices(server, client):
    sampled = client.completions.create(
        model="tiny", prompt=[3, 4, 5], max_tokens=10, temperature=1.0, n=3, seed=9
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.text for c in sampled.choices}) > 1  # seeds 9, 10, 11 differ
    again = client.completions.create(
        model="tiny", prompt=[3, 4, 5], max_tokens=10, temperature=1.0, n=3, seed=9
    )
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]
    greedy = client.completions.create(
        model="tiny", prompt=[3, 4, 5], max_tokens=6, temperature=0, n=2
    )
    assert greedy.choices[0].text == greedy.choices[1].text


def test_stop_string_split_across_tokens(server, text, reference):
    prompt, tokens = reference[4]
    pieces = [text.decode([t], skip_special=True) for t in tokens]
    i = next(
        i
        for i in range(len(tokens) - 1)
        if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
    )
    stop = (
        pieces[i][-1] + pieces[i + 1][0]
    )  # the last character of one token, the first of the next
    full = text.decode(tokens, skip_special=True)
    body = _greedy(prompt, len(tokens), ignore_eos=True, stop=[stop, "never-seen"])
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    assert whole["text"] == full[: full.find(stop)]
    assert whole["finish_reason"] == "stop"
    chunks, _ = _sse(server, "/v1/completions", {**body, "stream": True})
    assert _joined(chunks) == ([whole["text"]], ["stop"])


def test_logprobs_equal_transformers(server, client, reference):
    """logprobs of the fixture's greedy tokens equal log_softmax of transformers' step
    logits; the top entries come in decreasing order, the first being the token."""
    ref = np.load(FIXTURE / "reference.npz")
    prompt, tokens = reference[1]
    want = ref["step_logits_1"].astype(np.float64)
    want = (
        want
        - np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - want.max(-1, keepdims=True)
    )
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=len(tokens),
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    np.testing.assert_allclose(lp.token_logprobs, want[np.arange(len(tokens)), tokens], atol=1e-4)
    for k, top in enumerate(lp.top_logprobs):
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(lp.token_logprobs[k], abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.bytes == list(entry.token.encode()) or entry.token.startswith("bytes:\\x")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def test_echo_logprobs_score_every_prompt_token(server, text, reference):
    """lm-evaluation-harness's log-likelihood request, two id prompts of different
    lengths: one choice each, in order, whose tokens, token_logprobs, top_logprobs and
    text_offset cover every prompt token (the first null) and then the generated one;
    the prompt's log-probabilities equal log_softmax of transformers' logits. With
    max_tokens 0: the same, without the generated token."""
    ref = np.load(FIXTURE / "reference.npz")
    which = [2, 0]  # 11 and 7 tokens
    prompts = [reference[i][0] for i in which]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    out = _post(server, "/v1/completions", {**body, "seed": 1234}).json()
    bare = _post(server, "/v1/completions", {**body, "max_tokens": 0}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1] == [c["index"] for c in bare["choices"]]
    assert bare["usage"]["completion_tokens"] == 0 and out["usage"]["completion_tokens"] == 2
    for i, p, c, b in zip(which, prompts, out["choices"], bare["choices"]):
        lp = c["logprobs"]
        assert [len(lp[f]) for f in lp] == [len(p) + 1] * 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = _log_softmax(ref[f"prefill_logits_{i}"])
        np.testing.assert_allclose(
            lp["token_logprobs"][1 : len(p)], want[np.arange(len(p) - 1), p[1:]], atol=1e-4
        )
        for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            # the token itself and the most likely (one entry when it is the most likely)
            assert chosen in top.values() and 1 <= len(top) <= 2
            assert max(top.values()) >= chosen
        # the generated token, transformers' greedy one, is the most likely
        assert lp["top_logprobs"][-1][lp["tokens"][-1]] == max(lp["top_logprobs"][-1].values())
        shown = text.decode(p, skip_special=True)
        assert c["text"].startswith(shown) and b["text"] == shown
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert lp["text_offset"][-1] == len(shown)
        # The same numbers (to rounding: the two requests may be batched apart)
        bare_lp = b["logprobs"]
        for field in ("tokens", "text_offset"):
            assert bare_lp[field] == lp[field][: len(p)]
        np.testing.assert_allclose(
            bare_lp["token_logprobs"][1:], lp["token_logprobs"][1 : len(p)], atol=1e-6
        )
        assert [list(t) for t in bare_lp["top_logprobs"][1:]] == [
            list(t) for t in lp["top_logprobs"][1 : len(p)]
        ]
        assert b["finish_reason"] == "length"


def test_prompt_logprobs_field_in_completions_and_chat(server, text, reference):
    """vLLM's prompt_logprobs: k: a list beside the choices, null first, then per token
    {id: {logprob, rank, decoded_token}} of the token and its position's k most likely;
    streamed, with the first token."""
    lp_fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    ref = np.load(FIXTURE / "reference.npz")
    prompt = reference[0][0]
    out = _post(server, "/v1/completions", _greedy(prompt, 1, prompt_logprobs=2)).json()
    got = out["choices"][0]["prompt_logprobs"]
    want = _log_softmax(ref["prefill_logits_0"])
    assert len(got) == len(prompt) and got[0] is None
    for p, (token, position) in enumerate(zip(prompt[1:], got[1:])):
        assert str(token) in position and 2 <= len(position) <= 3
        assert position[str(token)]["logprob"] == pytest.approx(want[p, token], abs=1e-4)
        assert position[str(token)]["decoded_token"] == text.decode([token])
        best = int(np.argmax(want[p]))
        assert position[str(best)]["rank"] == 1
        assert position[str(best)]["logprob"] == pytest.approx(want[p, best], abs=1e-4)
    # Streamed: the prompt's come with the choice's first token, and add up to the whole.
    body = _greedy(prompt, 2, echo=True, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    chunks, _ = _sse(server, "/v1/completions", {**body, "stream": True})
    parts = [c["choices"][0] for c in chunks]
    assert "".join(p["text"] for p in parts) == whole["text"]
    assert {f: sum((p["logprobs"][f] for p in parts), []) for f in lp_fields} == {
        f: whole["logprobs"][f] for f in lp_fields
    }
    sent = [p["prompt_logprobs"] for p in parts if "prompt_logprobs" in p]
    assert sent == [whole["prompt_logprobs"]]
    chat = _post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    scored = chat["prompt_logprobs"]
    assert len(scored) == chat["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(position) == 1 for position in scored[1:])  # the token itself


LM_EVAL_TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def test_lm_eval_scores_as_transformers(server, tmp_path):
    """lm-evaluation-harness's `local-completions` (its own process, offline, the
    server's tokenizer endpoints for its tokenizer) on a tiny
    multiple-choice task: each choice's log-likelihood equals transformers' within 1e-4
    a token, and its greedy flag is the same (tests/fixtures/make_lm_eval_reference.py)."""
    folder = ROOT / "tests" / "fixtures" / "lm_eval"
    reference = json.loads((folder / "reference.json").read_text())["docs"]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(LM_EVAL_TASK.format(data=folder / "tiny_mc.json"))
    env = child_env() | {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OPENAI_API_KEY": KEY,
    }
    args = f"base_url={server['url']}/v1/completions,model=tiny,tokenizer_backend=remote"
    args += ",num_concurrent=1,max_retries=1,timeout=120"
    argv = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
    argv += ["--model_args", args, "--tasks", "tiny_mc", "--include_path", str(tasks)]
    argv += ["--batch_size", "1", "--log_samples", "--output_path", str(tmp_path / "out")]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = (tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")
    seen = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        items = reference[sample["doc_id"]]["items"]
        assert len(sample["filtered_resps"]) == len(items)
        for (loglikelihood, greedy), item in zip(sample["filtered_resps"], items):
            n = len(item["tokens"]) - item["ctxlen"]
            assert float(loglikelihood) == pytest.approx(item["loglikelihood"], abs=1e-4 * n)
            assert str(greedy) == str(item["greedy"])
            seen += 1
    assert seen == sum(len(d["items"]) for d in reference)


def test_min_tokens_holds_back_the_end(server, reference):
    prompt, tokens = reference[0]
    end = tokens[2]
    assert end not in tokens[:2]
    body = _greedy(prompt, 8, ignore_eos=True, stop_token_ids=[end])
    plain = _post(server, "/v1/completions", body).json()
    assert (
        plain["usage"]["completion_tokens"] == 3 and plain["choices"][0]["finish_reason"] == "stop"
    )
    held = _post(server, "/v1/completions", {**body, "min_tokens": 5}).json()
    assert held["usage"]["completion_tokens"] >= 5


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1], "max_tokens": -3}, "max_tokens"),
        ({"prompt": [1, 331]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [1] * 500, "max_tokens": 13}, "max_tokens"),  # 513 > --max-seq-len 512
        ({"prompt": []}, "prompt"),
        ({"prompt": [1], "temperature": -1}, "temperature"),
        ({"prompt": [1], "n": 0}, "n"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": [1], "logprobs": 6}, "logprobs"),
        ({"prompt": [1], "prompt_logprobs": 6}, "prompt_logprobs"),
        ({"prompt": [1], "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": [1], "min_tokens": -1}, "min_tokens"),
        ({"prompt": [1], "min_tokens": 1, "stop_token_ids": list(range(9))}, "stop_token_ids"),
    ],
)
def test_invalid_requests_are_400(server, body, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_malformed_json_unknown_model_and_key(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(
        server["url"] + "/v1/completions", content=b"{nope", headers=headers, timeout=TIMEOUT
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = _post(server, "/v1/completions", {"prompt": [1], "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", {"prompt": [1]}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _post(server, "/v1/completions", {"prompt": [1], "max_tokens": 1, "unknown_field": 1})
    assert r.status_code == 200  # unknown fields are ignored


def test_full_queue_is_503(server):
    """16 choices cannot all find a row (4) or a queue place (4): refused whole."""
    r = _post(server, "/v1/completions", _greedy([1, 2], 2, n=16))
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "queue_full"
    _wait_idle(server)


def _wait_idle(server, limit_s=60):
    deadline = time.monotonic() + limit_s
    while True:
        h = httpx.get(server["url"] + "/health", timeout=10).json()
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"rows still busy: {h}"
        time.sleep(0.2)


def test_disconnect_frees_the_row(server):
    """A client that goes away mid-stream cancels its request (counted in /health's
    finished.cancelled) well before its 480 tokens could have been generated, and its
    row is free again."""
    before = _wait_idle(server)["finished"]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = _greedy([9, 8, 7], 480, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", server["url"] + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT
    ) as r:
        next(r.iter_lines())  # the request runs
    after = _wait_idle(server, 30)
    assert after["finished"].get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert after["finished"].get("length", 0) == before.get("length", 0)


def test_sigterm_ends_running_requests_and_exits_0(server):
    """Last in the module: a long stream ends with an error event after
    --shutdown-timeout 1 s; new requests are refused meanwhile; exit status 0."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = _greedy([9, 8, 7], 480, ignore_eos=True, stream=True)
    proc = server["proc"]
    with httpx.stream(
        "POST", server["url"] + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        _wait_draining(server)
        refused = _post(server, "/v1/completions", {"prompt": [1], "max_tokens": 1})
        rest = [line for line in lines if line]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert rest[-1] == "data: [DONE]"
    assert "error" in json.loads(rest[-2][len("data: ") :])
    assert proc.wait(timeout=60) == 0


def _wait_draining(server, limit_s=30):
    """Once the server has taken the signal: /health says 503 "draining"."""
    deadline = time.monotonic() + limit_s
    while True:
        r = httpx.get(server["url"] + "/health", timeout=10)
        if r.status_code == 503 and r.json()["status"] == "draining":
            return
        assert r.status_code == 200, r.text
        assert time.monotonic() < deadline, f"the server did not start draining in {limit_s} s"
        time.sleep(0.05)


def _two_process_server(
    port: int, coordinator: int, *extra: str, mesh: str = "1x2"
) -> list[subprocess.Popen]:
    """A server on `mesh` over two processes (one CPU device each) on `port`, once
    /health says 200; the caller ends them."""
    env = child_env()
    argv = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--model", str(FIXTURE)]
    argv += ["--mesh", mesh, "--cpu-devices", "1", "--port", str(port), "--max-batch", "2"]
    argv += ["--precompile", "lazy"]
    argv += ["--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2", *extra]
    procs = [
        subprocess.Popen(
            argv + ["--process-id", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 300
    while True:
        if any(p.poll() is not None for p in procs):
            errs = [p.communicate()[1] for p in procs if p.poll() is not None]
            _stop(procs)
            raise AssertionError(f"a server process exited while starting: {errs}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return procs
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            _stop(procs)
            raise AssertionError("the two-process server did not come up in 300 s")
        time.sleep(0.5)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_two_processes_serve_as_one(reference, text):
    """Two replicas over two processes (2x1x1x1, one CPU device each): process 0 serves
    HTTP and /metrics for both, process 1 follows its decisions; three concurrent
    requests start on both replicas (2 rows each); the completions equal transformers'
    tokens; SIGTERM to both (as a job scheduler sends it) drains and both exit 0."""
    port = free_port()
    procs = _two_process_server(port, free_port(), mesh="2x1x1x1")
    try:
        url = f"http://127.0.0.1:{port}"

        def ask(i):
            prompt, tokens = reference[i]
            body = _greedy(prompt, len(tokens), ignore_eos=True)
            r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
            return r.json()["choices"][0]["text"], text.decode(tokens, skip_special=True)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for got, want in pool.map(ask, range(3)):
                assert got == want
        # Process 0 serves /metrics: the job's requests (the warm-up went around them).
        scraped = httpx.get(url + "/metrics", timeout=TIMEOUT).text
        value = {
            s.name: s.value
            for family in text_string_to_metric_families(scraped)
            for s in family.samples
        }
        assert value["qwen3_spmd:prompt_tokens_total"] == sum(len(p) for p, _ in reference[:3])
        assert value["qwen3_spmd:generation_tokens_total"] == sum(len(t) for _, t in reference[:3])
        starts = {
            s.labels["engine"]: s.value
            for family in text_string_to_metric_families(scraped)
            for s in family.samples
            if s.name == "qwen3_spmd:replica_requests_started_total"
        }
        assert set(starts) == {"0", "1"} and min(starts.values()) >= 1, starts
        # A constrained answer: the Round carries its constraint, each process runs the
        # same matcher on the same tokens.
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
        schema |= {"required": ["ok"], "additionalProperties": False}
        body = _greedy(reference[0][0], 20, structured_outputs={"json": schema})
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
        assert r["finish_reason"] == "stop" and json.loads(r["text"]) in (
            {"ok": True},
            {"ok": False},
        )
        for p in procs:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    finally:
        _stop(procs)


def test_losing_the_follower_ends_the_server_with_one_line():
    """A follower that dies ends process 0 (the HTTP server) within --peer-timeout with
    one line naming the lost process and a non-zero status, rather than a server that
    accepts requests no round can run."""
    coordinator, peer_timeout = free_port(), 5
    procs = _two_process_server(free_port(), coordinator, "--peer-timeout", str(peer_timeout))
    try:
        procs[1].kill()
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=peer_timeout + 60)
        elapsed = time.monotonic() - killed
    finally:
        _stop(procs)
    assert procs[0].returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: lost process 1") and f"127.0.0.1:{coordinator}" in last, err
    assert elapsed < peer_timeout + 20  # the heartbeat timeout, plus a loaded machine's slack


def _wait_healthy(proc, url: str, log, limit_s: float = 300) -> float:
    """Polls /health until it says 200 (while the server lives: else its `log()`);
    returns the deadline, for the test's later waits."""
    deadline = time.monotonic() + limit_s
    while True:
        assert proc.poll() is None, log()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return deadline
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not come up in {limit_s} s"
        time.sleep(0.5)


def test_precompile_all_compiles_every_shape_before_serving():
    """--precompile all: every program a round can run is compiled before
    /health says 200, so a request then waits for no compile (the server names each
    compile it waits for); SIGTERM ends it with 0. 1x1, two rows, 8 positions: the
    shapes of the --precompile first test below, which then reads them from the
    session's compile cache."""
    port = free_port()
    env = child_env()
    argv = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--model", str(FIXTURE)]
    argv += ["--mesh", "1x1", "--port", str(port), "--max-batch", "2", "--max-seq-len", "8"]
    argv += ["--precompile", "all"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, lambda: proc.communicate()[1])
        out = httpx.post(url + "/v1/completions", json=_greedy([5, 6, 7], 4), timeout=TIMEOUT)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 4
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    compiled = re.search(r"compiled (\d+) program shapes", err)
    assert compiled and int(compiled[1]) > 0, err
    serving = err.index("serving tiny on")
    assert err.index(compiled[0]) < serving and "compiling" not in err[serving:], err


def test_precompile_first_serves_while_the_rest_compiles(tmp_path):
    """--precompile first (the default): the shapes a first light load meets and the
    cover of stand-ins compile before /health says 200, the rest on a background thread
    while the server answers, structured outputs' last; a request of a background shape
    (log-probabilities over one row) runs on its stand-in (over two) without waiting for
    a compile, a line says when the background is done, and a structured request then
    waits for none either; SIGTERM ends it with 0. 1x1, two rows, 8 positions: 6 shapes
    first, 7 after (2 of them constrained)."""
    port = free_port()
    env = child_env()
    argv = [sys.executable, "-m", "qwen3_spmd.run", "serve", "--model", str(FIXTURE)]
    argv += ["--mesh", "1x1", "--port", str(port), "--max-batch", "2", "--max-seq-len", "8"]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f)
    url = f"http://127.0.0.1:{port}"
    done = "compiled the other 7 program shapes in the background"
    try:
        deadline = _wait_healthy(proc, url, log.read_text)
        body = _greedy([5, 6, 7], 4, logprobs=2)
        out = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert out.status_code == 200 and out.json()["choices"][0]["logprobs"]["token_logprobs"]
        while done not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        body = _greedy([5, 6, 7], 3, response_format={"type": "json_object"})
        out = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert out.status_code == 200, out.text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert proc.returncode == 0, err
    first, serving = "compiled 6 of 13 program shapes", err.index("serving tiny on")
    assert err.index(first) < serving and f"{done} in" in err, err
    assert "compiling" not in err[serving:] and "failed" not in err, err  # no round waited
    if sys.platform == "linux":  # XLA's compile threads found, with the compiling one
        lowered = re.search(
            r"the other programs compile at the lowest CPU priority \((\d+) threads\)", err
        )
        assert lowered and int(lowered.group(1)) >= 2, err
