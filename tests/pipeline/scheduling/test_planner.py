"""pipeline.scheduling.planner, shapes and rowbook with no XLA: the scheduler's policy driven over a
fake engine whose programs return made-up tokens at once (as vLLM's scheduler tests feed
fake runner outputs). What a round plans, which shapes it pads to, and what the row book
holds after it are checked here; that the programs give each request its own tokens is
tests/pipeline/scheduling/test_scheduler.py's."""

import collections
import math
import types

import numpy as np
import pytest

from qwen3_spmd.pipeline.batch.handles import Params, Request
from qwen3_spmd.pipeline.batch.prefix import block_names
from qwen3_spmd.pipeline.batch.replicas import positions
from qwen3_spmd.pipeline.batch.rowbook import RowBook
from qwen3_spmd.pipeline.programs.layout import length_bucket
from qwen3_spmd.pipeline.programs.sampling import TOP_LOGPROBS, Sampling, TokenLogprobs
from qwen3_spmd.pipeline.requests import RequestError, check_request
from qwen3_spmd.pipeline.runtime.shapes import (
    LIGHT_TOKENS,
    MIN_PROMPT_TOKENS,
    DecodeShape,
    MoveShape,
    PrefillShape,
    ShapeRules,
)
from qwen3_spmd.pipeline.scheduling.planner import Planner, Round
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.pipeline.speculative.policy import Pace, SpecPlan, SpecPolicy

V = 97  # the fake model's vocabulary


def tokens_of(prompt, n: int) -> list[int]:
    """The fake model's n tokens after `prompt`: its last id plus 0, 1, 2, ... mod V."""
    return [(prompt[-1] + k) % V for k in range(n)]


def _no_logprobs(*shape) -> TokenLogprobs:
    top = (*shape, TOP_LOGPROBS)
    return TokenLogprobs(np.zeros(shape), np.zeros(top), np.zeros(top, np.int32))


class FakeEngine:
    """An Engine's face to the scheduler, without a model or a device: the tokens are
    `tokens_of` the prompt, whatever the row, batch or chunking; every program it is
    asked to run is recorded by shape. With D `data` replicas, every table it is given
    (in a program's order: replica blocks) must name each row's pages in its block's
    replica's part of the pool."""

    def __init__(self, stages=1, C=1, M=1, max_seq_len=64, chunk=4, D=1):
        self.D, self.stages, self.C, self.M, self.chunk = D, stages, C, M, chunk
        self.max_seq_len = max_seq_len
        self.block_size = 4  # a page's slots
        self.pages_per_row = math.ceil(math.ceil(max_seq_len / C) / self.block_size)
        self.slots_per_device = self.pages_per_row * self.block_size
        self.prefills: list[PrefillShape] = []
        self.decodes: list[tuple[DecodeShape, int]] = []  # and the steps run
        self.copies = self  # the cache's copies (pipeline.runtime.copies) are the methods below
        self.pooling = False  # a generate runner

    def groups_for(self, n):
        return min(self.stages, n)

    def check(self, prompts, max_new_tokens, min_tokens=0, eos_ids=()):
        """The one request check (`requests.check_request`), on the fake's vocabulary."""
        cfg = types.SimpleNamespace(V=V, max_position_embeddings=self.max_seq_len)
        check_request(cfg, self.C, self.max_seq_len, prompts, max_new_tokens, min_tokens, eos_ids)

    def empty_cache(self, B, pages=None):
        self.pool = pages
        return None

    def page_bytes_per_device(self):
        return 1  # so that a pool of kv_cache_memory_bytes=n holds n pages

    def cp_plan(self, B, P_pad):
        return "ring", {}

    def with_rows(self, cache, slot_pos, table=None):
        if table is not None:
            rows, pages = len(table) // self.D, self.pool // self.D  # a replica's
            for p, row in enumerate(table):
                held = row[row < self.pool]
                assert (held // pages == p // rows).all(), "a row reads another replica's pages"
        return cache

    def prefill(self, batch, strategy, params, sampled, clock, cache=None, allowed=None):
        """The first token of each row: its prompt's last id (one more for a preempted
        request's, whose prompt ends with its tokens so far: the next, as decode's)."""
        self.prefills.append(PrefillShape(batch.B, batch.P_pad, batch.offset > 0))
        inputs = batch.prefill
        first = [
            inputs.tokens[b][list(inputs.positions[b]).index(inputs.last_pos[b])]
            + (params.step0[b] > 0)
            for b in range(batch.B)
        ]
        return np.array(first) % V, None, cache, None

    def logprobs(self, logits, tokens):
        """Each token's log-probability is the token (so a row out of place shows)."""
        return _no_logprobs(len(tokens))._replace(chosen=np.asarray(tokens, float))

    def decode(self, cache, slot_pos, table, inputs, groups, sampled, with_logits, clock, logprobs):
        """Each row's next `chunk` tokens: one more than the last, each step. A busy row
        (in a program's order) reads the cache's row with its replica's pages: the same
        local row of its replica's block of the cache."""
        n = len(inputs.step)
        self.with_rows(cache, slot_pos, table)
        for p in np.flatnonzero(inputs.limit):
            d, i = divmod(p, n // self.D)
            assert (table[d * (len(table) // self.D) + i] < self.pool).any(), "no pages"
        constrained = inputs.allowed is not None
        self.decodes.append((DecodeShape(n, sampled, logprobs, constrained), int(inputs.run_steps)))
        tokens = (inputs.tokens[:, None] + 1 + np.arange(self.chunk)[None]) % V
        lp = _no_logprobs(n, self.chunk)._replace(chosen=tokens.astype(float))
        out = types.SimpleNamespace(tokens=tokens, logits=None, logprobs=lp)
        return out, cache


def _expected(prompt, p: Params) -> tuple[list[int], str]:
    want = tokens_of(prompt, p.max_new_tokens)
    for k, t in enumerate(want):
        if t in p.eos_ids:
            return want[: k + 1], "stop"
    return want, "length"


CONFIGS = [  # (stages, C, M, max_batch, prefill_tokens)
    (1, 1, 1, 3, 16),
    (2, 1, 1, 4, 12),
    (2, 2, 2, 4, 16),
    (1, 2, 1, 8, 8),
]


def _record_moves(sched) -> list[int]:
    """The rows each round moves (`RowBook.move`, one call a row)."""
    moves, move = [], sched.book.move
    sched.book.move = lambda a, b: moves.append(a) or move(a, b)
    return moves


def _check_pages(book: RowBook) -> None:
    """The page book's invariant: every page is free, kept by the prefix cache for no
    row, or held by as many rows as its count says, never two of these; a page two rows
    hold is a named block's, and no row writes into a named page (its next slot lies
    past them: no page has two writers); a row holds its first pages only."""
    pages, prefix = book.pages, book.prefix
    held = collections.Counter(p for p in book.table.flat if p < pages.pages)
    assert all(pages.refs[p] == held[p] for p in range(pages.pages)), "a page miscounted"
    named = set(prefix.name_of) if prefix is not None else set()
    kept, free = named - set(held), {p for heap in pages._heaps for p in heap}
    assert not free & (set(held) | kept), "a page held (or kept) and free"
    assert len(free) + len(kept) + len(held) == pages.pages, "a page lost"
    assert prefix is None or len(kept) == prefix.idle_pages
    assert {p for p, n in held.items() if n > 1} <= named, "a page shared but not named"
    C = book.slot_pos.shape[1]
    writes = {b: r.prompt_slots + (len(r.generated) - 1) // C for b, r in enumerate(book.rows) if r}
    if book.chunking is not None:
        writes[book.chunking.row] = book.chunking.offset
    for b, slot in writes.items():
        assert not set(book.table[b, slot // book.block_size :]) & named, "a named page written"
    for b in range(book.B):
        n = book.held(b)
        assert (book.table[b, :n] < book.pages.pages).all() and (
            book.table[b, n:] == book.pages.pages
        ).all()


@pytest.mark.parametrize(
    "D, cached",
    [(1, False), (1, True), (2, False), (2, True)],
    ids=["", "prefix-cache", "2-replicas", "2-replicas-prefix-cache"],
)
@pytest.mark.parametrize("pages", [None, 40, 16], ids=["every-row", "40-pages", "16-pages"])
@pytest.mark.parametrize("stages,C,M,rows,budget", CONFIGS)
def test_every_shape_a_load_plans_is_one_the_rules_declare(
    stages, C, M, rows, budget, pages, D, cached
):
    """A random load (staggered arrivals, short and long prompts, end ids, cancels,
    sampled rows and log-probabilities) over a fake engine: every prefill, decode and
    move the rounds run has a shape `ShapeRules.declared()` lists (what precompile
    compiles), each request gets its tokens, and every row is free at the end. With a
    pool of 40 or 16 pages of 4 slots (fewer than the rows' most; 16 holds one request
    of max_seq_len on one seq device), requests wait for pages and the youngest are
    preempted and resumed when decode runs out, with the same tokens. With the prefix
    cache, half the prompts begin with one of three shared prefixes: hits share pages,
    kept blocks are evicted when pages run short. Over 2 replicas (each `rows` rows and
    that many pages) every row reads its replica's pages (`FakeEngine.with_rows`), a
    hit's included.
    After every round the page book's invariant holds (`_check_pages`), and at the end
    every page is free or kept."""
    rng = np.random.default_rng(stages * 100 + C * 10 + rows)
    engine = FakeEngine(stages, C, M, max_seq_len=64, chunk=4, D=D)
    sched = Scheduler(
        engine,
        max_batch=rows,
        prefill_tokens=budget,
        short_chunk=2,
        kv_cache_memory_bytes=pages,
        prefix_caching=cached,
    )
    other = np.random.default_rng(7)  # the prefixes' draws (the load's are rng's alone)
    shared = [other.integers(0, V, int(other.integers(6, 24))).tolist() for _ in range(3)]
    moves = _record_moves(sched)
    handles, asked, cancelled = [], [], set()
    for wave in range(8):
        for _ in range(rng.integers(0, 4)):
            n = int(rng.integers(1, 12))
            prompt = rng.integers(0, V, int(rng.integers(1, 64 - n - 8))).tolist()
            if cached and other.random() < 0.5:
                prompt = (shared[int(other.integers(3))] + prompt)[: len(prompt)]
            eos = (int(rng.integers(0, V)),) if rng.random() < 0.3 else ()
            sampling = Sampling(temperature=0.7) if rng.random() < 0.3 else Sampling()
            p = Params(n, sampling, eos_ids=eos, logprobs=bool(rng.random() < 0.2))
            handles.append(sched.submit(prompt, p))
            asked.append((prompt, p))
        running = [i for i, h in enumerate(handles) if not h.done]
        if wave in (2, 5) and running:
            sched.cancel(handles[running[-1]])
            cancelled.add(running[-1])
        sched.step()
        _check_pages(sched.book)
    while not sched.idle:
        sched.step()
        _check_pages(sched.book)
    declared = sched.rules.declared()
    assert set(engine.prefills) <= set(declared.prefills)
    assert {shape for shape, _ in engine.decodes} <= set(declared.decodes)
    assert moves == [] or 1 in declared.moves
    assert sched.book.pages.free == sched.pages and not sched.book.pages.refs.any()
    if cached:
        assert sched.prefix.hits > 0
    for i, (h, (prompt, p)) in enumerate(zip(handles, asked)):
        if i in cancelled and h.finish_reason == "cancelled":
            assert h.tokens == tokens_of(prompt, len(h.tokens))
            continue
        assert (h.tokens, h.finish_reason) == _expected(prompt, p), i
        if p.logprobs:  # the fake's log-probability of a token is the token
            assert [lp.chosen for lp in h.logprobs] == h.tokens, i
    assert sched.book.live() == [] and sched.book.chunking is None
    assert len(sched.book.free_rows()) == sched.B


@pytest.mark.parametrize("stages,C,M,rows,budget", CONFIGS)
def test_first_shapes_and_the_rest_are_every_shape_once_and_a_light_load_meets_the_first(
    stages, C, M, rows, budget
):
    """`ShapeRules.first`: what a server compiles before serving and what it compiles
    after are together every declared shape, none twice, the first with the cover of
    stand-ins for all the others, the rest lightest first (the batched prefills last); a
    light load (one request at a time, prompts of at most LIGHT_TOKENS tokens, greedy
    or sampled) runs only first shapes."""
    engine = FakeEngine(stages, C, M, max_seq_len=64, chunk=4)
    sched = Scheduler(engine, max_batch=rows, prefill_tokens=budget, short_chunk=2)
    moves = _record_moves(sched)
    first, rest = sched.rules.first()
    shapes = first + rest
    assert len(shapes) == len(set(shapes)) == len(sched.rules.declared())
    assert set(shapes) == set(sched.rules.declared().shapes())
    rules, cover = sched.rules, sched.rules.cover()
    order = [(rules.batched(s), rules.weight(s)) for s in rest]
    assert first and order == sorted(order) and cover <= set(first)
    for s in shapes:  # the cover stands in for every shape (the batches by a microbatch)
        if isinstance(s, PrefillShape):
            assert any(
                (c.B, c.with_context) == (M, s.with_context) and s.P_pad <= c.P_pad <= 4 * s.P_pad
                for c in cover
                if isinstance(c, PrefillShape)
            ), s
        elif isinstance(s, DecodeShape):
            assert DecodeShape(rules.rows, True, s.logprobs) in cover
    rng = np.random.default_rng(rows)
    light = min(LIGHT_TOKENS, sched.rules.chunk_tokens)  # prompts in one prefill
    for i in range(6):
        prompt = rng.integers(0, V, int(rng.integers(1, light + 1))).tolist()
        sampling = Sampling(temperature=0.7) if i % 2 else Sampling()
        sched.submit(prompt, Params(int(rng.integers(1, 12)), sampling))
        sched.run()
    met = engine.prefills + [shape for shape, _ in engine.decodes]
    assert set(met) <= set(first), set(met) - set(first)
    assert MoveShape(1) in rest and not moves


def test_a_prompt_whose_bucket_leaves_no_room_is_padded_to_its_own_length():
    rules = ShapeRules(4, 1, 1, C=1, slots=32, max_seq_len=32, prefill_tokens=32, chunk_tokens=32)
    assert rules.prefill(1, 17, [8]) == PrefillShape(1, 24)  # bucket 24 + 7 steps fits 32
    assert rules.prefill(1, 17, [12]) == PrefillShape(1, 18)  # 24 + 11 would not
    assert rules.prefill(3, 5, [2, 2, 2]) == PrefillShape(4, MIN_PROMPT_TOKENS)


def _book_with(rows, groups, live: dict[int, tuple[Request, int]]) -> RowBook:
    book = RowBook(rows, groups, C=1, slots=64)
    for b, (request, generated) in live.items():
        book.start(b, request, request.prompt[-1], len(request.prompt), np.full((1, 64), -1))
        book.rows[b].generated += [0] * (generated - 1)
    return book


def test_admission_takes_each_length_bucket_in_whole_batches_into_the_lowest_rows():
    """Prompts of 17, 40, 20 and 18 tokens (buckets 24, 48, 24, 24): the three of
    bucket 24 make a batch of two and one of one (three rows would pad to four), then
    the 40."""
    rules = ShapeRules(4, 1, 1, C=1, slots=99, max_seq_len=99, prefill_tokens=99, chunk_tokens=99)
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4)
    lengths = (17, 40, 20, 18)
    waiting = [Request(i, tuple(range(1, n + 1)), Params(4)) for i, n in enumerate(lengths)]
    book = _book_with(4, 1, {})
    plan = planner.plan(book, waiting)
    got = [
        ([r.id for r in a.requests], a.rows, (a.shape.B, a.shape.P_pad)) for a in plan.admissions
    ]
    assert got == [([0, 2], (0, 1), (2, 24)), ([3], (2,), (1, 24)), ([1], (3,), (1, 48))]
    # every row busy, none waiting: the long chunk, cut to the 3 steps their budgets want
    assert plan.decode.shape.rows == 4 and plan.decode.steps == 3
    assert plan.taken() == {0, 1, 2, 3}
    assert planner.plan(book, waiting) == plan and book.live() == []  # it only reads


def test_the_round_carries_each_prefills_cp_strategy_as_the_planner_chose_it():
    """The CP strategy of each admission and chunk is chosen on process 0 by the planner's
    `cp` (the engine's cost model) and travels in the Round, so the executor of every
    process runs the same program; without a `cp` it is the ring."""
    rules = ShapeRules(4, 1, 1, C=1, slots=99, max_seq_len=99, prefill_tokens=99, chunk_tokens=32)
    asked = []

    def cp(shape):
        asked.append(shape)
        return "ulysses" if shape.P_pad == 24 else "ring"

    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4, cp=cp)
    waiting = [
        Request(0, tuple(range(1, 41)), Params(4)),  # long: a chunk of 32, then 8
        Request(1, tuple(range(1, 18)), Params(4)),
    ]
    plan = planner.plan(_book_with(4, 1, {}), waiting)
    assert [(a.shape.P_pad, a.cp) for a in plan.admissions] == [(24, "ulysses")]
    assert (plan.chunk.shape.P_pad, plan.chunk.cp) == (32, "ring")
    assert set(asked) == {plan.admissions[0].shape, plan.chunk.shape}
    assert Round.from_json(plan.to_json()) == plan
    plain = Planner(rules, stages=1, short_chunk=2, long_chunk=4).plan(
        _book_with(4, 1, {}), waiting
    )
    assert {a.cp for a in plain.admissions} | {plain.chunk.cp} == {"ring"}


def test_a_request_for_its_prompts_logprobs_is_prefilled_whole_past_a_prefix_hit():
    """With the prompt's first two 8-token blocks in the prefix cache, a request that
    does not ask for its prompt's log-probabilities is a hit (a chunk after the cached
    blocks); one that asks is admitted whole, in a prefill shape that scores."""
    rules = ShapeRules(
        4, 1, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=32, chunk_tokens=32, block=8
    )
    book = RowBook(4, 1, C=1, slots=64, block_size=8, prefix_block=8)
    prompt = tuple(range(1, 21))
    held = np.full((1, 64), -1)
    held[0, :20] = np.arange(20)
    book.name_blocks(np.array(book.pages.take(3)), prompt, held)  # a row's pages
    prefix = book.prefix
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4, prefix=prefix)
    plain = planner.plan(book, [Request(0, prompt, Params(4))])
    assert plain.chunk.cached and plain.chunk.start == 16 and not plain.admissions
    asked = planner.plan(book, [Request(0, prompt, Params(4, prompt_logprobs=True))])
    assert asked.chunk is None and [a.shape for a in asked.admissions] == [
        PrefillShape(1, 24, prompt_logprobs=True)
    ]


def test_while_programs_compile_a_round_takes_compiled_shapes_that_do_the_same_work():
    """`Planner.ready`: with one-prompt prefills of 48 tokens and the 4- and 8-row
    decodes compiled only, two prompts of bucket 24 go in one at a time, padded to 48;
    the lone request in row 7 stays there (no move) and the decode runs over 8 rows; a
    lone request in row 1 decodes over 4; with no prefill compiled, each prompt compiles
    a microbatch's own shape. With everything compiled, the same book gets the batch,
    the move and the 4-row chunk. A stand-in pads at most 4 times, where rows have room."""
    rules = ShapeRules(8, 1, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=64, chunk_tokens=64)
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4)
    waiting = [Request(i, tuple(range(1, 20 + i)), Params(4)) for i in range(2)]
    book = _book_with(8, 1, {7: (Request(9, (6,), Params(9)), 1)})
    want = planner.plan(book, waiting)
    assert [(a.shape, a.rows) for a in want.admissions] == [(PrefillShape(2, 24), (0, 1))]
    assert want.moves == ((7, 2),) and want.decode.shape == DecodeShape(4, True, False)
    compiled = {PrefillShape(1, 48), DecodeShape(4, True, False), DecodeShape(8, True, False)}
    planner.ready = compiled.__contains__
    got = planner.plan(book, waiting)
    assert [(a.shape, a.rows) for a in got.admissions] == [
        (PrefillShape(1, 48), (0,)),  # bucket 24, padded to a compiled length
        (PrefillShape(1, 48), (1,)),
    ]
    assert got.moves == () and got.decode.shape == DecodeShape(8, True, False)
    lone = planner.plan(_book_with(8, 1, {1: (Request(9, (6,), Params(9)), 1)}), [])
    assert lone.decode.shape == DecodeShape(4, True, False)  # 2 rows not compiled
    planner.ready = {DecodeShape(8, True, False)}.__contains__  # no prefill: a microbatch's own
    assert [a.shape for a in planner.plan(book, waiting).admissions] == [PrefillShape(1, 24)] * 2
    wide = ShapeRules(
        1, 1, 1, C=1, slots=256, max_seq_len=256, prefill_tokens=256, chunk_tokens=256
    )
    longer = [PrefillShape(1, P) for P in (24, 32, 48, 64, 96)]  # at most 4 x 24
    assert wide.prefill_stand_ins(PrefillShape(1, 24), [4]) == longer
    assert wide.prefill_stand_ins(PrefillShape(1, 24), [200]) == longer[:3]  # room for 200
    assert rules.decode_stand_ins(DecodeShape(4, True, False)) == [
        DecodeShape(4, True, False),
        DecodeShape(4, True, True),
        DecodeShape(8, True, False),
        DecodeShape(8, True, True),
    ]
    # A structured output's chunk (masks, one step) runs on a constrained shape only.
    constrained = rules.constrained_decodes()
    assert constrained == [DecodeShape(n, True, False, True) for n in (1, 2, 4, 8)]
    assert not set(constrained) & set(rules.declared().shapes())
    assert rules.decode_stand_ins(DecodeShape(4, True, False, True)) == [
        DecodeShape(4, True, False, True),
        DecodeShape(8, True, False, True),
    ]


def test_a_round_moves_a_lone_high_row_down_and_decodes_few_rows():
    """Rows 1 and 3 busy of 4 (1 group): the request in row 3 moves to row 0, and the
    chunk runs over rows 0-1 only."""
    rules = ShapeRules(4, 1, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=64, chunk_tokens=64)
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4)
    book = _book_with(
        4, 1, {1: (Request(0, (5,), Params(9)), 3), 3: (Request(1, (6,), Params(3)), 1)}
    )
    plan = planner.plan(book, [])
    assert plan.moves == ((3, 0),)
    assert plan.decode.shape == DecodeShape(2, sampled=True, logprobs=False)
    assert plan.decode.steps == 2  # short: rows are free


def test_over_replicas_a_request_goes_where_most_room_is_and_rows_move_within_theirs():
    """Two replicas of 4 rows (rows 0, 2, 4, 6 and 1, 3, 5, 7), a page a row: with 3
    rows busy on replica 0 and 1 on replica 1, the first two waiting requests go to
    replica 1 (more free pages), the third, at a tie of pages and rows, to replica 0
    (the lower number); each takes its replica's lowest free row, and the prefill
    places each in its replica's block (2 rows a replica). Later, requests left in rows 6
    and 7 move to rows 0 and 1, each within its replica, and the chunk runs over those
    two rows."""
    rules = ShapeRules(
        8, 1, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=64, chunk_tokens=64, replicas=2
    )
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4)
    book = RowBook(8, 1, C=1, slots=64, replicas=2)
    for b in (0, 2, 4, 1):
        book.start(b, Request(b, (5,), Params(9)), 5, 1, np.full((1, 64), -1))
        book.grow(b, 1)
    waiting = [Request(10 + i, (1, 2, 3), Params(4)) for i in range(3)]
    plan = planner.plan(book, waiting)
    (admission,) = plan.admissions
    assert admission.rows == (3, 5, 6) and admission.shape.B == 4
    assert positions(admission.rows, 2, admission.shape.B) == [2, 3, 0]
    assert plan.decode.shape.rows == 8
    late = RowBook(8, 1, C=1, slots=64, replicas=2)
    for b in (6, 7):
        late.start(b, Request(b, (5,), Params(9)), 5, 1, np.full((1, 64), -1))
        late.grow(b, 1)
    plan = planner.plan(late, [])
    assert plan.moves == ((6, 0), (7, 1)) and plan.decode.shape.rows == 2
    with pytest.raises(ValueError, match="rows 6 and 1 are on different replicas"):
        late.move(6, 1)


def test_over_replicas_a_prompt_goes_to_the_replica_that_holds_its_blocks_unless_busier():
    """Cache-aware routing: a prompt whose first two blocks replica 1 holds (no row
    holds them) is prefilled there past them, though replica 0 is as free and lower;
    once replica 1 is busier than replica 0 by more than ROUTING_MARGIN of a
    replica's rows (3 rows against none, margin 2), it goes to replica 0 and computes
    its whole prompt there."""
    rules = ShapeRules(
        8,
        1,
        1,
        C=1,
        slots=64,
        max_seq_len=64,
        prefill_tokens=64,
        chunk_tokens=64,
        block=4,
        replicas=2,
    )
    book = RowBook(8, 1, C=1, slots=64, block_size=4, pages=32, prefix_block=4, replicas=2)
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4, prefix=book.prefix)
    prompt = tuple(range(1, 14))
    pages = book.pages.take(2, replica=1)
    for name, page in zip(block_names(prompt, 4), pages):
        book.prefix.name(name, (page,))
    book.pages.give(pages)  # kept by the cache for no row
    assert book.prefix.lookup(prompt, 1) == [(16,), (17,)] and book.prefix.lookup(prompt) == []
    request = Request(0, prompt, Params(4))
    plan = planner.plan(book, [request])
    assert plan.chunk.row == 1 and plan.chunk.cached == 2 and plan.admissions == ()
    for b in (1, 3, 5):
        book.start(b, Request(10 + b, (5,), Params(9)), 5, 1, np.full((1, 64), -1))
        book.grow(b, 1)
    plan = planner.plan(book, [request])
    assert plan.chunk is None and [a.rows for a in plan.admissions] == [(0,)]


class Repeat:
    """A drafter that proposes the context's last token k times (a host drafter, as
    prompt lookup is)."""

    num_speculative_tokens = 3

    def propose(self, context, k):
        return [context[-1]] * k


def test_the_planner_decides_speculation_and_the_round_carries_it():
    """With a speculative policy, process 0's planner drafts for the rows that decoded
    before the round, under the rows they hold after its moves (row 3's request moved
    to row 0), not for a row admitted this round (its first token comes from this
    round's prefill); the pass is the ladder's width for its drafts (before any
    measure, the drafts' own); the plan travels in the Round as it is."""
    rules = ShapeRules(4, 1, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=64, chunk_tokens=64)
    policy = SpecPolicy(Repeat(), draft_model=False)
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4, speculate=policy)
    book = _book_with(
        4, 1, {1: (Request(0, (5,), Params(9)), 3), 3: (Request(1, (6, 7), Params(9)), 2)}
    )
    plan = planner.plan(book, [])
    assert plan.moves == ((3, 0),)
    # rows 1 (tokens [5, 0, 0]: the book's filler) and 3 (its [7, 0], now in row 0) each
    # draft their last token 3 times (k 3; each may make 6 or 7 more)
    assert plan.decode.spec == SpecPlan(4, drafts=((0, (0, 0, 0)), (1, (0, 0, 0))))
    assert Round.from_json(plan.to_json()) == plan
    assert book.rows[3] is not None and book.rows[0] is None  # the planner only reads
    book = _book_with(4, 1, {0: (Request(0, (5,), Params(9)), 1)})
    plan = planner.plan(book, [Request(2, (8, 9), Params(9))])
    assert plan.admissions[0].rows == (1,)
    assert plan.decode.spec == SpecPlan(4, drafts=((0, (5, 5, 5)),))  # row 1 drafts later
    # Every row busy (the long chunk, 16), none may draft: plain steps to the first
    # row's turn (row 0 waits 6 tokens more), at least k + 1.
    long = Planner(rules, stages=1, short_chunk=2, long_chunk=16, speculate=policy)
    full = _book_with(4, 1, {b: (Request(b, (5,), Params(40)), 3) for b in range(4)})
    for b, wait in enumerate((6, 9, 7, 8)):
        full.rows[b].pace = Pace(3, misses=1, wait_until=3 + wait)
    plan = long.plan(full, [])
    assert plan.decode.spec is None and plan.decode.steps == 6
    full.rows[0].pace.wait_until = 3 + 1  # its turn after 1 token: k + 1 steps
    assert long.plan(full, []).decode.steps == 4


def test_on_two_stages_the_chunk_ends_at_a_rows_budget_only_when_running_on_costs_more():
    """Full rows on 2 stages with a request waiting: a chunk of 4 past a row with 1
    step left would leave it empty 3 steps (3 > S - 1 = 1 x 4 rows / 2 groups): it ends
    after 1; with 3 steps left, 1 empty step costs less than a fill: it runs on."""
    rules = ShapeRules(4, 2, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=64, chunk_tokens=64)
    planner = Planner(rules, stages=2, short_chunk=4, long_chunk=4)
    waiting = [Request(9, (1, 2), Params(3))]
    for left, take in [(1, 1), (3, 4)]:
        live = {b: (Request(b, (b + 1,), Params(12)), 1) for b in range(4)}
        live[0] = (Request(0, (1,), Params(left + 1)), 1)
        plan = planner.plan(_book_with(4, 2, live), waiting)
        assert plan.admissions == () and plan.decode.steps == take


def test_cancels_are_found_wherever_the_request_is():
    """A cancelled request waiting, in a row, or chunking: the round names each, frees
    the row (the long prompt's held row too) and admits into it."""
    rules = ShapeRules(2, 1, 1, C=1, slots=64, max_seq_len=64, prefill_tokens=8, chunk_tokens=8)
    planner = Planner(rules, stages=1, short_chunk=2, long_chunk=4)
    book = _book_with(2, 1, {0: (Request(0, (5,), Params(9)), 2)})
    book.hold(Request(1, tuple(range(20)), Params(4)), 1)
    waiting = [Request(2, (1, 2, 3), Params(4)), Request(3, (4, 5), Params(4))]
    plan = planner.plan(book, waiting, cancels={0, 1, 2})
    assert plan.cancels == (2, 0, 1) and plan.chunk is None
    (admitted,) = plan.admissions
    assert [r.id for r in admitted.requests] == [3] and admitted.rows == (0,)


def test_min_tokens_out_of_range_is_one_line():
    """A row's ban ends at an int32 step: past it (or below 0) a RequestError naming the
    field, before anything is queued."""
    sched = Scheduler(FakeEngine(stages=1, C=1, M=1, max_seq_len=64, chunk=4), max_batch=2)
    for bad in (-1, 2**31):
        with pytest.raises(RequestError, match=r"^min_tokens .* must be in \[0, 2\*\*31\)"):
            sched.submit([1, 2], Params(4, min_tokens=bad))
    assert sched.idle


def test_a_long_prompt_is_planned_a_chunk_a_round_the_last_padded_to_its_bucket():
    engine = FakeEngine(stages=1, C=1, M=1, max_seq_len=128, chunk=4)
    sched = Scheduler(engine, max_batch=2, prefill_tokens=32)
    prompt = list(range(1, 87))
    h = sched.submit(prompt, Params(5))
    plans = []
    while not h.tokens:
        sched.step()
        plans.append(engine.prefills[-1])
    assert [(p.P_pad, p.with_context) for p in plans] == [
        (32, False),
        (32, True),
        (length_bucket(22, 2), True),
    ]
    sched.run()
    assert h.tokens == tokens_of(prompt, 5)


# ---- constrained requests (structured outputs) ------------------------------------------


class _Counting:
    """A stand-in for a row's grammar matcher: every token allowed, the answer done
    after `n` tokens."""

    def __init__(self, n: int):
        self.n = n

    def fill(self, masks, row):
        masks[row] = -1

    def take(self, token) -> bool:
        self.n -= 1
        return self.n == 0


class _AnyGrammar:
    """`Grammars`' face to the scheduler: a constraint's answer is done after as many
    tokens as its spec has characters."""

    def compile(self, constraint, bounded=True):
        pass

    def masks(self, rows):
        return np.full((rows, -(-V // 32)), -1, np.int32)

    def matcher(self, constraint):
        return _Counting(len(constraint.spec))


def test_a_constrained_request_makes_each_chunk_one_step_until_it_ends():
    """While a row holds a constrained request, every decode chunk runs one step with the
    rows' masks (the host advances its grammar between tokens); its grammar's end is a
    "stop"; then chunks run long again, without masks. The Round carries the constraint
    (other processes run the same matcher)."""
    from qwen3_spmd.pipeline.scheduling.planner import Round
    from qwen3_spmd.pipeline.structured.constraints import Constraint

    engine = FakeEngine(chunk=4)
    sched = Scheduler(engine, max_batch=2, short_chunk=4, grammars=_AnyGrammar())
    free = sched.submit([5, 6], Params(12))
    held = sched.submit([7, 8], Params(12, constraint=Constraint("regex", "abcd")))
    plan = sched.planner.plan(sched.book, [free.request, held.request])
    assert Round.from_json(plan.to_json()) == plan
    sched.run()
    assert (held.tokens, held.finish_reason) == (tokens_of([7, 8], 4), "stop")
    assert (free.tokens, free.finish_reason) == (tokens_of([5, 6], 12), "length")
    # three one-step chunks while the constrained request runs (its tokens 2-4)
    steps = [(shape.constrained, run) for shape, run in engine.decodes]
    assert steps[:3] == [(True, 1)] * 3 and all(not c and run > 1 for c, run in steps[3:])


def test_a_decode_programs_empty_inputs_are_an_empty_books():
    """The engine lowers a decode program ahead on `DecodeInputs.empty` (it imports no
    row book): the same shapes, dtypes and values as an empty book's chunk inputs."""
    import jax

    from qwen3_spmd.pipeline.programs.decode import DecodeInputs

    for rows in (1, 4, 8):
        book = RowBook(rows, 1, 2, 16).decode_inputs(rows, 0)
        empty = DecodeInputs.empty(rows)
        assert jax.tree.structure(book) == jax.tree.structure(empty)
        for a, b in zip(jax.tree.leaves(book), jax.tree.leaves(empty)):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_when_pages_run_out_the_youngest_is_preempted_and_resumed_with_its_tokens():
    """Four requests of 40 new tokens over a pool of 16 pages of 4 slots (one such
    request's most): they start with their prompt's and first chunk's pages, grow as
    they decode, and when the pages run out the youngest gives its pages back and is
    prefilled again later from its prompt and tokens so far (its round's plan says so,
    and survives the trip to the followers as JSON). Every request gets its tokens, in
    order, none lost or repeated; no page is ever held twice; all are free at the end."""
    engine = FakeEngine(1, 1, 1, max_seq_len=64, chunk=4)
    sched = Scheduler(engine, max_batch=4, short_chunk=2, kv_cache_memory_bytes=16)
    prompts = [[i + 1, i + 2, i + 3] for i in range(4)]
    handles = [sched.submit(p, Params(40)) for p in prompts]
    planned, plan = [], sched.planner.plan

    def planning(*args, **kw):
        round = plan(*args, **kw)
        assert Round.from_json(round.to_json()) == round
        planned.append(round.preempts)
        return round

    sched.planner.plan = planning
    while not sched.idle:
        sched.step()
        _check_pages(sched.book)
    preempted = [id for p in planned for id in p]
    assert sched.preemptions == len(preempted) > 0
    assert handles[0].id not in preempted  # the oldest always keeps its pages
    for h, p in zip(handles, prompts):
        assert (h.tokens, h.finish_reason) == (tokens_of(p, 40), "length")
    assert sched.book.pages.free == 16 and sched.most_running >= 2
