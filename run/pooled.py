"""Pooling requests, as every door (LLM, serve, `embed`) makes them: inputs to token
ids, the ids through the scheduler as prefill-only requests, their hidden states to
embeddings and scores (`pipeline.pooling.Pooling`).

Text is tokenized with the tokenizer's own post-processor (Qwen3-Embedding's appends
`<|endoftext|>`, the token its pooling reads); token ids go in as given. A reranker's
pair is the query's tokens followed by the document's (the tokenizer's pair encoding,
as vLLM scores a pair), each formatted by the client with the model card's template.
"""

from __future__ import annotations

import numbers

from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.requests import RequestError

POOLED = Params(max_new_tokens=0)  # a pooling request: its prompt's prefill only


def _need_text(text, field: str):
    if text is None:
        raise RequestError(
            f"text needs the model's tokenizer.json, and this model has none: send ${field} "
            "as token ids",
            field,
        )
    return text


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x
    )


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """ids cut to their last `keep` tokens (vLLM's truncate_prompt_tokens: the end is
    what last-token pooling reads); None or -1: as they are."""
    if keep is None or keep == -1:
        return ids
    if keep < 1:
        raise RequestError(
            f"$truncate_prompt_tokens {keep} must be at least 1 (or -1: no truncation)",
            "truncate_prompt_tokens",
        )
    return ids[-keep:]


def input_ids(inputs, text, field: str = "input", keep: int | None = None) -> list[list[int]]:
    """OpenAI's embeddings `input`: a string, a list of strings, token ids or a list of
    token-id lists -> one id list each (empty inputs refused, naming `field`)."""
    if isinstance(inputs, str) or _is_ids(inputs) and inputs:
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(
            f"${field} is empty: send a string, a list of strings, token ids or lists of them",
            field,
        )
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            if not x:
                raise RequestError(f"${field}[{i}] is an empty string: send some text", field)
            ids = _need_text(text, field).encode(x, add_special_tokens=True)
        elif _is_ids(x):
            if not x:
                raise RequestError(f"${field}[{i}] is an empty list of token ids", field)
            ids = [int(t) for t in x]
        else:
            raise RequestError(
                f"${field}[{i}] is {type(x).__name__}: each input is a string or a list of "
                "token ids",
                field,
            )
        out.append(truncated(ids, keep))
    return out


def pairs(
    first, second, text, keep: int | None = None, names=("text_1", "text_2")
) -> list[list[int]]:
    """vLLM's score pairs: `first` (text_1, a query) and `second` (text_2, documents),
    each a string or a list of them; one first against every second (1:N), or pairwise
    (N:N) -> each pair's ids: the first's tokens, then the second's. names: the two
    fields as the caller spells them (rerank's query and documents)."""
    first = [first] if isinstance(first, str) else first
    second = [second] if isinstance(second, str) else second
    for name, side in zip(names, (first, second)):
        if not isinstance(side, list) or not side or not all(isinstance(s, str) for s in side):
            raise RequestError(f"${name} must be a non-empty string or list of strings", name)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestError(
            f"${names[0]} has {len(first)} texts and ${names[1]} {len(second)}: send one "
            f"{names[0]}, or as many as {names[1]}",
            names[0],
        )
    t = _need_text(text, names[0])
    out = []
    for a, b in zip(first, second):
        if not a or not b:
            raise RequestError(
                f"${names[0]} or ${names[1]} has an empty text: send some text in each",
                names[1] if a else names[0],
            )
        out.append(truncated(t.tokenizer.encode(a, b, add_special_tokens=True).ids, keep))
    return out


def check_all(check, prompts: list[list[int]]) -> None:
    """Each prompt through `check` (`Engine.check`'s signature) as a pooling request,
    before any is queued; a refusal says which prompt (RequestError.at_prompt)."""
    for i, p in enumerate(prompts):
        try:
            check([p], 0)
        except RequestError as e:
            raise e.at_prompt(i) from None


def run(engine, scheduler, prompts: list[list[int]]) -> list:
    """Each prompt's hidden state through `scheduler` (on `engine`, a pooling runner's):
    all checked before any runs (RequestError of prompt i), then queued as room frees
    (a batch larger than the queue goes in as the rounds run), then run to their ends."""
    from qwen3_spmd.pipeline.scheduling.scheduler import QueueFull

    check_all(engine.check, prompts)
    handles = []
    for p in prompts:
        while True:
            try:
                handles.append(scheduler.submit(p, POOLED))
                break
            except QueueFull:
                scheduler.step()
    for h in handles:
        for _ in h:  # runs rounds (or waits for the background loop) until done
            pass
    return [h.pooled for h in handles]
