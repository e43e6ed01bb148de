"""`generate`'s text printed while it decodes: one request's as its chunks arrive, or
of several requests each one's whole when it finishes."""

from __future__ import annotations

import sys


class Streamer:
    """Prints one request's text (or ids) as decode chunks arrive."""

    shown_all = True

    def __init__(self, text, progress=None):
        self.text, self.shown, self.progress = text, 0, progress

    def __call__(self, tokens: list[list[int]]) -> None:
        if self.progress is not None:
            self.progress.stop()  # the bar and the streamed text share the terminal
        ids = tokens[0]
        if self.text is not None:
            s = self.text.decode(ids)
            sys.stdout.write(s[self.shown :])
            self.shown = len(s)
        else:
            sys.stdout.write("".join(f" {t}" for t in ids[self.shown :]))
            self.shown = len(ids)
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write("\n")


class DoneStreamer:
    """Several requests: prints each request's text as soon as it is finished (an EOS
    id, or --max-new-tokens), in the order they finish."""

    def __init__(self, text, progress, prompts, max_new_tokens: int, eos):
        from qwen3_spmd.pipeline.batch.handles import Params

        self.text, self.progress, self.prompts = text, progress, prompts
        self.params = Params(max_new_tokens, eos_ids=tuple(eos))
        self.printed: set[int] = set()
        self.last: list[list[int]] = []

    @property
    def shown_all(self) -> bool:
        return len(self.printed) == len(self.prompts)

    def _show(self, n: int, ids: list[int], reason: str) -> None:
        if self.progress is not None:
            self.progress.stop()
        shown = self.text.decode(ids) if self.text is not None else " ".join(map(str, ids))
        print(
            f"[{n}] ({len(self.prompts[n])} prompt tokens -> {len(ids)} new, {reason}) {shown}",
            flush=True,
        )
        self.printed.add(n)

    def __call__(self, tokens: list[list[int]]) -> None:
        self.last = tokens
        for n, ids in enumerate(tokens):
            reason = self.params.finish_reason(ids)
            if reason and n not in self.printed:
                self._show(n, ids, reason)

    def finish(self) -> None:
        for n, ids in enumerate(self.last):
            if n not in self.printed:
                self._show(n, ids, "length")
