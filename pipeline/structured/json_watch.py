"""The host's checks of a JSON answer that a grammar cannot make (`schema_rewrite.Watch`):
strings that must differ from their array's earlier items (`uniqueItems`) or from a
forbidden set (`not: {enum: ...}`).

`JsonWatch` follows one row's answer byte by byte (a small JSON scanner: the container
stack, each member's key and each item's index, the string being written) and, before
each token, masks the allowed tokens that would complete a forbidden string. Only
tokens holding a `"` can complete a string (two of them when no string is open), so a
step looks at a few hundred tokens at most. The watched strings can always grow instead
(`schema_rewrite` takes only such), so the mask never empties for them.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from qwen3_spmd.pipeline.structured.schema_rewrite import Watch


@dataclasses.dataclass
class TokenTexts:
    """The model's tokens as bytes, and those that hold a `"` (once, twice or more).

    texts: bytes per token id. quoted: [Q] ids holding at least one `"`; quoted_twice:
    [Q2] ids holding at least two. heads: for each id of `quoted` that holds one `"` and
    no backslash before it, the text before the `"` (what it adds to an open string
    as it closes it); None for the others."""

    texts: list[bytes]
    quoted: np.ndarray
    quoted_twice: np.ndarray
    heads: dict[int, bytes | None]

    @classmethod
    def of(cls, tokenizer) -> TokenTexts:
        """From llguidance's LLTokenizer."""
        texts = [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        counts = np.array([t.count(b'"') for t in texts])
        quoted = np.flatnonzero(counts >= 1)
        heads = {}
        for i in quoted.tolist():
            head = texts[i][: texts[i].index(b'"')]
            heads[i] = head if counts[i] == 1 and b"\\" not in head else None
        return cls(texts, quoted, np.flatnonzero(counts >= 2), heads)


def _matches(pattern: tuple, path: tuple) -> bool:
    """A Watch's path pattern against a value's concrete path."""
    if len(pattern) != len(path):
        return False
    for want, step in zip(pattern, path):
        if want[0] == "anykey":
            ok = step[0] == "key"
        elif want[0] == "item":
            ok = step[0] == "index"
        else:
            ok = want == step
        if not ok:
            return False
    return True


@dataclasses.dataclass
class _Frame:
    """An open container: an object (key: the member being written, None before its
    key ends) or an array (index: the item being written; seen: its string items so
    far, kept when the array is watched)."""

    is_object: bool
    key: str | None = None
    index: int = 0
    seen: set[str] | None = None

    def step(self) -> tuple:
        return ("key", self.key) if self.is_object else ("index", self.index)

    def copy(self) -> _Frame:
        seen = None if self.seen is None else set(self.seen)
        return _Frame(self.is_object, self.key, self.index, seen)


class _Scanner:
    """A JSON text's position: open containers, and the string being written."""

    def __init__(self, watches: tuple[Watch, ...]):
        self.watches = watches
        self.frames: list[_Frame] = []
        self.in_string = False
        self.is_key = False
        self.expect_key = False
        self.escaped = False
        self.raw = bytearray()

    def copy(self) -> _Scanner:
        other = _Scanner.__new__(_Scanner)
        other.__dict__.update(self.__dict__)
        other.frames = [f.copy() for f in self.frames]
        other.raw = bytearray(self.raw)
        return other

    def path(self) -> tuple:
        return tuple(f.step() for f in self.frames)

    def feed(self, data: bytes) -> bool:
        """Reads `data`; False as soon as a string it completes is forbidden."""
        for byte in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:  # the closing quote
                    self.in_string = False
                    if not self._ended(bytes(self.raw)):
                        return False
                    continue
                self.raw.append(byte)
            elif byte == 0x22:
                self.in_string, self.raw = True, bytearray()
                self.is_key = bool(self.frames) and self.frames[-1].is_object and self.expect_key
            elif byte in b"{[":
                unique = byte == 0x5B and any(
                    w.kind == "unique" and _matches(w.path, self.path()) for w in self.watches
                )
                self.frames.append(_Frame(byte == 0x7B, seen=set() if unique else None))
                self.expect_key = byte == 0x7B
            elif byte in b"}]":
                if self.frames:
                    self.frames.pop()
                self.expect_key = False
            elif byte == 0x3A:  # ':'
                self.expect_key = False
            elif byte == 0x2C and self.frames:  # ','
                top = self.frames[-1]
                if top.is_object:
                    top.key, self.expect_key = None, True
                else:
                    top.index += 1
        return True

    def _ended(self, raw: bytes) -> bool:
        """A string ended: a key is noted; a value is checked (False: forbidden)."""
        try:
            value = json.loads(b'"' + raw + b'"')
        except ValueError:
            return True  # not JSON: the grammar's to refuse, not ours
        if self.is_key:
            self.frames[-1].key = value
            return True
        if value in self.forbidden():
            return False
        if self.frames and self.frames[-1].seen is not None:
            self.frames[-1].seen.add(value)
        return True

    def forbidden(self) -> set[str]:
        """The values the string being written may not end as: its array's earlier
        items (a watched array), and those a `not` at its path names (none for a key)."""
        if self.is_key:
            return set()
        top = self.frames[-1] if self.frames else None
        banned = set(top.seen) if top is not None and top.seen is not None else set()
        path = self.path()
        for w in self.watches:
            if w.kind == "not" and _matches(w.path, path):
                banned |= w.values
        return banned


class JsonWatch:
    """One row's checks: `take` each token the row produced, `mask` before the next."""

    def __init__(self, watches: tuple[Watch, ...], tokens: TokenTexts):
        self.tokens = tokens
        self.scanner = _Scanner(watches)

    def take(self, token: int) -> None:
        self.scanner.feed(self.tokens.texts[token])

    def mask(self, masks: np.ndarray, row: int) -> None:
        """Clears, in row `row` of masks [B, W] (int32 bits), the allowed tokens that
        would complete a forbidden string."""
        scan = self.scanner
        ids = self.tokens.quoted if scan.in_string else self.tokens.quoted_twice
        bits = masks[row].view(np.uint32)
        allowed = ids[(bits[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]
        # A token that only closes the open string (one `"`, no escape before it): the
        # string's value is the open one's and the token's head; no simulation needed.
        plain = scan.in_string and not scan.escaped and b"\\" not in scan.raw
        banned = scan.forbidden() if plain else set()
        for token in allowed.tolist():
            head = self.tokens.heads.get(token) if plain else None
            if head is not None:
                try:
                    ok = (scan.raw + head).decode() not in banned
                except UnicodeDecodeError:
                    ok = True  # not a whole string: the grammar's to refuse
            else:
                ok = scan.copy().feed(self.tokens.texts[token])
            if not ok:
                bits[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
