"""`bench`: jit-compiled benchmarks of the engine, against the machine's own rooflines
and (optionally) Hugging Face transformers, in one run.

Scenarios (--scenario, repeatable; default all but peer):
  prefill   tokens/s per prompt length (batch --prefill-batch), fraction of the matmul
            roofline, the stage pipeline's idle fraction and the bytes moved per token;
  decode    tokens/s and time per output token per batch size, fraction of the
            bandwidth roofline, idle fraction and bytes moved per token;
  memory    per-device weights and KV cache (addressable shards) and XLA's buffers
            (memory_analysis() of every compiled program);
  roofline  memory bandwidth and matmul throughput measured on this machine;
  peer      the same prompts through transformers' Qwen3ForCausalLM (--peer);
  prompt_logprobs  each prompt length's prefill with the prompt's log-probabilities
            (every token scored, as evaluation harnesses ask) against without, and the
            ratio (run.bench.scoring);
  speculative  decode per batch size with speculation against plain: an oracle drafter
            (every draft accepted) for each k of --spec-tokens, an always-wrong one and
            ngram, tokens/s and acceptance, each run's tokens checked against plain
            decoding's (run.bench.speculative);
  embed     the pooling runner: --embed-inputs inputs of --embed-lens tokens through the
            scheduler (input tokens/s), and one longest input's prefill memory per
            device; with --peer, sentence-transformers' loop on transformers
            (run.bench.embed);
  paged     the paged KV cache under a served load: --serve-requests x
            --serve-max-batch requests, that many in flight, over a pool of
            --kv-cache-memory-bytes, against the same load and pool through 2 rows:
            tokens/s, the most decoding at once, preemptions, the same tokens in both
            (run.bench.paged);
  structured  a closed loop at the scheduler's rows of bounded-JSON-Schema requests
            against the same load unconstrained and with half of it constrained:
            output tokens/s, the host's mask time a token, the others' time per output
            token (run.bench.serve.structured_job; needs the model's tokenizer, or
            Qwen3's vocabulary).
Every --mesh runs each job, once per --cp strategy where C > 1 (the seq attention:
ring, ulysses or auto; each prefill job then reports the bytes each device received
along seq and pipeline.runtime.cp_cost's predicted time next to the measured one; roofline then
also measures ppermute and all-to-all bandwidth over the seq devices, which the
prediction uses); 1x1 always runs too and each other mesh reports its time
ratio against it (mesh / 1x1, same job, same process). Each job compiles first (timed
apart), then runs --warmup more times untimed and --repeats times timed: the median is
quoted with (min, max).

This module holds the flags and their checks; the two benchmarks are run.bench.meshes
(the engine in this process) and run.bench.endpoint (--url: an endpoint over HTTP).
"""

from __future__ import annotations

from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import CLIError, byte_count, int_list

SCENARIOS = (
    "prefill",
    "decode",
    "memory",
    "roofline",
    "peer",
    "serve",
    "prompt_logprobs",
    "speculative",
    "structured",
    "embed",
    "paged",
)
SMOKE = {
    "prompt_lens": "16,32",
    "batches": "1,2",
    "decode_steps": 4,
    "repeats": 2,
    "chunk": 4,
    "serve_max_batch": 2,
    "serve_prompt_lens": "3,12",
    "serve_output_lens": "2,6",
    "serve_requests": 1,
    "spec_tokens": "2",
    "embed_inputs": 3,
    "embed_lens": "8,24",
}


# Long because it is the flag list, one add_argument per flag in --help's order.
def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark prefill and decode against rooflines and transformers"
    )
    EngineArgs.add_cli_args(
        p,
        "checkpoint folder, hub id (Qwen/Qwen3-0.6B: downloaded on first use) or preset "
        "(tiny, 0.6B, ...; random weights); default: tiny",
        bench=True,
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        default=[],
        help="repeatable; default: prefill, decode, memory, roofline "
        "(and peer when --peer is given)",
    )
    p.add_argument("--prompt-lens", help="prompt lengths for prefill (default 128,512,2048)")
    p.add_argument("--prefill-batch", type=int, default=1, help="requests per prefill job")
    p.add_argument("--batches", help="decode batch sizes (default 1,8,32)")
    p.add_argument(
        "--decode-prompt-len",
        type=int,
        help="prompt length before the decode steps (default: the shortest --prompt-lens)",
    )
    p.add_argument("--decode-steps", type=int, help="decode steps timed per job (default 32)")
    p.add_argument(
        "--spec-tokens",
        metavar="K,...",
        help="speculative: the oracle drafter's draft tokens a pass (default 2,4,8)",
    )
    p.add_argument(
        "--decode-cache-len",
        type=int,
        help="KV cache slots per request in decode jobs, as a server sized for "
        "long requests has (default: just enough for the prompt and steps)",
    )
    p.add_argument("--repeats", type=int, help="timed runs per job (default 5)")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed runs per job after the compiling one (default 1)",
    )
    p.add_argument(
        "--peer",
        choices=("transformers",),
        help="also run Hugging Face transformers on the same weights and prompts",
    )
    p.add_argument(
        "--serve-max-batch",
        type=int,
        help="serve, structured: the scheduler's decode rows (default 8)",
    )
    p.add_argument(
        "--serve-prompt-lens",
        metavar="MIN,MAX",
        help="serve, structured: prompt lengths, uniform in the range (default 16,512)",
    )
    p.add_argument(
        "--serve-output-lens",
        metavar="MIN,MAX",
        help="serve, structured: output tokens per request, uniform in the range (default 16,256)",
    )
    p.add_argument(
        "--serve-requests",
        type=int,
        help="serve, structured: requests per unit of concurrency in each closed loop (default 2)",
    )
    p.add_argument(
        "--serve-shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="serve: also the prefix cache against none, on 16 requests that share an "
        "N-token system prompt, 4 conversations of 4 turns, and the unshared load "
        "(default 0: not run)",
    )
    p.add_argument("--embed-inputs", type=int, help="embed: inputs submitted at once (default 256)")
    p.add_argument(
        "--embed-lens",
        metavar="MIN,MAX",
        help="embed: input lengths in tokens, uniform in the range (default 32,512)",
    )
    p.add_argument(
        "--url",
        metavar="URL|local",
        help="serve: load this OpenAI-compatible endpoint over HTTP instead of the "
        "scheduler in-process ('local': start `qwen3-spmd serve` on --model and the first "
        "--mesh for the run); with --peer transformers, `transformers serve` too",
    )
    p.add_argument("--api-key", help="with --url: the endpoint's API key")
    p.add_argument(
        "--serve-concurrency",
        metavar="1,8",
        help="with --url: requests in flight, each level a load of its own (default 1,8)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights (presets) and prompt ids")
    p.add_argument(
        "--layers",
        type=int,
        metavar="L",
        help="a preset cut to its first L layers (full width, random weights)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="read compiled programs from DIR (and keep new ones there), so that a rerun "
        "measures running only: compile_s then times the reads (default: off, every "
        "program compiles and compile_s is the compile; --url local: the server's "
        "--compile-cache, default serve's)",
    )
    p.add_argument(
        "--targets",
        action="store_true",
        help="also print the project's performance targets and whether this run met them "
        "(the JSON always carries them)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="throughput against prompt length per mesh, and the pipeline timeline",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes for tests: prompts 16,32, batches 1,2, 4 steps, 2 repeats (--url "
        "local: a server that compiles each program when first needed)",
    )
    p.set_defaults(func=main)


def _ints(text: str, flag: str) -> list[int]:
    xs = int_list(text, flag)
    if not xs or min(xs) < 1:
        raise CLIError(f"{flag} {text!r} needs positive integers")
    return xs


def _range(text: str, flag: str) -> tuple[int, int]:
    values = _ints(text, flag)
    if len(values) != 2 or values[0] > values[1]:
        raise CLIError(f"{flag} {text}: give MIN,MAX with 1 <= MIN <= MAX, e.g. 16,512")
    return values[0], values[1]


def _settings(args) -> dict:
    smoke = SMOKE if args.smoke else {}

    def given(value, name: str, default):  # a flag given as 0 stays 0 (and is refused)
        return value if value is not None else smoke.get(name, default)

    s = {
        "prompt_lens": _ints(
            given(args.prompt_lens, "prompt_lens", "128,512,2048"), "--prompt-lens"
        ),
        "batches": _ints(given(args.batches, "batches", "1,8,32"), "--batches"),
        "decode_steps": given(args.decode_steps, "decode_steps", 32),
        "repeats": given(args.repeats, "repeats", 5),
        "warmup": args.warmup,
        "chunk": given(args.chunk, "chunk", 16),
        "microbatches": args.microbatches,
        "groups": args.groups,
        "prefill_batch": args.prefill_batch,
        "seed": args.seed,
        "expert_split": args.expert_split,
        "block_size": args.block_size,
        "kv_cache_memory_bytes": (
            None
            if args.kv_cache_memory_bytes is None
            else byte_count(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
        ),
        "smoke": bool(args.smoke),
        "decode_cache_len": args.decode_cache_len,
        "serve_max_batch": given(args.serve_max_batch, "serve_max_batch", 8),
        "serve_prompt_lens": _range(
            given(args.serve_prompt_lens, "serve_prompt_lens", "16,512"), "--serve-prompt-lens"
        ),
        "serve_output_lens": _range(
            given(args.serve_output_lens, "serve_output_lens", "16,256"), "--serve-output-lens"
        ),
        "serve_requests_per_concurrency": given(args.serve_requests, "serve_requests", 2),
        "serve_shared_prefix": args.serve_shared_prefix,
        "spec_tokens": _ints(given(args.spec_tokens, "spec_tokens", "2,4,8"), "--spec-tokens"),
        "embed_inputs": given(args.embed_inputs, "embed_inputs", 256),
        "embed_lens": _range(given(args.embed_lens, "embed_lens", "32,512"), "--embed-lens"),
    }
    s["decode_prompt_len"] = (
        args.decode_prompt_len if args.decode_prompt_len is not None else min(s["prompt_lens"])
    )
    for name, flag in (
        ("decode_steps", "--decode-steps"),
        ("repeats", "--repeats"),
        ("chunk", "--chunk"),
        ("microbatches", "--microbatches"),
        ("prefill_batch", "--prefill-batch"),
        ("decode_prompt_len", "--decode-prompt-len"),
        ("serve_max_batch", "--serve-max-batch"),
        ("serve_requests_per_concurrency", "--serve-requests"),
        ("embed_inputs", "--embed-inputs"),
    ):
        if s[name] < 1:
            raise CLIError(f"{flag} {s[name]} must be at least 1")
    if s["warmup"] < 0:
        raise CLIError(f"--warmup {s['warmup']} must not be negative")
    if s["serve_shared_prefix"] < 0:
        raise CLIError(f"--serve-shared-prefix {s['serve_shared_prefix']} must not be negative")
    if s["decode_cache_len"] is not None:
        from qwen3_spmd.run.bench.measure import decode_cache_len

        decode_cache_len(s, 1)  # too small for one device is too small for any mesh
    return s


def main(args) -> int:
    """The benchmark the flags ask for: an endpoint over HTTP (--url), or the engine in
    this process on every --mesh."""
    if args.url:
        if set(args.scenario) - {"serve"}:
            raise CLIError("--url measures an HTTP endpoint: only --scenario serve goes with it")
        settings = _settings(args)
        concurrencies = _ints(args.serve_concurrency or "1,8", "--serve-concurrency")
        from qwen3_spmd.run.bench.endpoint import bench_endpoint

        return bench_endpoint(args, settings, concurrencies)
    settings = _settings(args)
    from qwen3_spmd.run.bench.meshes import bench_meshes

    return bench_meshes(args, settings)
