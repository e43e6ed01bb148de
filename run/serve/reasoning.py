"""Qwen3's thinking, split from its answer (`serve --reasoning-parser qwen3`, vLLM's
flag and field names).

Qwen3 answers a chat turn as `<think>\\n...\\n</think>\\n\\n` and then the answer; with
`enable_thinking: false` its template writes an empty `<think>\\n\\n</think>\\n\\n` into
the prompt and the model answers straight away. The text between the tags is the
message's `reasoning_content`, the rest its `content`.

`Qwen3Reasoning` reads one choice's text as it streams, a delta at a time: each delta
gives the reasoning and the content it settles. Text that may still turn out to be a
tag waits for the next delta, so a tag split across tokens (or spelled by ordinary
tokens rather than Qwen3's added `<think>` token) is found all the same, and the
deltas of any cut of a text concatenate to what the whole text gives at once.
"""

from __future__ import annotations

from qwen3_spmd.run.serve.detok import partial_end

THINK, END = "<think>", "</think>"
TURN = "<|im_start|>"  # ChatML: the turn being answered starts at the prompt's last one


class Qwen3Reasoning:
    """One choice's text deltas -> (reasoning, content) deltas.

    States:
        start     nothing read yet: `<think>` opens the thinking, other text is an
                  answer without thinking (all content)
        thinking  text is reasoning until `</think>`
        answer    text is content

    Newlines next to the tags belong to neither (Qwen3's template writes them back
    around the reasoning of earlier turns). Held back for the next delta: a start that
    may be `<think>`, and in thinking an end that may be `</think>` with the newlines
    before it.
    """

    def __init__(self, state: str = "start"):
        if state not in ("start", "thinking", "answer"):
            raise ValueError(f"state {state!r}: start, thinking or answer")
        self.state = state
        self._held = ""
        self._strip = state == "thinking"  # newlines after a tag: dropped

    @classmethod
    def for_prompt(cls, prompt: str) -> Qwen3Reasoning:
        """The parser for a reply to `prompt` (the rendered chat): where the turn being
        answered already holds `</think>` (enable_thinking false), all text is
        content; where it holds an open `<think>` (templates that open it for the
        model), the text starts as reasoning."""
        turn = prompt[prompt.rfind(TURN) :]
        if END in turn:
            return cls("answer")
        return cls("thinking" if THINK in turn else "start")

    def add(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, after what came before, settles."""
        text, self._held = self._held + text, ""
        reasoning = ""
        if self.state == "start":
            if text.startswith(THINK):
                self.state, self._strip, text = "thinking", True, text[len(THINK) :]
            elif THINK.startswith(text):  # maybe the tag, not all of it yet
                self._held = text
                return "", ""
            else:
                self.state = "answer"
        if self.state == "thinking":
            text = self._lstrip(text)
            end = text.find(END)
            if end < 0:
                cut = len(text) - partial_end(text, END)
                cut = len(text[:cut].rstrip("\n"))  # newlines that may come before END
                self._held = text[cut:]
                return text[:cut], ""
            reasoning, text = text[:end].rstrip("\n"), text[end + len(END) :]
            self.state, self._strip = "answer", True
        return reasoning, self._lstrip(text)

    def end(self) -> tuple[str, str]:
        """(reasoning, content) held back when the text ends: a reply cut off in its
        thinking has reasoning only."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "thinking" else ("", held)

    def _lstrip(self, text: str) -> str:
        if self._strip:
            text = text.lstrip("\n")
            self._strip = not text
        return text
