"""`embed`: inputs in, one JSON line each out, on the pooling runner.

    qwen3-spmd embed --model Qwen/Qwen3-Embedding-0.6B --input "a text" --input "another"
    qwen3-spmd embed --model Qwen/Qwen3-Reranker-0.6B --hf-overrides '{...}' \\
        --query "<formatted query>" --input "<formatted document>"

An embedding model prints {"index", "prompt_tokens", "embedding"} per input; a reranker
(with --query) {"index", "prompt_tokens", "score"} per document, in the order given.
Inputs come from --input and --input-ids, else from stdin, one a line.
"""

from __future__ import annotations

import json
import sys

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import CLIError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "embed", help="embeddings (Qwen3-Embedding) or scores (Qwen3-Reranker), a JSON line each"
    )
    EngineArgs.add_cli_args(
        p,
        "an embedding model's folder (sentence-transformers files), a reranker's with "
        "--hf-overrides, a hub id, or a preset (random weights); default: the demo",
        scheduler=True,
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="TEXT",
        help="an input as text (repeatable; tokenized with the tokenizer's post-processor)",
    )
    p.add_argument(
        "--input-ids",
        action="append",
        default=[],
        metavar="1,2,3",
        help="an input as comma-separated token ids (repeatable)",
    )
    p.add_argument(
        "--dimensions", type=int, help="a Matryoshka model's first d values, renormalised"
    )
    p.add_argument(
        "--prompt-name",
        metavar="NAME",
        help="put the model's named prompt (config_sentence_transformers.json: "
        "Qwen3-Embedding's query instruction is 'query') before each text input",
    )
    p.add_argument(
        "--query",
        metavar="TEXT",
        help="a reranker's query: each input is a document, scored against it",
    )
    p.set_defaults(func=main)


def main(args) -> int:
    if args.runner == "generate":
        raise CLIError("--runner generate: embed runs the pooling runner (leave --runner out)")
    inputs = _inputs(args)
    engine_args = EngineArgs.from_cli(args, runner="pooling")
    engine_args.check()
    built = engine_args.build()
    from qwen3_spmd.run import pooled

    pooling, text = built.pooling, built.spec.text()
    if args.query is not None:
        if pooling.task != "score":
            raise CLIError("--query scores documents, and this model embeds: leave it out")
        prompts = pooled.pairs(args.query, inputs, text, names=("query", "input"))
    else:
        if pooling.task != "embed":
            raise CLIError("a reranker scores documents against a --query: give one")
        pooling.check_dimensions(args.dimensions)
        if args.prompt_name is not None:
            prefix = pooling.prompt(args.prompt_name)
            inputs = [prefix + x if isinstance(x, str) else x for x in inputs]
        prompts = pooled.input_ids(inputs, text)
    try:
        hidden = pooled.run(built.engine, built.scheduler, prompts)
    finally:
        built.scheduler.close()
    for i, (p, h) in enumerate(zip(prompts, hidden)):
        line = {"index": i, "prompt_tokens": len(p)}
        if args.query is not None:
            line["score"] = pooling.score(h)
        else:
            line["embedding"] = pooling.embed(h, args.dimensions).tolist()
        print(json.dumps(line), flush=True)
    return 0


def _inputs(args) -> list:
    """--input texts and --input-ids lists in that order, else stdin's lines."""
    inputs: list = list(args.input)
    for text in args.input_ids:
        try:
            inputs.append([int(t) for t in text.split(",")])
        except ValueError:
            raise CLIError(f"--input-ids {text!r}: give comma-separated integers") from None
    if not inputs:
        if sys.stdin.isatty():
            raise CLIError("no input: give --input, --input-ids, or lines on stdin")
        inputs = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not inputs:
        raise CLIError("no input: stdin had no line")
    if args.query is not None and any(not isinstance(x, str) for x in inputs):
        raise CLIError("--query scores text documents: give them with --input")
    return inputs
