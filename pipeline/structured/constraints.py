"""Structured outputs: a request's constraint (a JSON Schema, a regex, a choice of
strings, a grammar) and the grammar engine's state for each row that has one.

The engine is llguidance (Rust; its bitmasks are numpy arrays, no torch). A
`Constraint` is plain data that travels with a request's `Params` (and with the `Round`
to the other processes); `Grammars` holds llguidance's view of the model's tokenizer
(`tokenizer.json`, with n_vocab = the model's V, so ids past the tokenizer's are never
allowed) and the grammars compiled so far, cached by their text. Compiling happens on
its own thread, bounded (`COMPILE_S`): a slow schema delays only its own request, and
one that takes too long is refused. `RowMatcher` is one row's state: it fills the row's
allowed-token bits (`sampling.only_allowed`) and takes the row's sampled token.

Every process of a job runs the same matchers on the same tokens, so their masks agree
without being sent (the `Round` carries the constraints, not the masks).

JSON is compact by default (no whitespace between tokens): a weak model cannot fill its
budget with spaces.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import re
import threading
from collections import OrderedDict

import numpy as np

from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.structured import schema_rewrite
from qwen3_spmd.pipeline.structured.json_watch import JsonWatch, TokenTexts

KINDS = ("json", "regex", "choice", "grammar")
COMPILE_S = 10.0  # a grammar that takes longer to compile is refused
CACHED = 256  # compiled grammars kept (least recently used dropped)
# JSON Schema's options for llguidance: compact separators, no free whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ConstraintError(RequestError):
    """A constraint the grammar engine does not take (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request's answer must follow.

    kind: "json" (spec: a JSON Schema, as JSON text), "regex" (spec: the expression, the
    whole answer matches), "choice" (spec: a JSON list of strings, the answer is one of
    them) or "grammar" (spec: a Lark grammar, or GBNF, as llguidance reads them).
    after: a token id that starts the constraint (Qwen3's `</think>`, with thinking on:
    the thinking is free text); None: it holds from the first token."""

    kind: str
    spec: str
    after: int | None = None

    @classmethod
    def json_schema(cls, schema, after: int | None = None) -> Constraint:
        """A JSON Schema (a dict, or its JSON text)."""
        return cls("json", schema if isinstance(schema, str) else _text(schema), after)

    @classmethod
    def choice(cls, options, after: int | None = None) -> Constraint:
        return cls("choice", _text(list(options)), after)

    def grammar(self) -> tuple[str, tuple[schema_rewrite.Watch, ...]]:
        """(llguidance's grammar text for this constraint, the checks the host makes
        beside it: `schema_rewrite`); ConstraintError when the spec is malformed past
        what the compiler checks itself."""
        import llguidance

        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "json":
            try:
                schema, watches = schema_rewrite.rewrite(json.loads(self.spec))
                return llguidance.LLMatcher.grammar_from_json_schema(
                    _text(schema), JSON_OPTIONS
                ), watches
            except schema_rewrite.SchemaError as e:
                raise ConstraintError(str(e)) from None
            except ValueError as e:
                raise ConstraintError(f"the schema is not a JSON object ({e})") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec), ()
        if self.kind == "choice":
            options = json.loads(self.spec)
            if not options or not all(isinstance(o, str) for o in options):
                raise ConstraintError("a choice needs at least one string, and only strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(o) for o in options)
            ), ()
        try:
            return llguidance.grammar_from("grammar", self.spec), ()
        except Exception as e:  # the GBNF converter raises bare Exceptions
            raise ConstraintError(f"the grammar does not parse ({e})") from None


def _text(value) -> str:
    """Compact JSON text (the cache's key: equal values, equal text)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Grammars:
    """llguidance's tokenizer for one model and the grammars compiled for it.

    Args:
      tokenizer_json: tokenizer.json's text. vocab: the model's V (at least the
        tokenizer's; the ids past it are never allowed). eos_ids: the model's end ids,
        allowed where a grammar accepts. compile_s: the bound on one compile.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab: int,
        eos_ids: tuple[int, ...],
        compile_s: float = COMPILE_S,
    ):
        self.vocab, self.compile_s = vocab, compile_s
        self.words = -(-vocab // 32)  # W: int32 words of a row's mask
        self._tokenizer_json, self._eos_ids = tokenizer_json, tuple(eos_ids)
        self._tokenizer = None  # made at the first compile (about a second for Qwen3's)
        self._texts = None  # the tokens' bytes, made for the first grammar with checks
        self._compiled: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._pending: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")

    @classmethod
    def of_text(cls, text, vocab: int, eos_ids: tuple[int, ...]) -> Grammars | None:
        """For a `run.text.Text` (None without a tokenizer: no structured outputs)."""
        if text is None:
            return None
        return cls(text.tokenizer.to_str(), vocab, eos_ids)

    def compile(self, constraint: Constraint, bounded: bool = True) -> Compiled:
        """The compiled grammar of `constraint` (a matcher at its start), compiled on this
        object's threads unless cached; ConstraintError when the engine refuses it or
        (bounded) its compile takes more than `compile_s` (it then still finishes, for
        the cache)."""
        key = (constraint.kind, constraint.spec)
        _ = self.tokenizer  # made once, outside the bound (seconds for Qwen3's vocabulary)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = self._pool.submit(self._build, key, constraint)
        try:
            return pending.result(timeout=self.compile_s if bounded else None)
        except concurrent.futures.TimeoutError:
            raise ConstraintError(
                f"the {constraint.kind} constraint took more than {self.compile_s:g} s to "
                "compile: simplify it"
            ) from None

    @property
    def tokenizer(self):
        """llguidance's LLTokenizer, made once (under the lock: threads may ask at once)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab, eos_token=list(self._eos_ids) or None
                )
            return self._tokenizer

    @property
    def texts(self) -> TokenTexts:
        """The tokens' bytes, for the host's checks (`json_watch`), made once."""
        tokenizer = self.tokenizer
        with self._lock:
            if self._texts is None:
                self._texts = TokenTexts.of(tokenizer)
            return self._texts

    def _build(self, key, constraint: Constraint) -> Compiled:
        import llguidance

        try:
            grammar, watches = constraint.grammar()
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ConstraintError(_refusal(matcher.get_error()))
            compiled = Compiled(matcher, watches, self.texts if watches else None)
        except ConstraintError:
            raise
        except Exception as e:  # a spec that is not what its kind says (ValueError, ...)
            raise ConstraintError(f"the {constraint.kind} constraint is malformed ({e})") from None
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHED:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, constraint: Constraint) -> RowMatcher:
        """A row's state at the start of `constraint`. Its compile is not bounded: a
        request admitted was compiled in time where it was submitted (process 0), and
        another process must then follow it, however long its own compile takes."""
        compiled = self.compile(constraint, bounded=False)
        watch = JsonWatch(compiled.watches, compiled.texts) if compiled.watches else None
        return RowMatcher(compiled.matcher.deep_copy(), constraint.after, watch)

    def masks(self, rows: int) -> np.ndarray:
        """[rows, W] int32 bits, every token allowed (a row under no constraint)."""
        return np.full((rows, self.words), -1, np.int32)


# llguidance's advice that names its own options, which a request cannot set: what the
# caller can change instead.
REWORDED = {
    "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate "
    "oneOf with anyOf": (
        "oneOf is taken only where no answer can match two of its branches: use anyOf, "
        "or tell the branches apart by a const"
    ),
}


def _refusal(error: str) -> str:
    """llguidance's error on one line, without the grammar it echoes after it (lines
    `  1 | start: ...`), its advice in the caller's terms."""
    lines = []
    for line in error.strip().splitlines():
        if re.match(r"\s*\d+ \|", line):
            break
        lines.append(line.strip())
    message = " ".join(x for x in lines if x) or "the grammar is invalid"
    for theirs, ours in REWORDED.items():
        message = message.replace(theirs, ours)
    return message


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A constraint compiled: llguidance's matcher at its start, and the host's checks
    beside it (`schema_rewrite.Watch`; texts: the tokens' bytes they read, None
    without checks)."""

    matcher: object
    watches: tuple[schema_rewrite.Watch, ...]
    texts: TokenTexts | None


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether `mask` [W] (packed bits, `sampling.only_allowed`) allows `token`."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class RowMatcher:
    """One row's grammar state: waiting for the token that starts it (`after`), then
    llguidance's matcher, and the host's checks beside it (watch, or None)."""

    def __init__(self, matcher, after: int | None, watch: JsonWatch | None = None):
        self.matcher, self.after, self.watch = matcher, after, watch
        self.waiting = after is not None
        self.consumed = 0  # tokens the matcher has taken (what a trial rolls back)

    def fill(self, masks: np.ndarray, row: int) -> None:
        """Row `row` of masks [B, W]: the tokens allowed next (all while waiting)."""
        if self.waiting:
            masks[row] = -1
            return
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, masks, row)
        if self.watch is not None:
            self.watch.mask(masks, row)

    def take(self, token: int) -> bool:
        """The row produced `token`; True when its answer is done: the grammar admits
        nothing more (or, never from a token its mask allowed, refused it)."""
        if self.waiting:
            self.waiting = token != self.after
            return False
        self.matcher.consume_token(int(token))
        self.consumed += 1
        if self.watch is not None:
            self.watch.take(int(token))
        return self.matcher.is_stopped() or self.matcher.is_error()

    @contextlib.contextmanager
    def trial(self):
        """Tokens taken inside are undone on leaving: the row's state (the matcher, the
        wait for `after`, the host's JSON checks) is left as it was. For drafts."""
        waiting, consumed = self.waiting, self.consumed
        scanner = None if self.watch is None else self.watch.scanner.copy()
        try:
            yield self
        finally:
            self.matcher.rollback(self.consumed - consumed)
            self.waiting, self.consumed = waiting, consumed
            if scanner is not None:
                self.watch.scanner = scanner

    def along(self, drafts, masks: np.ndarray) -> int:
        """How many of `drafts` (tokens proposed to follow the row's newest, in order)
        the constraint allows, each after those before it: n, the first that it
        refuses or the one after which it admits nothing more (a speculative pass's
        check). masks [len(drafts) + 1, W]: row i gets the tokens allowed after
        drafts[:i] for i <= n (all after an answer that is done); rows past n are left
        as they are. The row's state is left as it was."""
        n, done = 0, False
        with self.trial():
            for token in drafts:
                self.fill(masks, n)
                if not allows(masks[n], token):
                    return n
                n, done = n + 1, self.take(token)
                if done:
                    break
            if done:
                masks[n] = -1  # the row ends at its draft n - 1; nothing is chosen here
            else:
                self.fill(masks, n)
            return n
