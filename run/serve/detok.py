"""Token ids to text, one token at a time, for streaming.

`Detokenizer` emits text only in whole characters: a token that ends inside a UTF-8
sequence (byte-level BPE splits characters across tokens) waits for the tokens that
complete it. It decodes a short window of recent ids rather than all of them, as
vLLM and TGI do: byte-level decoding is concatenation, so the window starts at the
last point where the text ended on a whole character.

`StopText` holds back text that could be the start of a stop string until it is known
not to be one, and ends the choice at the first stop string (which is not part of the
text). Both the streamed and the whole response are built by feeding the same tokens
through it, so the concatenated stream equals the whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a character


class Detokenizer:
    """decode: ids -> text (skipping special tokens, as the server shows them)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here: the text ended on a whole character
        self._read = 0  # text up to here has been emitted

    def add(self, token: int) -> str:
        """The new text that `token` completes ('' while a character is unfinished)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is left (an unfinished character shows as U+FFFD): the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.decode(self.ids[self._prefix : self._read])
        now = self.decode(self.ids[self._prefix :])
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]


class StopText:
    """Text deltas of one choice with stop strings applied.

    `add(text)` returns what may be shown now; once a stop string appears, `stopped` is
    True, the text before it is the last shown, and later calls return ''. `flush()` at
    the end shows what was held back for a stop string that never came.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""  # text that could be the start of a stop string

    def add(self, text: str, armed: bool = True) -> str:
        """armed=False (before min_tokens): stop strings do not count yet."""
        if self.stopped or not text:
            return ""
        pending = self._held + text
        if not armed:
            self._held = ""
            return pending
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return pending[:cut]
        keep = max((partial_end(pending, s) for s in self.stops), default=0)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def partial_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than all of
    it): text a stream must hold back until it knows whether `tag` follows."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
