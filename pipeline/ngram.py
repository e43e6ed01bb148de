"""Prompt lookup: the `ngram` drafter of speculative decoding (no second model).

A request's context (its prompt and the tokens generated so far) often repeats itself:
code, quotes of the prompt, a small model's own loops. The drafter takes the context's
last n tokens (the longest n from `prompt_lookup_max` down to `prompt_lookup_min` that
occurred before), finds their most recent earlier occurrence and proposes the tokens
that followed it, up to k. The model then checks the proposal (`pipeline.speculative`):
a wrong draft costs a verify position, never a wrong token.

Pure host code on token lists: it runs where the newest tokens are, between rounds.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(context: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k draft tokens for what follows `context`, or none.

    For n = n_max, n_max - 1, ..., n_min (the longest match first: a longer match says
    more about what comes next), the last n tokens of `context` are looked for earlier
    in it; at their most recent earlier occurrence (most recent: in a loop, that is
    what the model just did), the k tokens after it are proposed. Past the end of the
    context the copy goes on from its own first tokens (an overlapping copy, as LZ77's):
    a loop of period p < k is proposed k tokens deep, not p.

    Args:
      context: the request's tokens so far, prompt then output.
      k: the most tokens to propose (>= 0).
      n_max, n_min: the n-gram lengths tried, 1 <= n_min <= n_max.
    Returns:
      the proposal: k tokens, or none when no n-gram occurred before.
    """
    if k <= 0:
        return []
    tokens = list(context)
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        # Start i of an earlier occurrence: i + n <= L - 1, so at least one token follows.
        for i in range(L - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                out: list[int] = []
                for at in range(i + n, i + n + k):  # at - L < len(out), as i + n < L
                    out.append(tokens[at] if at < L else out[at - L])
                return out
    return []
