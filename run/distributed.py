"""Several processes, one mesh: start-up and failures of `jax.distributed`.

`add_flags(parser)` adds `--coordinator HOST:PORT --num-processes N --process-id I`,
`--distributed auto` (cluster detection: SLURM and the like) and `--peer-timeout S`;
`start(args)` joins the processes before anything touches a JAX backend and returns
who we are (`Processes`). `bench` reuses both.

Failures. JAX's coordination client ends a process with a fatal log (SIGABRT and a
C++ stack trace on stderr) whenever the runtime fails: a peer that stops sending
heartbeats, a coordinator that is gone or never answers, a process id the coordinator
does not expect. It does so within the heartbeat or initialisation timeout, also from
inside a blocked collective, so nothing hangs; but what it prints is many lines in
each process. So a multi-process run is supervised: `supervise(args)` re-runs the
same command as a child whose native stderr (XLA and gloo logs) goes into a pipe,
while Python's own stderr (our one-line errors, the progress bar, --debug
tracebacks) stays the terminal. When the child dies of a signal, the parent reads
the runtime's last fatal message and prints one line that names the lost process
and the coordinator's address: exit 1 for a lost peer, 2 for a start-up that could
not happen (bad flags, unreachable coordinator, processes that do not match).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

from qwen3_spmd.run.flags import CLIError

WORKER_ENV = "QWEN3_SPMD_WORKER"  # in the supervised child: "<real stdout fd>,<real stderr fd>"
_JOINING = "qwen3-spmd joining\n"  # the child's reports to its parent (on the native stderr)
_JOINED = "qwen3-spmd joined "
_JOIN_GRACE_S = 3  # beyond --peer-timeout: the runtime's own give-up takes several more seconds
DEFAULT_PEER_TIMEOUT = 60


def add_flags(parser) -> None:
    g = parser.add_argument_group(
        "several processes (jax.distributed; each process runs the same command)"
    )
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of process 0, which runs the coordination service",
    )
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, 0 .. N-1")
    g.add_argument(
        "--distributed",
        choices=["auto"],
        help="auto: let jax.distributed.initialize() detect the cluster (SLURM, Open MPI, ...)",
    )
    g.add_argument(
        "--peer-timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT,
        metavar="S",
        help="seconds to wait for every process to join, and after which a silent "
        f"peer counts as lost (default {DEFAULT_PEER_TIMEOUT})",
    )


@dataclasses.dataclass(frozen=True)
class Processes:
    index: int  # jax.process_index()
    count: int  # jax.process_count()
    coordinator: str | None  # HOST:PORT, None for a single process
    hosts: tuple[str, ...] = ()  # hostname of each process

    @property
    def leader(self) -> bool:
        """Process 0: the one that prints results."""
        return self.index == 0

    @property
    def many(self) -> bool:
        return self.count > 1


SINGLE = Processes(0, 1, None, (socket.gethostname(),))


def requested(args) -> bool:
    return bool(
        args.distributed
        or args.coordinator
        or args.num_processes is not None
        or args.process_id is not None
    )


def check_flags(args) -> None:
    """The flags alone, in words, before any process starts to wait for another."""
    if not 0 < args.peer_timeout < float("inf"):  # NaN fails too
        raise CLIError(f"--peer-timeout {args.peer_timeout:g} must be a positive number of seconds")
    if not requested(args):
        return
    if args.distributed == "auto":
        return  # flags given with auto override what detection finds
    missing = [
        f
        for f, v in (
            ("--coordinator", args.coordinator),
            ("--num-processes", args.num_processes),
            ("--process-id", args.process_id),
        )
        if v is None
    ]
    if missing:
        raise CLIError(
            f"several processes need --coordinator HOST:PORT --num-processes N "
            f"--process-id I, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing (or pass "
            "--distributed auto on a cluster that JAX detects)"
        )
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CLIError(
            f"--coordinator {args.coordinator!r} is not HOST:PORT "
            "(e.g. 10.0.0.1:1234, the address of process 0)"
        )
    if args.num_processes < 1:
        raise CLIError(f"--num-processes {args.num_processes} must be at least 1")
    if not 0 <= args.process_id < args.num_processes:
        raise CLIError(
            f"--process-id {args.process_id} is not among the {args.num_processes} "
            f"processes of --num-processes {args.num_processes}: use 0 .. "
            f"{args.num_processes - 1}"
        )


def start(args) -> Processes:
    """Joins the job (if flags ask for one). Call before any JAX backend is used.

    Every process waits at most --peer-timeout seconds for the others to join; after
    that, a peer silent for --peer-timeout seconds ends the job.
    """
    check_flags(args)
    if not requested(args):
        return SINGLE
    import jax

    # The preemption service polls the coordinator too and only adds noise when a
    # peer is lost; failures reach us through the heartbeat either way.
    jax.config.update("jax_enable_preemption_service", False)
    t = max(1, round(args.peer_timeout))
    kwargs = dict(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=t,
        heartbeat_timeout_seconds=t,
        shutdown_timeout_seconds=t,
    )
    known = inspect.signature(jax.distributed.initialize).parameters
    if os.environ.get(WORKER_ENV):
        os.write(2, _JOINING.encode())
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in known})
    from jax._src import distributed as _dist  # the client, for the host names

    state = _dist.global_state
    me, n = state.process_id, state.num_processes
    address = state.coordinator_address or args.coordinator
    hosts = _exchange_hosts(state.client, me, n, t)
    procs = Processes(me, n, address, hosts)
    _report_joined(procs)
    return procs


def finish(procs: Processes) -> None:
    """Leaves the job together: without this, process 0 (which hosts the coordinator)
    may exit while a peer still talks to it, and that peer dies of a lost coordinator."""
    if procs.many:
        import jax

        jax.distributed.shutdown()


def _exchange_hosts(client, me: int, n: int, timeout_s: int) -> tuple[str, ...]:
    client.key_value_set(f"qwen3-spmd/host/{me}", socket.gethostname())
    return tuple(
        client.blocking_key_value_get(f"qwen3-spmd/host/{i}", timeout_s * 1000) for i in range(n)
    )


def _report_joined(procs: Processes) -> None:
    """Tells a supervising parent who we are (on the native stderr, which it reads)."""
    if os.environ.get(WORKER_ENV):
        os.write(2, (_JOINED + json.dumps(dataclasses.asdict(procs)) + "\n").encode())


# ---- supervision ------------------------------------------------------------------


# The supervisor's whole life (spawn the child, forward signals, wait, report) in one
# place, so what happens on each way a child can end is read side by side.
def supervise(args) -> int | None:
    """Runs this command as a supervised child if it joins several processes.

    Returns the exit status to end with, or None: go on in this process (a single
    process, or we are the child, or `args` has no command line to re-run:
    `args.command_line`, which run.cli.main sets). In the child, Python's stderr is
    pointed back at the terminal and SIGINT ends the process at once with one line.
    """
    fds = os.environ.get(WORKER_ENV)
    if fds:
        out, err = (int(fd) for fd in fds.split(","))
        sys.stdout = os.fdopen(out, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(err, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, _interrupted)
        _die_with_parent()
        return None
    if not requested(args):
        return None
    check_flags(args)
    argv = getattr(args, "command_line", None)  # run.cli.main's
    if argv is None:
        return None  # called from Python with its own argv: nothing to re-run
    sys.stdout.flush()
    real = (os.dup(1), os.dup(2))
    env = {**os.environ, WORKER_ENV: f"{real[0]},{real[1]}"}
    # The child's native stdout and stderr (gloo writes to stdout, XLA to stderr) come
    # to us; its Python stdout and stderr are ours.
    child = subprocess.Popen(
        [sys.executable, "-m", "qwen3_spmd.run", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=real,
    )
    for fd in real:
        os.close(fd)
    log: list[str] = []
    readers = [
        threading.Thread(target=_drain, args=(pipe, log), daemon=True)
        for pipe in (child.stdout, child.stderr)
    ]
    for reader in readers:
        reader.start()
    interrupted: list[threading.Timer] = []

    def on_interrupt(*_):
        _forward_interrupt(child)
        if not interrupted:  # a child blocked in a collective cannot run its handler
            interrupted.append(threading.Timer(2.0, child.kill))
            interrupted[0].start()

    terminated: list[bool] = []

    def on_terminate(*_):  # the child decides what SIGTERM means (serve drains)
        terminated.append(True)
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = signal.signal(signal.SIGINT, on_interrupt)
    previous_term = signal.signal(signal.SIGTERM, on_terminate)
    gave_up = False
    try:
        gave_up = _wait_for_join(child, log, args.peer_timeout + _JOIN_GRACE_S)
        rc = child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
    for reader in readers:
        reader.join(timeout=5)
    if args.debug and (rc != 0):
        sys.stderr.write("".join(log[-200:]))
    if interrupted:
        interrupted[0].cancel()
        if rc != 130:  # 130: the child said so itself
            print("interrupted", file=sys.stderr)
        return 130
    if rc >= 0:
        return rc
    if terminated and rc == -signal.SIGTERM:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    status, line = explain(log, args, gave_up)
    print(f"error: {line}", file=sys.stderr)
    return status


def _wait_for_join(child: subprocess.Popen, log: list[str], limit_s: float) -> bool:
    """Waits until the child has joined the job (or ended); kills it if joining takes
    longer than limit_s. True if it was killed for that."""
    import time

    started = None
    while child.poll() is None:
        if any(line.startswith(_JOINED) for line in log):
            return False
        if started is None and _JOINING in log:
            started = time.monotonic()
        if started is not None and time.monotonic() - started > limit_s:
            child.kill()
            return True
        time.sleep(0.05)
    return False


def _interrupted(*_):
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def _die_with_parent() -> None:
    """The child ends with its supervisor (Linux), so killing one kills both."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _forward_interrupt(child: subprocess.Popen) -> None:
    # A Ctrl-C in a terminal reaches the child too; kill -INT of the parent alone
    # should stop it as well. The child exits at once (os._exit), so twice is harmless.
    try:
        child.send_signal(signal.SIGINT)
    except ProcessLookupError:
        pass


def _drain(stream, log: list[str]) -> None:
    for raw in stream:
        log.append(raw.decode(errors="replace"))
        if len(log) > 2000:
            del log[:1000]


def explain(log: list[str], args, gave_up: bool = False) -> tuple[int, str]:
    """(exit status, one line) for a child the runtime ended, from its native output;
    gave_up: we ended it, for not joining in time."""
    joined = None
    for line in log:
        if line.startswith(_JOINED):
            joined = json.loads(line[len(_JOINED) :])
    text = "".join(log)
    me = joined["index"] if joined else args.process_id
    n = joined["count"] if joined else args.num_processes
    address = (joined or {}).get("coordinator") or args.coordinator or "(auto-detected)"
    hosts = (joined or {}).get("hosts") or []
    who = f"process {me} of {n}" if me is not None else "this process"
    t = f"{args.peer_timeout:g} s"

    def named(i: int) -> str:
        host = f" on {hosts[i]}" if i < len(hosts) else ""
        return f"process {i}{host}"

    lost = re.search(r"stopped sending heartbeats\):\s*\n((?:\s*[\w/:,-]+\s*\n)+)", text)
    if lost:
        ids = [int(x) for x in re.findall(r"(?:task:|^|\s)(\d+)\b", lost.group(1))]
        names = ", ".join(named(i) for i in ids) or lost.group(1).strip()
        return 1, (f"lost {names}: no heartbeat for {t} (coordinator {address}); {who} stops here")
    unexpected = re.search(r"Unexpected task registered with task=(\d+)", text)
    if unexpected:
        return 2, (
            f"the coordinator at {address} does not expect process "
            f"{unexpected.group(1)}: every process must pass the same --num-processes"
        )
    if gave_up or ("RegisterTask" in text and "DEADLINE_EXCEEDED" in text.upper()):
        if me == 0:
            return 2, (
                f"not all {n} processes joined at {address} within {t}: start every "
                f"process 0 .. {(n or 1) - 1} with --coordinator {address} "
                f"--num-processes {n}, or raise --peer-timeout"
            )
        return 2, (
            f"{who} could not join the coordinator at {address} within {t}: it is "
            "unreachable, or process 0 is not running there, or it expects a different "
            "--num-processes"
        )
    if joined is None and me == 0 and re.search(r"[Aa]ddress already in use|bind", text):
        return 2, f"process 0 cannot serve the coordinator at {address}: the port is in use"
    if re.search(r"coordination service|leader task|Socket closed|Connection refused", text):
        return 1, (f"lost {named(0)}, the coordinator at {address}; {who} stops here")
    fatal = [ln for ln in log if ln[:1] == "F" and "]" in ln]
    detail = fatal[-1].split("]", 1)[1].strip() if fatal else "no message"
    return 1, f"{who} (coordinator {address}) was ended by the JAX runtime: {detail[:300]}"
