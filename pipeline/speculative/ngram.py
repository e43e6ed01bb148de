"""Prompt lookup: the `ngram` drafter of speculative decoding (no second model).

A request's context (its prompt and the tokens generated so far) often repeats itself:
code, quotes of the prompt, a small model's own loops. The drafter takes the context's
last n tokens (the longest n from `prompt_lookup_max` down to `prompt_lookup_min` that
occurred before), finds their most recent earlier occurrence and proposes the tokens
that followed it, up to k. The model then checks the proposal (`pipeline.speculative.speculator`):
a wrong draft costs a verify position, never a wrong token.

`propose` is host code on token lists, for rounds the host drafts between;
`propose_rows` is the same rule in jnp over a batch of contexts, for the device's loop
of rounds (`pipeline.speculative.loop`), where the newest tokens are on the last stage. jnp is
imported inside it: `spec_config` reads this module before anything loads JAX.
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


def propose_rows(history, length, k: int, n_max: int, n_min: int):
    """`propose` for many rows at once, in jnp, for the device's loop of rounds
    (`pipeline.speculative.loop`): the same drafts, the same rule.

    Args:
      history: [R, H] int32, each row's context in its first length[r] entries.
      length: [R] int32, 1 <= length <= H.
      k, n_max, n_min: as `propose`'s (static).
    Returns:
      (drafts [R, k] int32, found [R] bool): a row's k drafts where some n-gram occurred
      before (its drafts are meaningless where not found).
    """
    import jax.numpy as jnp

    H = history.shape[1]
    i = jnp.arange(H, dtype=jnp.int32)[None]  # [1, H]: a start of an earlier occurrence
    found = jnp.zeros(length.shape, bool)
    copy_from = jnp.zeros(length.shape, jnp.int32)  # i + n of the chosen occurrence
    for n in range(n_max, n_min - 1, -1):
        # At least one token follows the occurrence: i + n <= L - 1 (so n <= L - 1).
        match = i + n <= length[:, None] - 1
        for m in range(n):
            want = jnp.take_along_axis(history, jnp.maximum(length - n + m, 0)[:, None], axis=1)
            # history[:, i + m] (the wrap past H falls where `match` is already False).
            match &= jnp.roll(history, -m, axis=1) == want
        latest = jnp.max(jnp.where(match, i, -1), axis=1)  # the most recent: [R]
        new = ~found & (latest >= 0)
        copy_from = jnp.where(new, latest + n, copy_from)
        found |= new
    # The overlapping copy: draft o is history[i + n + o] below L, else draft o - p for
    # the period p = L - (i + n) >= 1, i.e. history[i + n + o mod p].
    period = jnp.maximum(length - copy_from, 1)[:, None]
    at = copy_from[:, None] + jnp.arange(k, dtype=jnp.int32)[None] % period
    return jnp.take_along_axis(history, jnp.clip(at, 0, H - 1), axis=1), found
