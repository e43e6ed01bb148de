"""The pooling runner's endpoints (`run.serve.embeddings`) through the clients people
use, over serve's app in this process: /v1/embeddings through the `openai` client
(base64, its default, and float; Matryoshka dimensions; token ids) and LangChain's
OpenAIEmbeddings, /v1/score and /v1/rerank (Cohere's shape) on the reranker, each
equal to the fixtures' references (tests/run/test_pooling.py says which); bad input is
a 400 naming the field, and a generation request to a pooling server too.
"""

import base64

import numpy as np
import openai
import pytest
from reference import EMBED, RERANK, RERANKER, embed_reference, rerank_reference
from served import app_over
from starlette.testclient import TestClient

from qwen3_spmd import LLM

MAX_SEQ = 512  # as tests/run/test_pooling.py: the same programs
TOL = 1e-5
REF, CASES = embed_reference()
TEXTS = [(text, i) for text, i in CASES if text]


@pytest.fixture(scope="module")
def http():
    with LLM(str(EMBED), mesh="1x1", max_seq_len=MAX_SEQ) as llm:
        llm.start()
        with TestClient(app_over(llm, MAX_SEQ)) as http:
            yield http


@pytest.fixture(scope="module")
def rerank_http():
    with LLM(str(RERANK), mesh="1x1", max_seq_len=MAX_SEQ, hf_overrides=RERANKER) as llm:
        llm.start()
        with TestClient(app_over(llm, MAX_SEQ)) as http:
            yield http


def _client(http):
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


def test_the_openai_client_gets_sentence_transformers_embeddings(http):
    """The client's default (it asks for base64 and decodes it), float, and base64 asked
    for (the caller decodes: little-endian float32); 16 dimensions; the usage counts the
    inputs' tokens; token ids go in as given."""
    client = _client(http)
    texts = [text for text, _ in TEXTS[:3]]
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        for dims in (openai.NOT_GIVEN, 16):
            got = client.embeddings.create(
                model="tiny", input=texts, encoding_format=fmt, dimensions=dims
            )
            for item, (_, i) in zip(got.data, TEXTS[:3]):
                want = REF[f"embedding_{i}"] if dims != 16 else REF[f"embedding_16_{i}"]
                value = item.embedding
                if fmt == "base64":
                    value = np.frombuffer(base64.b64decode(value), "<f4")
                np.testing.assert_allclose(value, want, atol=TOL, rtol=0)
            assert got.usage.prompt_tokens == sum(len(REF[f"ids_{i}"]) for _, i in TEXTS[:3])
    ids = REF[f"ids_{TEXTS[0][1]}"].tolist()
    got = client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
    np.testing.assert_allclose(got.data[0].embedding, REF[f"embedding_{TEXTS[0][1]}"], atol=TOL)


def test_metrics_count_the_pooled_prompts(http):
    """/metrics: each input's prompt tokens and a success, as the choices' are counted."""

    def read():
        text = http.get("/metrics").text
        counts = {}
        for line in text.splitlines():
            for name in ("prompt_tokens_total", "request_success_total"):
                if line.startswith("qwen3_spmd:" + name):
                    counts[name] = counts.get(name, 0) + float(line.split()[-1])
        return counts

    before = read()
    http.post("/v1/embeddings", json={"input": [[1, 2, 3], [4, 5]]}).raise_for_status()
    after = read()
    assert after["prompt_tokens_total"] - before.get("prompt_tokens_total", 0) == 5
    assert after["request_success_total"] - before.get("request_success_total", 0) == 2


def test_langchain_embeddings(http):
    """LangChain's OpenAIEmbeddings with the model's own tokenizer for its length
    checks (tiktoken's files cannot be fetched here): documents and a query."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model="tiny",
        base_url="http://testserver/v1",
        api_key="unused",
        http_client=http,
        tiktoken_enabled=False,
        tiktoken_model_name=str(EMBED),
        max_retries=0,
    )
    texts = [text for text, _ in TEXTS[:2]]
    docs = embeddings.embed_documents(texts)
    query = embeddings.embed_query(texts[0])
    for got, (_, i) in zip([*docs, query], [*TEXTS[:2], TEXTS[0]]):
        np.testing.assert_allclose(got, REF[f"embedding_{i}"], atol=TOL, rtol=0)


def test_score_and_rerank_equal_transformers(rerank_http):
    """/v1/score 1:N in index order; /v1/rerank in Cohere's shape: the top_n documents
    by relevance_score, the best first, with their text unless return_documents is
    false."""
    ref, pairs = rerank_reference()
    query, docs = pairs[0][0], [d for q, d in pairs if q == pairs[0][0]]
    want = [float(ref[f"score_{i}"]) for i in range(len(docs))]
    body = rerank_http.post("/v1/score", json={"text_1": query, "text_2": docs}).json()
    got = [d["score"] for d in body["data"]]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert [d["index"] for d in body["data"]] == list(range(len(docs)))
    body = rerank_http.post(
        "/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}
    ).json()
    best = sorted(range(len(docs)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in body["results"]] == best
    assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in best]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in body["results"]], [want[i] for i in best], atol=TOL
    )
    cohere = {"query": query, "documents": [{"text": d} for d in docs], "return_documents": False}
    body = rerank_http.post("/v2/rerank", json=cohere).json()
    assert len(body["results"]) == len(docs) and "document" not in body["results"][0]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input"),
        ("/v1/embeddings", {"input": [[1, 99999]]}, "input"),
        ("/v1/embeddings", {"input": "a", "dimensions": 12}, "dimensions"),
        ("/v1/embeddings", {"input": [[1] * (MAX_SEQ + 1)]}, None),  # the server's limit
        ("/v1/completions", {"prompt": "a"}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "model"),
        ("/v1/score", {"text_1": "a", "text_2": "b"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if param is None:
        assert error["code"] == "context_length_exceeded"


def test_rerank_bad_input(rerank_http):
    r = rerank_http.post("/v1/rerank", json={"query": "q", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    r = rerank_http.post("/v1/embeddings", json={"input": "a"})
    assert r.status_code == 400 and "runs score" in r.json()["error"]["message"]
