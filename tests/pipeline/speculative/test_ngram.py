"""Prompt lookup, the ngram drafter: on the host and in jnp for the device's loop."""

import numpy as np

from qwen3_spmd.pipeline.speculative import ngram


def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    # The suffix [1, 2] occurred twice; the most recent occurrence is followed by 9, 8.
    assert ngram.propose([1, 2, 7, 1, 2, 9, 8, 1, 2], 2, 3, 1) == [9, 8]
    # The 3-gram [4, 1, 2] occurred once (followed by 7): longer matches win over recent.
    assert ngram.propose([4, 1, 2, 7, 5, 1, 2, 6, 4, 1, 2], 1, 3, 1) == [7]
    # With n_min 3, the 2-gram match does not count.
    assert ngram.propose([1, 2, 7, 5, 1, 2], 3, 3, 3) == []
    assert ngram.propose([1, 2, 7, 5, 1, 2], 3, 2, 2) == [7, 5, 1]
    assert ngram.propose([1, 2, 3], 4, 3, 1) == []  # nothing repeats
    assert ngram.propose([1, 2, 1, 2], 0, 3, 1) == []  # k = 0


def test_ngram_copy_runs_on_past_the_context_end():
    # A loop of period 2 proposes k tokens, not 2: the copy overlaps its own output.
    assert ngram.propose([5, 1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]
    assert ngram.propose([7, 7, 7], 4, 2, 1) == [7, 7, 7, 7]


def test_ngram_on_the_device_proposes_what_the_host_does():
    """`ngram.propose_rows` (the device's loop of rounds drafts with it) against
    `propose` on contexts of a small alphabet (so n-grams recur), of every length from
    1 to the buffer's, for several k and n bounds."""
    rng = np.random.default_rng(0)
    H, R = 24, 48
    history = rng.integers(0, 3, (R, H)).astype(np.int32)
    length = np.concatenate([[1, 2, H], rng.integers(1, H + 1, R - 3)]).astype(np.int32)
    for k, n_max, n_min in ((1, 1, 1), (4, 3, 1), (6, 4, 2), (3, 5, 5)):
        drafts, found = ngram.propose_rows(history, length, k, n_max, n_min)
        got = [list(d) if f else [] for d, f in zip(np.asarray(drafts), np.asarray(found))]
        want = [ngram.propose(list(h[:n]), k, n_max, n_min) for h, n in zip(history, length)]
        assert got == want
        assert any(got) and not all(got)  # both outcomes occurred
