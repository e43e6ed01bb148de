"""A static batch: `generate` runs a batch of prompts through the rounds' executor.

`generate(engine, prompts, ...)` checks the batch up front and runs it through the same
executor and row book as continuous batching (`pipeline.scheduling.executor`): one admission of the
whole batch (one prefill), then decode chunks (each on device; the host only looks at the
new tokens between chunks, to stream them and to stop once every request has finished)
until every request has ended. It returns the completions with their own timing and the
cache. It sits above the engine, which runs programs and imports nothing of the rounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from qwen3_spmd.model.cache import KVCache
from qwen3_spmd.pipeline.batch.handles import Params, Request
from qwen3_spmd.pipeline.batch.rowbook import RowBook
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.requests import Completion, RequestError
from qwen3_spmd.pipeline.runtime.engine import Engine, to_host
from qwen3_spmd.pipeline.runtime.registry import Clock
from qwen3_spmd.pipeline.runtime.shapes import DecodeShape, PrefillShape
from qwen3_spmd.pipeline.scheduling.executor import Executor
from qwen3_spmd.pipeline.scheduling.planner import Accounting, Admission, Round, decode_chunk
from qwen3_spmd.pipeline.speculative.policy import drafting
from qwen3_spmd.pipeline.speculative.speculator import Speculator
from qwen3_spmd.pipeline.structured.constraints import Constraint, Grammars
from qwen3_spmd.ring import padded_length


@dataclasses.dataclass
class Generation:
    """What a static batch gives back: its completions, request 0's logits, its timing,
    its layout and the cache."""

    completions: list[Completion]
    first_logits: np.ndarray  # [steps, V] float32: request 0's logits at each generated token
    timing: dict  # compile_s, prefill_s, decode_s and tokens per second of this call
    layout: dict  # batch and prompt padding, microbatches, groups, chunks run
    cache: KVCache  # the cache as the last decode left it (slots of steps never run: -1)


def _timing(clock: Clock, prompt_tokens: int, new_tokens: int) -> dict:
    """A generate call's seconds and rates (`new_tokens` from decode steps)."""
    return {
        "compile_s": clock.compile_s,
        "prefill_s": clock.prefill_s,
        "decode_s": clock.decode_s,
        "prefill_tokens_per_s": prompt_tokens / clock.prefill_s if clock.prefill_s > 0 else 0.0,
        "decode_tokens_per_s": new_tokens / clock.decode_s if clock.decode_s > 0 else 0.0,
    }


def batch_rows(engine: Engine, n: int) -> tuple[int, int]:
    """(rows, groups) of the batch `generate` runs for n prompts: n rounded up so that
    each `data` replica's equal share of rows is a multiple of both the microbatches
    and the decode groups (the rows past n are padding; the book deals its rows to the
    replicas in turn, `pipeline.batch.replicas`)."""
    groups = engine.groups_for(n)
    unit = engine.D * math.lcm(engine.M, groups)
    return -(-n // unit) * unit, groups


def generate(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_ids: tuple[int, ...] = (),
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    with_logits: bool = True,
    constraint: Constraint | None = None,
    grammars: Grammars | None = None,
    speculator: Speculator | None = None,
) -> Generation:
    """Generates up to max_new_tokens tokens for each prompt: one prefill of the whole
    batch, then decode chunks until every request has ended, run by the same
    executor and row book as continuous batching (`pipeline.scheduling.executor`), so the
    decode inputs and the stop rule have one home. Request i samples with key
    (seed, i, step).

    with_logits=False skips collecting request 0's logits at every decode step
    (Generation.first_logits then holds the prefill step only).

    on_tokens, if given, is called after the prefill and after each decode chunk with
    every request's tokens so far (for streaming).

    constraint: what every answer must follow (a structured output), with `grammars`
    over the model's tokenizer: chunks of one step, each row's choice masked.

    speculator: decode rounds run as its policy decides (plain steps, verify passes),
    with the same tokens.
    """
    engine.check(prompts, max_new_tokens)
    if speculator is not None and engine.D > 1:
        raise RequestError(
            f"$speculative_config: speculation runs one replica, and the mesh has "
            f"{engine.D} (`data`): leave it out or use D = 1",
            "speculative_config",
        )
    if constraint is not None:
        if grammars is None:
            raise RequestError("a $constraint needs the model's grammars", "constraint")
        grammars.compile(constraint)
    n = len(prompts)
    rows, groups = batch_rows(engine, n)
    shape = PrefillShape(rows, padded_length(max(map(len, prompts)), engine.C))
    params = Params(max_new_tokens, sampling, seed, tuple(eos_ids), constraint=constraint)
    requests = [Request(i, tuple(p), params, sample_index=i) for i, p in enumerate(prompts)]
    # Rows past the prompts are copies of request 0 (its key too), dropped at the end.
    requests += [dataclasses.replace(requests[0], id=i) for i in range(n, shape.B)]
    book = RowBook(
        shape.B, groups, engine.C, engine.slots_per_device, engine.block_size, replicas=engine.D
    )
    clock, accounting = Clock(), Accounting()
    cache = engine.copies.empty_cache(shape.B, book.pages.pages)  # every row's most
    executor = Executor(
        engine, book, accounting, clock, cache=cache, grammars=grammars, speculator=speculator
    )
    policy = speculator.policy if speculator is not None else None
    sampled = sampling.temperature > 0
    constrained = constraint is not None
    if max_new_tokens > 1 and not constrained:
        engine.compile_decode_ahead(shape.B, groups, sampled, with_logits)
    tokens: list[list[int]] = [[] for _ in requests]
    finish = ["length"] * shape.B

    def take(updates):
        for u in updates:
            tokens[u.id] += u.tokens
            finish[u.id] = u.finish_reason or finish[u.id]
        if on_tokens:
            on_tokens(tokens[:n])

    strategy, predictions = engine.cp_plan(shape.B, shape.P_pad)
    admission = Admission(tuple(requests), tuple(range(shape.B)), shape, strategy)
    take(executor.admit(Round(admissions=(admission,))))
    step_logits = [to_host(executor.logits[:1])]
    chunks = 0
    decode = DecodeShape(shape.B, sampled, logprobs=False, constrained=constrained)
    while book.live():
        steps = min(engine.chunk, max(book.rows[b].steps_left for b in book.live()))
        rows = drafting({b: book.rows[b] for b in book.live()})
        # A speculative round runs passes or fewer steps: the layout counts a pass a step.
        chunk = decode_chunk(decode, steps, rows, policy, with_logits)
        take(executor.decode(Round(decode=chunk)))
        if with_logits:
            step_logits.append(to_host(executor.logits[: chunk.steps]))
        chunks += 1
    completions = [Completion(list(p), t, f) for p, t, f in zip(prompts, tokens, finish)]
    n_new = sum(len(c.token_ids) - 1 for c in completions)
    timing = _timing(clock, sum(map(len, prompts)), n_new)
    layout = {
        "batch": shape.B,
        "requests": n,
        "padded_prompt": shape.P_pad,
        "microbatches": engine.M,
        "groups": groups,
        "decode_steps": accounting.row_steps // shape.B,
        "chunks": chunks,
        "chunk": engine.chunk,
        "decode_ticks": accounting.decode_ticks,
        "verify_ticks": accounting.verify_ticks,
        "verify_positions": accounting.verify_positions,
        "cp_strategy": strategy,
        "cp": predictions,
    }
    first_logits = np.concatenate(step_logits)[: len(tokens[0])]
    return Generation(completions, first_logits, timing, layout, executor.cache)
