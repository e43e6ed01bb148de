"""The pages' examples run as printed (as doc tests keep examples true).

Every ```bash and ```python block in README.md and docs/*.md has, on the line above it,
a comment that says what this file does with it:

    <!-- example: run -->                   run as printed, from the repository root
    <!-- example: run; it prints its closing comments -->
                                             and the comment lines that end the block
                                             are the lines it prints last (a note after
                                             two spaces aside)
    <!-- example: run after PAGE#HEADING --> run in one Python process after the run
                                             block under that heading, which builds what
                                             this one uses
    <!-- example: run against `COMMAND` -->  run while COMMAND serves (this test adds a
                                             free port, which replaces the page's 8000,
                                             `--precompile lazy` and a short
                                             `--max-seq-len`)
    <!-- example: output of the block above -->  the block above prints this; numbers
                                             with a decimal point (timings) aside
    <!-- example: not run: REASON -->        a download, a GPU, several hosts, a fixed
                                             port, or 40 s or more on 2 CPU cores

A block without one fails here, so no example is left unchecked by accident. Bash runs
the bash blocks, with `qwen3-spmd` the package's script (pyproject's entry point) and
`python` this interpreter; a Python block runs in a fresh `python`. Every `qwen3-spmd`
command in a bash block, run or not, must parse, and every `python -m` module and
`python tools/...` script exist: a
renamed flag or module fails even in an example that downloads.

The examples run in subprocesses, two at a time beside one server, and the compiled
programs land in the session's compile cache (conftest.py).
"""

import ast
import difflib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from children import child_env
from ports import free_port
from reference import ROOT

from qwen3_spmd.run.cli import build_parser

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- example: (.+?) -->$")
FENCE = re.compile(r"^\s*```(\w*)\s*$")
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
SERVE_FLAGS = ["--precompile", "lazy", "--max-seq-len", "128"]  # a fast start
JOB_TIMEOUT = 240  # seconds, for one example (a served one waits for the server too)
CLI_MODULES = ("qwen3_spmd.run", "qwen3_spmd.run.cli")
CLOSING = "run; it prints its closing comments"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None
    heading: str  # the slug of the section it is in

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, heading, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("#") and not lines[i].startswith("#!"):
            heading = _slug(lines[i].lstrip("#"))
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end, f"{page.name}:{i + 1}: a fence that never closes"
        mark = MARKER.match(lines[i - 1].strip()) if i else None
        code = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")
        lang = RUNNABLE.get(m.group(1), m.group(1))
        out.append(Block(page, i + 1, lang, code, mark and mark.group(1), heading))
        i = end + 1
    return out


BLOCKS = [b for page in PAGES for b in _blocks(page)]


def _kind(block: Block) -> str:
    m = block.marker or ""
    for kind in ("run after ", "run against ", "not run: "):
        if m.startswith(kind):
            return kind.strip(" :")
    if m in ("run", CLOSING) or m.startswith("output of the block above"):
        return m.split(";")[0]
    return "unknown"


def _previous(block: Block) -> Block:
    same = [b for b in BLOCKS if b.page == block.page and b.line < block.line]
    return same[-1]


def _after(block: Block) -> Block:
    """The run block that `run after PAGE#HEADING` names."""
    ref = block.marker.removeprefix("run after ").strip()
    page, _, anchor = ref.partition("#")
    target = (block.page.parent / page).resolve() if page else block.page
    found = [
        b
        for b in BLOCKS
        if b.page.resolve() == target and b.heading == anchor and _kind(b) == "run"
    ]
    assert len(found) == 1, f"{block.where}: 'run after {ref}' names no single run block"
    return found[0]


def _served_command(block: Block) -> str:
    m = re.fullmatch(r"run against `([^`]+)`", block.marker)
    assert m, f"{block.where}: write the server's command in backquotes"
    return m.group(1)


# ---- every block is accounted for, and every command parses ----------------------------


def test_every_example_says_whether_it_runs():
    problems = []
    for b in BLOCKS:
        kind = _kind(b)
        if b.lang not in RUNNABLE:
            if b.marker is not None and kind != "output of the block above":
                problems.append(f"{b.where}: a ```{b.lang} block cannot run: drop its marker")
            continue
        if b.marker is None:
            problems.append(f"{b.where}: no '<!-- example: ... -->' line above the block")
        elif kind == "unknown":
            problems.append(f"{b.where}: unknown marker {b.marker!r}")
        elif kind == "not run" and not b.marker.removeprefix("not run:").strip():
            problems.append(f"{b.where}: 'not run:' needs a reason")
    for b in BLOCKS:
        if _kind(b) == "output of the block above" and _kind(_previous(b)) != "run":
            problems.append(f"{b.where}: the block above this output is not run")
        if _kind(b) == "run after":
            _after(b)
        if _kind(b) == "run against":
            _served_command(b)
    assert not problems, "\n".join(problems)
    assert sum(_kind(b) != "not run" for b in BLOCKS if b.lang in RUNNABLE) >= 5


def _commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: words split as bash splits them, comments
    and continuations gone, cut at newlines and at ; & | && ||."""
    out, text = [], ""
    for line in code.replace("\\\n", " ").splitlines(keepends=True):
        text += line  # until its quotes close
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|\n")
        lexer.whitespace, lexer.commenters = " \t\r", "#"
        lexer.wordchars += ",:@%+[]{}!^"
        try:
            words = [*lexer, ";"]
        except ValueError:
            continue
        text, cmd = "", []
        for w in words:
            if set(w) <= set(";&|\n"):
                out += [cmd] if cmd else []
                cmd = []
            else:
                cmd.append(w)
    assert not text, f"unclosed quotes in {code!r}"
    return out


def _cli_argv(words: list[str]) -> list[str] | None:
    """The arguments after `qwen3-spmd` or `python -m qwen3_spmd.run[.cli]`, if any."""
    for i, w in enumerate(words):
        if w == "qwen3-spmd":
            return words[i + 1 :]
        if w in ("python", "python3") and words[i + 1 : i + 2] == ["-m"]:
            return words[i + 3 :] if words[i + 2] in CLI_MODULES else None
    return None


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.where)
def test_commands_parse(block, capsys):
    for words in _commands(block.code):
        for i, w in enumerate(words[:-2]):
            if w in ("python", "python3") and words[i + 1] == "-m":
                assert importlib.util.find_spec(words[i + 2]), (
                    f"{block.where}: no module {words[i + 2]}"
                )
            if w in ("python", "python3") and words[i + 1].startswith("tools/"):
                assert (ROOT / words[i + 1]).is_file(), f"{block.where}: no script {words[i + 1]}"
        argv = _cli_argv(words)
        if argv is None:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{block.where}: {shlex.join(words)}\n{capsys.readouterr().err}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_compiles(block):
    ast.parse(block.code, block.where)


# ---- the run examples ----------------------------------------------------------------


def _env() -> dict[str, str]:
    # A reader's shell: no emulated device count (the examples choose theirs); the
    # session's compile cache and its cheaper compiles (conftest.py) stay.
    return child_env()


def _script() -> list[str]:
    """The `qwen3-spmd` command: pyproject's entry point, run by this interpreter."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["qwen3-spmd"].partition(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def _bash_prelude() -> str:
    py = shlex.quote(sys.executable)
    return (
        f'qwen3-spmd() {{ {shlex.join(_script())} "$@"; }}\n'
        f'python() {{ {py} "$@"; }}\npython3() {{ {py} "$@"; }}\n'
    )


def _run(lang: str, code: str) -> subprocess.CompletedProcess:
    if lang == "bash":
        argv, stdin = ["bash", "-eo", "pipefail", "-c", _bash_prelude() + code], None
    else:
        argv, stdin = [sys.executable, "-"], code
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a timeout ends bash's children too
    )
    try:
        out, err = proc.communicate(stdin, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ntimed out after {JOB_TIMEOUT} s"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


class Server:
    """One server for the examples that run against it, started with the pages'
    command plus a free port and a fast start."""

    def __init__(self, command: str, log: Path):
        self.command, self.log, self.port = command, log, free_port()
        words = shlex.split(command)
        assert words[0] == "qwen3-spmd", f"serve with qwen3-spmd, not {command!r}"
        argv = [*_script(), *words[1:], "--port", str(self.port), *SERVE_FLAGS]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=f
            )

    def wait(self) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.command!r} did not start:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-15:])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True)
class Job:
    blocks: tuple[Block, ...]  # run in one process, in order
    server: str | None  # the command the examples run against

    @property
    def where(self) -> str:
        return "+".join(b.where for b in self.blocks)


def _jobs() -> list[Job]:
    jobs = []
    for b in BLOCKS:
        if _kind(b) == "run":
            after = tuple(x for x in BLOCKS if _kind(x) == "run after" and _after(x) == b)
            jobs.append(Job((b, *after), None))
        elif _kind(b) == "run against":
            jobs.append(Job((b,), _served_command(b)))
    return jobs


JOBS = _jobs()


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """Starts the selected jobs at once (two at a time, beside the servers they need),
    and hands back a future per job."""
    jobs = [
        item.callspec.params["job"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example_runs"
    ]
    logs = tmp_path_factory.mktemp("doc-examples")
    servers = {
        cmd: Server(cmd, logs / f"server{i}.log")
        for i, cmd in enumerate(sorted({j.server for j in jobs if j.server}))
    }

    def run(job: Job):
        code = "\n".join(b.code for b in job.blocks)
        if job.server:
            server = servers[job.server]
            server.wait()
            code = re.sub(r"(localhost|127\.0\.0\.1):8000\b", rf"\1:{server.port}", code)
        return _run(job.blocks[0].lang, code)

    pool = ThreadPoolExecutor(max_workers=2)
    # The served ones last: their server starts meanwhile.
    futures = {j: pool.submit(run, j) for j in sorted(jobs, key=lambda j: j.server is not None)}
    yield futures, servers
    pool.shutdown(cancel_futures=True)
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.where)
def test_example_runs(job, results):
    futures, servers = results
    done = futures[job].result()
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
    status = done.returncode
    assert status == 0, f"{job.where} failed ({status}):\n{tail}"
    if job.server:
        assert done.stdout.strip(), f"{job.where} printed nothing"
        assert '"error"' not in done.stdout, f"{job.where} got an error:\n{tail}"
        # the name it sends is the one the server announces
        m = re.search(r"^serving (\S+) on ", servers[job.server].log.read_text(), re.M)
        assert m and m.group(1) in job.blocks[0].code, servers[job.server].tail()
    for b in job.blocks:
        if b.marker == CLOSING:
            said = _closing_comments(b.code)
            assert said, f"{b.where}: no comment lines at its end"
            printed = _masked(done.stdout)[-len(said) :]
            assert printed == _masked("\n".join(said)), (
                f"{b.where} says it prints\n{chr(10).join(said)}\nbut prints\n{tail}"
            )
    shown = [b for b in BLOCKS if _kind(b) == "output of the block above"]
    for out in shown:
        if _previous(out) in job.blocks:
            diff = difflib.unified_diff(_masked(out.code), _masked(done.stdout), lineterm="")
            diff = "\n".join(list(diff)[2:30])
            assert not diff, f"{out.where} is not what {job.where} prints now:\n{diff}"


def _closing_comments(code: str) -> list[str]:
    """The comment lines that end a block, without '# ' and a note after two spaces."""
    said = []
    for line in reversed(code.strip().splitlines()):
        if not line.startswith("# "):
            break
        said.insert(0, line[2:].split("  ")[0])
    return said


# What a second run adds to a command's timing line: how many of its programs the compile
# cache held, which depends on what ran before in the session, as the timings do.
CACHE_NOTE = re.compile(r" \(\d+ programs? read from the compile cache\)")


def _masked(text: str) -> list[str]:
    """Lines without trailing blanks, numbers with a decimal point as '#', the compile
    cache's note left out."""
    lines = [
        CACHE_NOTE.sub("", re.sub(r"\d+\.\d+(e[-+]?\d+)?", "#", ln)).rstrip()
        for ln in text.splitlines()
    ]
    while lines and not lines[-1]:
        lines.pop()
    return lines
