"""The pooling runner's endpoints: OpenAI's POST /v1/embeddings, vLLM's /v1/score and
/v1/rerank (Cohere's and Jina's shape), their request bodies and answers.

Each input (or pair) is one scheduler request that prefills and ends with its last
token's hidden state (`Service.pool`); `pipeline.pooling.Pooling` makes the embedding
or the score of it. An embedding goes out as floats, or with encoding_format "base64"
as the base64 of its little-endian float32 bytes (what the `openai` client asks for
unless told otherwise, and decodes).
"""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import BaseModel, ConfigDict

from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.run import pooled
from qwen3_spmd.run.serve import protocol
from qwen3_spmd.run.serve.protocol import APIError


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, with vLLM's truncate_prompt_tokens."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None


class ScoreRequest(BaseModel):
    """vLLM's /v1/score body: text_1 against text_2 (1:1, 1:N or N:N)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class Document(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """vLLM's /v1/rerank body, Cohere's and Jina's shape: documents as strings or
    {"text": ...}; top_n (None or 0: all) of them back, the best first."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str
    documents: list[str | Document]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


def _refused(e: RequestError) -> APIError:
    """A 400 for run.pooled's refusals, naming the field (the names are the API's)."""
    return APIError(400, e.spelled({}), e.param, "invalid_value")


def _usage(prompts: list[list[int]]) -> dict:
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n}


def _pooling(service, task: str):
    """The server's Pooling when it does `task`, else a 400 saying what it serves."""
    pooling = service.pooling
    if pooling is not None and pooling.task == task:
        return pooling
    wanted = {
        "embed": "an embedding model (--runner pooling)",
        "score": "a reranker (--runner pooling with the reranker's --hf-overrides)",
    }[task]
    serves = "generates text" if pooling is None else f"runs {pooling.task}"
    raise APIError(
        400,
        f"this endpoint needs a server of {wanted}, and this one {serves}",
        "model",
        "invalid_value",
    )


async def embeddings(service, text, name: str, body: EmbeddingRequest) -> dict:
    pooling = _pooling(service, "embed")
    try:
        pooling.check_dimensions(body.dimensions)
        prompts = pooled.input_ids(body.input, text, "input", body.truncate_prompt_tokens)
    except RequestError as e:
        raise _refused(e) from None
    hidden = await service.pool(prompts, "input")
    data = []
    for i, h in enumerate(hidden):
        e = pooling.embed(h, body.dimensions)
        if body.encoding_format == "base64":
            value = base64.b64encode(e.astype("<f4").tobytes()).decode()
        else:
            value = e.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "id": protocol.new_id("embd"),
        "object": "list",
        "created": protocol.now(),
        "model": name,
        "data": data,
        "usage": _usage(prompts),
    }


async def _scores(service, text, first, second, keep, names) -> tuple[list[float], list]:
    pooling = _pooling(service, "score")
    try:
        prompts = pooled.pairs(first, second, text, keep, names)
    except RequestError as e:
        raise _refused(e) from None
    hidden = await service.pool(prompts, names[1])
    return [pooling.score(h) for h in hidden], prompts


async def score(service, text, name: str, body: ScoreRequest) -> dict:
    scores, prompts = await _scores(
        service, text, body.text_1, body.text_2, body.truncate_prompt_tokens, ("text_1", "text_2")
    )
    return {
        "id": protocol.new_id("score"),
        "object": "list",
        "created": protocol.now(),
        "model": name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(prompts),
    }


async def rerank(service, text, name: str, body: RerankRequest) -> dict:
    if body.top_n is not None and body.top_n < 0:
        raise APIError(400, f"top_n {body.top_n} must be >= 0 (0: all)", "top_n", "invalid_value")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, prompts = await _scores(
        service, text, body.query, documents, body.truncate_prompt_tokens, ("query", "documents")
    )
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties by index
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    n = sum(len(p) for p in prompts)
    return {
        "id": protocol.new_id("rerank"),
        "model": name,
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": results,
    }
