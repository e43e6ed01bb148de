"""`qwen3-spmd serve`: flags, start-up and shutdown of the HTTP server.

Start-up binds the port first (a taken port fails at once), answers `/health` with
503 while a background thread loads the weights, builds the scheduler, compiles the
programs a first light load meets and a cover of stand-ins for the others
(`--precompile first`, the default: `ShapeRules.first`; `all`: every program its rounds can run; `lazy`: none, the warm-up
request compiles its own) and runs one warm-up request, then serves; with `first` the
other programs compile on a background thread meanwhile, the likeliest first and
structured outputs' and speculation's last. With
several processes
process 0 serves HTTP and every other process runs the same rounds from its
decisions (`Scheduler.follow`). SIGTERM or Ctrl-C: new requests get 503, the running
ones have --shutdown-timeout seconds to finish, the rest end with an error event, and
the server exits 0 (a second signal exits at once).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time

from qwen3_spmd.run.cpu_threads import CompileThreads, lower_priority
from qwen3_spmd.run.engine_args import EngineArgs
from qwen3_spmd.run.flags import CLIError, in_flags, json_object

# A server that closes an idle connection while a client reuses it fails that request
# ("server disconnected without a response"): the server must wait longer than clients
# keep idle connections (httpx 5 s, aiohttp 15 s). uvicorn's own default is 5 s.
KEEP_ALIVE_S = 30.0


# Long because it is the flag list, one add_argument per flag in --help's order.
def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    EngineArgs.add_cli_args(
        p,
        "Hugging Face checkpoint folder, orbax folder, hub id (Qwen/Qwen3-0.6B: downloaded "
        "on first use, served under that name), or a preset name (random weights); "
        "default: the demo, tiny with Qwen3's tokenizer and random weights",
        scheduler=True,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0: any)")
    p.add_argument(
        "--served-model-name",
        help="the model name clients send (default: the hub id, the folder's or the preset's name)",
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM (default 30)",
    )
    p.add_argument(
        "--keep-alive",
        type=float,
        default=KEEP_ALIVE_S,
        help="seconds an idle client connection stays open; keep it above the clients' own "
        f"idle expiry (default {KEEP_ALIVE_S:g})",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=("qwen3",),
        help="qwen3: a chat reply's <think>...</think> goes to message.reasoning_content "
        "(streamed as delta.reasoning_content), the rest to content (default: all content)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes",),
        help="hermes (Qwen3's format): <tool_call>{...}</tool_call> in a chat reply becomes "
        "message.tool_calls, finish_reason tool_calls (default: requests with tools are "
        "refused unless tool_choice is none)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the chat template's arguments for every chat request, as a JSON object, e.g. "
        "'{\"enable_thinking\": false}' to serve Qwen3 without thinking; a request's own "
        "chat_template_kwargs win (default: none)",
    )
    p.add_argument(
        "--precompile",
        default="first",
        choices=("first", "all", "lazy"),
        help="first: compile at start what a first light load meets (one request at a time, "
        "short prompts) and a few shapes that stand in for the others (longer padding, more "
        "decode rows), the rest on a background thread while serving, the likeliest "
        "first; all: compile every program the server can run before serving, so no request "
        "ever waits for a compile (a slow start); lazy: compile each when first needed (a "
        "request of a new shape stalls the running ones while it compiles). Default first",
    )
    p.set_defaults(func=main)


def main(args) -> int:
    _check_flags(args)  # before JAX loads: a wrong value is answered at once
    engine_args = EngineArgs.from_cli(args)
    return engine_args.launch(args, lambda runtime: _serve(args, engine_args, runtime))


def _check_flags(args) -> None:
    """serve's own flags (EngineArgs.check has the engine's)."""
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port {args.port} must be in [0, 65535]")
    if not args.shutdown_timeout >= 0:
        raise CLIError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0 seconds")
    if not args.keep_alive > 0:
        raise CLIError(f"--keep-alive {args.keep_alive} must be > 0 seconds")


def _json_object(text: str) -> dict:
    """A flag's JSON object (argparse names the flag in its one-line error)."""
    try:
        return json_object(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _serve(args, engine_args: EngineArgs, runtime) -> int:
    from qwen3_spmd.model.split import TensorSplit
    from qwen3_spmd.run.serve.app import ServerState

    procs, shape = runtime.procs, runtime.shape
    spec = engine_args.open_model()  # no --model: the demo, which speaks through a tokenizer
    text = spec.text()
    name = (
        args.served_model_name
        or spec.hub_id
        or (spec.folder.name if spec.folder else (args.model or "tiny"))
    )
    max_seq_len = engine_args.seq_len(spec.cfg, shape.seq)
    # before the port is taken
    TensorSplit.of(shape.tensor, shape.data, args.expert_split).check(spec.cfg)
    runner = engine_args.runner_for(spec)
    if not procs.leader:
        scheduler = _load(args, engine_args, spec, runtime, max_seq_len, runner)
        _follow_signals()
        scheduler.follow()
        scheduler.close()  # waits for a background compile under way
        return 0
    sock = _bind(args.host, args.port)  # before loading: a taken port fails at once
    state = ServerState(
        name,
        args.api_key,
        text=text,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        closed_objects=engine_args.structured_outputs().disable_additional_properties,
    )

    def load():
        try:
            scheduler = _load(args, engine_args, spec, runtime, max_seq_len, runner)
            pooling = engine_args.pooling(spec, scheduler.engine)
            state.service = _service(scheduler, spec, text, name, max_seq_len, pooling)
            state.status = "ready"
            host, port = sock.getsockname()[:2]
            what = f"the pooling runner: {pooling.task}, " if pooling is not None else ""
            _say(
                f"serving {name} on http://{host}:{port}/v1 ({what}mesh {runtime.mesh_text}, "
                f"{max_seq_len} tokens per request, {scheduler.B} rows)"
            )
        except Exception as e:  # the server ends, saying why
            state.status = "failed"
            _say(f"error: {in_flags(e)}")
            server.should_exit = True

    from qwen3_spmd.run.serve.http import Server

    server = Server(state, args.shutdown_timeout, args.keep_alive)
    loader = threading.Thread(target=load, name="load", daemon=True)
    loader.start()
    server.run(sockets=[sock])
    if state.service is not None:
        state.service.scheduler.close()  # followers stop too
    return 2 if state.status == "failed" else 0


def _follow_signals() -> None:
    """A follower stops when process 0 does (it drains, then tells the followers): a
    SIGTERM or Ctrl-C here is noted, a second one ends this process at once."""
    seen = []

    def note(sig, frame):
        if seen:
            os._exit(128 + sig)
        seen.append(sig)
        _say("signal noted: this process stops when process 0 does (again: now)")

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise CLIError(
            f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _load(args, engine_args: EngineArgs, spec, runtime, max_seq_len: int, runner: str):
    """Weights on the mesh, the scheduler, and its first programs compiled."""
    from qwen3_spmd.pipeline.batch.handles import Params
    from qwen3_spmd.pipeline.scheduling.decisions import SharedDecisions
    from qwen3_spmd.pipeline.structured.constraints import Grammars
    from qwen3_spmd.run.pooled import POOLED

    procs = runtime.procs
    engine_args.check_serving(runtime.shape)
    mesh = runtime.mesh()
    if procs.leader:
        _say(f"loading {spec.label} onto mesh {runtime.mesh_text} ({engine_args.dtype_name()})")
    announce = _compiling if procs.leader else None
    engine = engine_args.engine(
        spec.cfg, spec.source, mesh, max_seq_len, on_compile=announce, runner=runner
    )
    decisions = SharedDecisions(args.peer_timeout) if procs.many else None
    grammars = speculator = None  # the pooling runner's requests generate nothing
    if not engine.pooling:
        grammars = Grammars.of_text(spec.text(), spec.cfg.V, spec.eos_ids())
    if grammars is not None:  # its tokenizer (seconds for Qwen3's) made while compiling
        threading.Thread(target=lambda: grammars.tokenizer, daemon=True).start()
    # Structured outputs: every process runs the same matchers on the same tokens.
    if not engine.pooling:
        speculator = engine_args.speculator(engine, on_compile=announce)
    scheduler = engine_args.scheduler(
        engine, procs.many, decisions, speculator=speculator, grammars=grammars
    )
    if procs.leader:
        _say(scheduler.pool_line())
    # Every process compiles the same programs, each its own (compiling is local).
    first, rest = scheduler.rules.first()
    if grammars is not None:  # structured outputs' programs: the last to compile
        rest += scheduler.rules.constrained_decodes()
    if speculator is not None:  # and the verify passes
        rows = scheduler.rules.decode_row_counts()
        rest += speculator.shapes(rows, constrained=grammars is not None)
    now = {"first": first, "all": first + rest, "lazy": []}[args.precompile]
    later = rest if args.precompile == "first" else []
    threads = CompileThreads()  # the compiles' threads, found by what they do
    if now:
        _precompile(scheduler, now, len(first) + len(rest), procs.leader)
    threads.compiled()
    if procs.leader:  # one request end to end (lazy: it compiles the first programs)
        warm = scheduler.submit([0], POOLED if engine.pooling else Params(max_new_tokens=2))
        scheduler.run()
        list(warm)
        threads.ran()
        scheduler.start()
    if later:
        scheduler.compile_later(
            later,
            _compiled_later(len(later)) if procs.leader else None,
            on_start=_lowest_priority(threads.found(), procs.leader),
        )
    return scheduler


def _lowest_priority(compile_threads: set[int], leader: bool):
    """compile_later's on_start: XLA's compile threads and the compiling thread itself
    at the lowest CPU priority, so that rounds take the cores first (run.cpu_threads)."""

    def lower() -> None:
        n = len(lower_priority(compile_threads | {threading.get_native_id()}))
        if leader:
            _say(f"the other programs compile at the lowest CPU priority ({n} threads)")

    return lower


def _precompile(scheduler, shapes: list, total: int, leader: bool) -> None:
    """Compiles `shapes` (of `total` the rounds can run) before serving: on a terminal a
    bar counts them ("k of N"), and a line says what it took."""
    from qwen3_spmd.run.progress import Progress

    some = f"{len(shapes)} of {total}" if len(shapes) < total else f"{total}"
    if leader:
        _say(f"compiling {some} program shapes before serving")
    progress = Progress(enabled=leader)
    count = progress.counter("compiling program shapes", len(shapes))
    t0 = time.perf_counter()
    try:
        scheduler.precompile(shapes, on_compiled=count, announce=False)
    finally:
        progress.stop()
    if leader:
        rest = (
            f"; the other {total - len(shapes)} "
            f"{'compiles' if total - len(shapes) == 1 else 'compile'} while serving"
            if len(shapes) < total
            else ""
        )
        _say(f"compiled {some} program shapes in {time.perf_counter() - t0:.0f} s{rest}")


def _compiled_later(total: int):
    """compile_later's on_done: one line when the background compiles end."""

    def done(n: int, seconds: float, errors: list[str]) -> None:
        failed = f" ({len(errors)} failed, the first {errors[0]})" if errors else ""
        if n < total:
            _say(f"stopped compiling in the background after {n} of {total} program shapes")
        else:
            took = f"in the background in {seconds:.0f} s{failed}"
            shapes = "program shape" if n == 1 else f"{n} program shapes"
            _say(f"compiled the other {shapes} {took}")

    return done


def _compiling(name):
    _say(f"compiling {name}")
    return contextlib.nullcontext()


def _service(scheduler, spec, text, name: str, max_seq_len: int, pooling=None):
    from qwen3_spmd.run.serve.service import Service, Settings

    def decode(ids):
        if text is None:
            return "".join(f"<|id:{i}|>" for i in ids)
        return text.decode(ids, skip_special=True)

    settings = Settings(
        model_name=name,
        max_seq_len=max_seq_len,
        vocab=spec.cfg.V,
        eos_ids=spec.eos_ids(),
        defaults=_default_sampling(spec),
        check=scheduler.engine.check,
    )
    return Service(scheduler, decode, settings, pooling)


def _default_sampling(spec):
    """A request's sampling when it names none: generation_config.json's (as vLLM), else
    the OpenAI API's (temperature 1)."""
    from qwen3_spmd.pipeline.programs.sampling import Sampling

    config = spec.generation_config()
    if config and not config.get("do_sample", False):
        return Sampling()
    return Sampling(
        temperature=float(config.get("temperature", 1.0)),
        top_k=int(config.get("top_k", 0) or 0),
        top_p=float(config.get("top_p", 1.0)),
    )
