"""The grammar state of each constrained request in the decode rows, by request id.

A request's `RowMatcher` starts when its first mask is asked for and goes when the
request ends. It fills the rows' allowed-token bits a program applies
(`sampling.only_allowed`), takes each sampled token, and checks a speculative pass's
drafts. Every process of a job advances its own matchers on the same tokens, so their
masks agree without being sent. The host's time here goes to `clock.mask_s`, the masks
filled to `accounting.masks`.
"""

from __future__ import annotations

import time

import numpy as np

from qwen3_spmd.pipeline.structured.constraints import Grammars, RowMatcher


class RowGrammars:
    """The matchers of the constrained requests (`grammars`: the model's grammar engine),
    timed on `clock` (its mask_s) and counted in `accounting` (its masks)."""

    def __init__(self, grammars: Grammars, clock, accounting):
        self.grammars, self.clock, self.accounting = grammars, clock, accounting
        self.matchers: dict[int, RowMatcher] = {}

    def of(self, request) -> RowMatcher | None:
        """The request's matcher (started when first asked), None without a constraint.
        A drafter steers by it inside `RowMatcher.trial`, which leaves it as it was."""
        if request.params.constraint is None:
            return None
        if request.id not in self.matchers:
            self.matchers[request.id] = self.grammars.matcher(request.params.constraint)
        return self.matchers[request.id]

    def masks(self, requests: list, always: bool = False) -> np.ndarray | None:
        """Each row's allowed tokens [len(requests), W] (all for a row of no constrained
        request, or of none); None when no row is constrained, unless `always`."""
        if not constrained(requests):
            return self.grammars.masks(len(requests)) if always else None
        t0 = time.perf_counter()
        masks = self.grammars.masks(len(requests))
        for i, r in enumerate(requests):
            matcher = None if r is None else self.of(r)
            if matcher is not None:
                matcher.fill(masks, i)
                self.accounting.masks += 1
        self.clock.mask_s += time.perf_counter() - t0
        return masks

    def check_drafts(self, requests: list, drafts: list[list[int]], T: int):
        """A speculative pass's checks: (each row's drafts cut to the run its constraint
        allows (`RowMatcher.along`), the allowed tokens at each of the pass's T >
        len(drafts[i]) positions [len(requests), T, W], all for a row without a
        constraint); (drafts, None) when no row has one."""
        if not constrained(requests):
            return drafts, None
        t0 = time.perf_counter()
        masks = np.full((len(requests), T, self.grammars.words), -1, np.int32)
        cut = []
        for i, (r, d) in enumerate(zip(requests, drafts)):
            matcher = None if r is None else self.of(r)
            if matcher is not None:
                d = d[: matcher.along(d, masks[i])]
                self.accounting.masks += len(d) + 1
            cut.append(d)
        self.clock.mask_s += time.perf_counter() - t0
        return cut, masks

    def take(self, tokens: dict[int, int]) -> set[int]:
        """Each constrained request's matcher takes its new token ({request id: token});
        returns the ids whose answers are done (their grammar admits nothing more)."""
        t0 = time.perf_counter()
        done = {id for id, t in tokens.items() if id in self.matchers and self.matchers[id].take(t)}
        self.clock.mask_s += time.perf_counter() - t0
        return done

    def take_run(self, request, tokens) -> tuple[list[int], bool]:
        """The request's kept tokens of a speculative pass, taken one by one by its
        matcher: (those up to where its answer is done, whether it is)."""
        matcher = self.of(request)
        tokens = [int(t) for t in tokens]
        if matcher is None:
            return tokens, False
        t0 = time.perf_counter()
        try:
            for i, t in enumerate(tokens):
                if matcher.take(t):
                    return tokens[: i + 1], True
            return tokens, False
        finally:
            self.clock.mask_s += time.perf_counter() - t0

    def forget(self, ids) -> None:
        """The matchers of these requests (ended or cancelled) go."""
        for id in ids:
            self.matchers.pop(id, None)


def constrained(requests: list) -> bool:
    """Whether any of these rows' requests has a constraint (a structured output)."""
    return any(r is not None and r.params.constraint is not None for r in requests)
