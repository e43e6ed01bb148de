"""A speculative round's decision: each request's pace, the ladder of pass widths, the
round rule's choice by measured seconds, and the device loop's copies of those rules
(against the host's); the planner's plan (`SpecPolicy.decide`, carried in the Round)."""

import numpy as np
from reference import measured_rule

from qwen3_spmd.pipeline.speculative import loop
from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig
from qwen3_spmd.pipeline.speculative.policy import (
    MAX_WAIT,
    PRIOR_DRAFTS,
    PROBE_AFTER,
    RECENT,
    SAMPLES,
    Drafting,
    Pace,
    RoundRule,
    SpecPlan,
    SpecPolicy,
    ladder,
    pass_kind,
    step_kind,
    way_kind,
)


def test_pace_drafts_as_far_as_it_earned_and_waits_longer_after_each_miss():
    p = Pace(8)
    p.after(kept=8, drafted=8, k_max=8, tokens=20)  # all kept: the whole k again
    assert (p.k, p.waits(20)) == (8, 0)
    p.after(kept=3, drafted=8, k_max=8, tokens=24)  # a run of 3: twice it next
    assert (p.k, p.waits(24)) == (6, 0)
    p.after(kept=2, drafted=2, k_max=8, tokens=27)  # a short proposal all kept: doubled
    assert p.k == 4
    waits = []
    for tokens in range(30, 40):  # misses: one draft at a time, after 2, 4, .. tokens
        p.after(kept=0, drafted=1, k_max=8, tokens=tokens)
        waits.append(p.waits(tokens))
        assert p.k == 1
    assert waits == [2, 4, 8, 16, 32, 64, 64, 64, 64, 64] and MAX_WAIT == 64
    assert p.waits(39 + 63) == 1 and p.waits(39 + 64) == 0
    p.after(kept=1, drafted=1, k_max=8, tokens=110)  # agreeing again: no wait, k grows
    assert (p.k, p.misses, p.waits(110)) == (2, 0, 0)
    assert (p.drafted, p.kept) == (29, 14)  # what the round rule expects of it


def test_the_device_paces_rows_as_the_host_does():
    """`loop.pace_after` (the loop of rounds on the device keeps each row's pace)
    against `Pace.after`, over passes that kept all, some and none of their drafts, and
    rounds without drafts, from paces that had missed 0 to 7 times."""
    rng = np.random.default_rng(1)
    R, k_max = 64, 8
    paces = [Pace(int(rng.integers(1, k_max + 1)), int(rng.integers(0, 8))) for _ in range(R)]
    for p in paces:
        p.wait_until = int(rng.integers(0, 100))
    drafted = rng.integers(0, k_max + 1, R)
    kept = np.minimum(drafted, rng.integers(0, k_max + 1, R)) * (rng.random(R) < 0.6)
    tokens = rng.integers(1, 200, R)
    state = np.array([[p.k, p.misses, p.wait_until] for p in paces], np.int32)
    got = np.asarray(loop.pace_after(state, drafted, kept, tokens, k_max, MAX_WAIT))
    for p, d, a, n in zip(paces, drafted, kept, tokens):
        if d:
            p.after(int(a), int(d), k_max, int(n))
    assert got.tolist() == [[p.k, p.misses, p.wait_until] for p in paces]
    assert {(d > 0, a > 0) for d, a in zip(drafted, kept)} == {(0, 0), (1, 0), (1, 1)}


def test_a_pass_pads_its_drafts_to_the_ladder():
    assert ladder(1) == [1] and ladder(3) == [1, 2, 3]
    assert ladder(4) == [1, 2, 4] and ladder(8) == [1, 2, 4, 8] and ladder(6) == [1, 2, 4, 6]


# ---- the round rule: a pass or a plain chunk ---------------------------------------------


def test_the_round_rule_weighs_expected_tokens_against_measured_seconds():
    sure, unsure = 1.0, 0.25  # fractions of drafts kept
    rows = [(4, sure), (4, sure), (0, sure)]  # two rows with 4 drafts each, one without
    lengths = [2, 3, 5]
    # Unmeasured: the drafts' own pass runs (to be measured), then plain steps.
    assert RoundRule().choose(3, rows, lengths) == 5
    assert measured_rule(None, {5: 1.0}).choose(3, rows, lengths) == 1
    # A pass of 5 gives 3 + 8 tokens: against 3 a step, it pays below 11/3 steps.
    assert measured_rule(1.0, {5: 3.6}).choose(3, rows, lengths) == 5
    assert measured_rule(1.0, {5: 3.7}).choose(3, rows, lengths) == 1
    # Drafts seldom kept: 3 + 2 tokens; a pass of 3 positions (3 + 1 tokens) costs less.
    unsure_rows = [(d, unsure) for d, _ in rows]
    assert measured_rule(1.0, {5: 1.6}).choose(3, unsure_rows, lengths) == 5
    assert measured_rule(1.0, {5: 1.7}).choose(3, unsure_rows, lengths) == 1
    assert measured_rule(1.0, {3: 1.2, 5: 1.6}).choose(3, unsure_rows, lengths) == 3
    # Declined PROBE_AFTER rounds in a row, the drafts' pass runs once anyway.
    rule = measured_rule(1.0, {5: 3.7})
    got = [rule.choose(3, rows, lengths) for _ in range(2 * PROBE_AFTER + 2)]
    assert got == ([1] * PROBE_AFTER + [5]) * 2
    # A row's fraction: its own drafts', and PRIOR_DRAFTS of all rows' (1 before any).
    assert rule.fraction(0, 0) == 1.0 and PRIOR_DRAFTS == 4
    rule.passed(drafted=10, kept=5)
    assert rule.fraction(0, 0) == 0.5 and rule.fraction(12, 0) == 2 / (12 + 4)


def test_the_round_rule_loops_on_the_device_where_that_gives_tokens_faster():
    """`RoundRule.on_device`: the host's passes are measured first (they measure the
    widths the loop chooses among), then the device's loop; then the way of fewer
    seconds a token runs, and after PROBE_AFTER rounds in a row one way, the other runs
    once."""
    rule = RoundRule()
    ways = []
    for _ in range(SAMPLES):
        ways.append(rule.on_device(2))
        rule.saw(way_kind(2, False), 1.0)  # seconds a token
    for _ in range(SAMPLES):
        ways.append(rule.on_device(2))
        rule.saw(way_kind(2, True), 2.0)
    assert ways == [False] * SAMPLES + [True] * SAMPLES
    got = [rule.on_device(2) for _ in range(2 * PROBE_AFTER + 2)]
    assert got == ([False] * PROBE_AFTER + [True]) * 2
    assert not rule.on_device(3)  # another row count is measured apart
    for _ in range(RECENT):
        rule.saw(way_kind(2, True), 0.5)  # the loop got faster
    assert [rule.on_device(2) for _ in range(3)] == [True] * 3


def test_a_loop_runs_the_rounds_its_chunks_tokens_are_expected_to_take():
    """`RoundRule.loop_rounds`: a round is expected to give 1 + f (T - 1) tokens, so a
    chunk of 16 steps loops 2 passes of 9 while every draft is kept, more as fewer are."""
    rule = RoundRule()
    assert rule.loop_rounds(16, 9) == 2  # before any pass: every draft kept
    rule.passed(drafted=8, kept=4)
    assert rule.loop_rounds(16, 9) == 4  # 5 tokens a round
    rule.passed(drafted=8, kept=0)
    assert rule.loop_rounds(16, 9) == 6  # a quarter kept: 3 tokens a round
    assert rule.loop_rounds(16, 1) == 16  # no drafts: a token a round


def test_the_device_chooses_a_rounds_width_as_the_round_rule_does():
    """`loop.choose_width` (a loop of rounds chooses each round's pass on the
    device) against `RoundRule.choose`, on random drafts, kept fractions and measured
    seconds, some widths unmeasured, the step too."""
    rng = np.random.default_rng(2)
    widths = np.array([1, 2, 3, 5, 9], np.int32)  # k = 8
    n, chose = 3, set()
    for _ in range(60):
        d = rng.integers(0, 9, n) * (rng.random(n) < 0.7)
        f = rng.integers(0, 5, n) / 4
        seconds = rng.integers(1, 7, len(widths)) * (rng.random(len(widths)) < 0.8)
        rule = RoundRule()
        for _ in range(SAMPLES):
            for w, t in zip(widths, seconds):
                if t:
                    rule.saw(step_kind(n) if w == 1 else pass_kind(n, int(w)), float(t))
        got = widths[loop.choose_width(d, f, np.ones(n, bool), widths, seconds)]
        ask = min(w for w in widths if w >= 1 + d.max())
        lengths = [int(w) for w in widths[1:] if w <= ask]
        want = rule.choose(n, list(zip(d, f)), lengths) if d.max() else 1
        assert got == want
        chose.add(int(got))
    assert chose == set(widths.tolist())  # every width was chosen somewhere


def test_the_device_reads_kept_fractions_as_the_round_rule_does():
    """`loop.kept_fraction` against `RoundRule.fraction`, before any pass and
    after some."""
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 40, (16, 2))
    rows[:, 1] = np.minimum(rows[:, 1], rows[:, 0])
    for every in ((0, 0), (30, 12), (7, 7)):
        rule = RoundRule()
        rule.passed(*every)
        got = np.asarray(loop.kept_fraction(rows, np.array(every)))
        want = [rule.fraction(int(d), int(k)) for d, k in rows]
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_policy_plans_prompt_lookups_pass_then_its_loop_and_a_draft_models_counts():
    """`SpecPolicy.decide` on the planner's view of the rows: prompt lookup drafts for a
    row that decoded before the round (not for one admitted in it), the pass as wide as
    its drafts while unmeasured; a chunk of several passes runs from the host until the
    host's way is measured, then loops on the device with process 0's measures in the
    plan; never under a constraint. A draft model's rows get counts, not drafts."""
    lookup = SpecPolicy(SpeculativeConfig(3, "ngram", 2, 1), draft_model=False)
    rows = {0: Drafting((1, 2, 1, 2, 1), 2, None, 10), 1: Drafting(None, 1, None, 9)}
    drafts = ((0, (2, 1, 2)),)
    assert lookup.decide(rows, 2, 8) == (8, SpecPlan(4, drafts, host_way=True))
    for _ in range(SAMPLES):
        lookup.rule.saw(way_kind(2, False), 1.0)
    looped = SpecPlan(4, drafts, rounds=2, pass_seconds=(0.0,) * 4, overall=(0, 0))
    assert lookup.decide(rows, 2, 8) == (8, looped)
    assert lookup.decide(rows, 2, 8, constrained=True) == (8, SpecPlan(4, drafts))
    model = SpecPolicy(SpeculativeConfig(2, "draft_model", model="m"), draft_model=True)
    assert model.decide(rows, 2, 8) == (8, SpecPlan(3, asks=((0, 2),)))
