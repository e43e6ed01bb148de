"""pipeline.batch.prefix: prompt blocks named by a hash chain, the pool's book (lookups, least
recently used eviction, the saves a round plans), the block layout, and a scheduler
whose requests get the same tokens with the cache as without it, on every mesh shape,
through hits that end mid-block, evictions, two requests of one prefix in a round, and
a conversation whose turns hit the blocks of the replies before."""

import jax
import numpy as np
import pytest
from reference import TINY

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.batch.prefix import (
    PrefixBook,
    Save,
    block_names,
    block_slot_pos,
    block_slots,
    hit_blocks,
    plan_saves,
)
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.runtime.shapes import CopyShape, PrefillShape
from qwen3_spmd.pipeline.scheduling.planner import Chunk, Round
from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler
from qwen3_spmd.ring import causal_work, zigzag, zigzag_blocks
from qwen3_spmd.sharding.mesh import make_mesh

BLOCK = 8


def test_a_blocks_name_is_the_same_exactly_when_every_token_up_to_its_end_is():
    a = list(range(40))
    b = a[:20] + [999] + a[21:]  # differs in block 2 (tokens 16..23)
    na, nb = block_names(a, BLOCK), block_names(b, BLOCK)
    assert len(na) == 5 and len(block_names(a[:39], BLOCK)) == 4  # whole blocks only
    assert na[:2] == nb[:2] and all(x != y for x, y in zip(na[2:], nb[2:]))
    # the same tokens after a different start: a different name
    assert block_names(a[8:16], BLOCK)[0] != na[1]
    assert len(set(na)) == 5


def test_a_hit_leaves_the_prompts_last_token_to_compute():
    assert [hit_blocks(n, BLOCK) for n in (1, 8, 9, 16, 17)] == [0, 0, 1, 1, 2]
    book = PrefixBook(slots=4, block=BLOCK)
    prompt = list(range(16))
    for j, name in enumerate(block_names(prompt, BLOCK)):
        book.store(Save(row=0, block=j, slot=j, name=name))
    assert book.lookup(prompt) == (0,)  # 16 tokens: block 1 would leave nothing to compute
    assert book.lookup(prompt + [5]) == (0, 1)
    assert book.lookup([7] + prompt) == ()


def test_eviction_takes_empty_slots_then_the_least_recently_used_later_blocks_first():
    book = PrefixBook(slots=4, block=BLOCK)
    old, new = list(range(100, 117)), list(range(200, 217))
    book.tick()
    for j, name in enumerate(block_names(old, BLOCK)):
        book.store(Save(0, j, j, name))  # slots 0, 1
    assert book.victims(2, keep=set()) == [2, 3]  # empty ones first
    book.tick()
    book.store(Save(0, 0, 2, block_names(new, BLOCK)[0]))
    book.tick()
    book.use((2,), prompt_tokens=17)
    # slot 3 is empty; then old's blocks, the later (1) before the earlier (0); 2 is recent
    assert book.victims(4, keep=set()) == [3, 1, 0, 2]
    assert book.victims(2, keep={3, 1}) == [0, 2]
    assert (book.queries, book.hits) == (17, BLOCK)
    book.store(Save(0, 1, 1, "x" * 32))
    assert book.evictions == 1 and book.lookup(old) == (0,)


def test_a_rounds_saves_skip_what_the_pool_holds_and_keep_the_blocks_a_new_one_follows():
    book = PrefixBook(slots=3, block=BLOCK)
    shared = list(range(16))
    first = block_names(shared, BLOCK)[0]
    book.store(Save(0, 0, 0, first))
    a, b = shared + [1, 2, 3], shared + [4, 5]
    saves = plan_saves(book, [(2, a), (3, b)], keep=set())
    # block 0 is held (its slot 0 is kept), block 1 once for both prompts, from row 2
    assert [(s.row, s.block, s.slot) for s in saves] == [(2, 1, 1)]
    assert saves[0].name == block_names(a, BLOCK)[1]
    # a pool of one slot holding block 0: no room for block 1 without losing block 0
    small = PrefixBook(slots=1, block=BLOCK)
    small.store(Save(0, 0, 0, first))
    assert plan_saves(small, [(0, a)], keep=set()) == ()


def test_blocks_sit_at_the_same_local_slots_in_every_prompt_and_the_work_stays_balanced():
    C = 2
    for length in (8, 16, 24, 40):
        part = zigzag_blocks(length, C, BLOCK)
        for c in range(C):
            for j in range(length // BLOCK):  # block j: local slots [4j, 4j + 4) of each device
                np.testing.assert_array_equal(
                    part[c][j * 4 : (j + 1) * 4], zigzag(BLOCK, C)[c] + j * BLOCK
                )
        work = causal_work(part)
        assert len(set(work)) == 1, work
    np.testing.assert_array_equal(
        block_slot_pos(2, BLOCK, C, slots=10)[:, :8], np.stack(zigzag_blocks(16, C, BLOCK))
    )
    assert (block_slot_pos(2, BLOCK, C, slots=10)[:, 8:] == -1).all()
    assert [p.tolist() for p in zigzag_blocks(16, 2, 16)] == [p.tolist() for p in zigzag(16, 2)]
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_blocks(16, 2, 6)


def test_the_pools_decisions_survive_the_rounds_json():
    chunk = Chunk(3, 16, 21, PrefillShape(1, 8, True), cached=(4, 0))
    round = Round(
        chunk=chunk, saves=(Save(1, 2, 5, "ab" * 16),), ended_saves=(Save(0, 1, 2, "c" * 32),)
    )
    assert Round.from_json(round.to_json()) == round


def test_an_ended_rows_blocks_are_read_from_its_prompt_and_decode_slots():
    # A 5-token prompt padded to 8 slots, then 7 decode steps from slot 8 (positions 5-11).
    slot_pos = np.full(16, -1, np.int32)
    slot_pos[:5] = np.arange(5)
    slot_pos[8:15] = np.arange(5, 12)
    np.testing.assert_array_equal(
        block_slots(slot_pos, 4, 3), [[0, 1, 2, 3], [4, 8, 9, 10], [11, 12, 13, 14]]
    )
    with pytest.raises(ValueError, match="no slot"):
        block_slots(slot_pos, 4, 4)  # positions 12-15 were never written


# ---- a scheduler with the cache against one without, on every mesh -------------------


@pytest.fixture(scope="module")
def cfg():
    return Qwen3Config.from_hf(TINY)


_ENGINES = {}


@pytest.fixture(scope="module", autouse=True)
def _engines_go_with_the_module():
    """The module's engines are let go when it ends, and their compiled programs with
    them (conftest's `_release_programs`)."""
    yield
    _ENGINES.clear()


def _engine(cfg, S, C):
    """One engine per mesh for the module (1x1's serves the reference too: the programs
    of one `seq` device are the same with the cache and without it)."""
    if (S, C) not in _ENGINES:
        mesh = make_mesh(S, C, jax.devices()[: S * C])
        _ENGINES[S, C] = Engine(cfg, HFCheckpoint(TINY, cfg), mesh, max_seq_len=64, chunk=4)
    return _ENGINES[S, C]


@pytest.fixture(scope="module")
def plain(cfg):
    """(prompt, params) -> its tokens from a 1x1 scheduler without a cache, alone."""
    scheduler, seen = Scheduler(_engine(cfg, 1, 1), max_batch=4, prefill_tokens=32), {}

    def tokens(prompt, params):
        key = (tuple(prompt), params)
        if key not in seen:
            handle = scheduler.submit(prompt, params)
            scheduler.run()
            seen[key] = handle.tokens
        return seen[key]

    return tokens


@pytest.mark.parametrize("mesh", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_requests_get_the_same_tokens_with_the_cache_as_without(cfg, plain, mesh):
    engine = _engine(cfg, *mesh)
    pool = 3 * engine.copies.pool_bytes_per_block(BLOCK)  # three blocks: evictions happen
    scheduler = Scheduler(
        engine, max_batch=4, prefill_tokens=32, prefix_cache_bytes=pool, prefix_block=BLOCK
    )
    assert (scheduler.prefix.slots, scheduler.prefix.block) == (3, BLOCK)
    copies = [s for s in scheduler.rules.declared().shapes() if isinstance(s, CopyShape)]
    assert copies == [CopyShape("load"), CopyShape("save")]
    assert scheduler.precompile(copies) == 2  # what a server compiles before it serves
    rng = np.random.default_rng(1)
    words = lambda n: rng.integers(0, cfg.V, n).tolist()  # noqa: E731
    system, other = words(19), words(17)
    # Requests that end at their first token first: the pool then holds prompt blocks only.
    greedy = Params(max_new_tokens=1)
    sampled = Params(max_new_tokens=1, sampling=Sampling(temperature=0.8, top_k=20), seed=7)

    def run(*requests):
        """Submits together (one round admits them), runs, returns (tokens, cached)."""
        handles = [scheduler.submit(p, params) for p, params in requests]
        scheduler.run()
        for h, (p, params) in zip(handles, requests):
            assert h.tokens == plain(p, params), (p, params)
        return [h.cached_tokens for h in handles]

    # Every hit below leaves 7 or 8 tokens to compute: one chunk shape after a hit.
    # Misses: two short requests of one prefix admitted in one round; block 0 saved once.
    assert run((system[:12] + words(3), greedy), (system[:12] + words(2), greedy)) == [0, 0]
    assert scheduler.prefix.blocks_held == 1
    # A prompt of two whole blocks takes one: its last token is computed.
    assert run((system[:16], greedy)) == [8]
    # A hit that ends mid-block: 19 shared tokens, two whole blocks.
    assert run((system + words(4), sampled)) == [16]
    # Another prefix takes the empty slot and evicts the least recently used block, the
    # later of system's two first.
    assert run((other + words(4), greedy)) == [0]
    assert scheduler.prefix.evictions == 1
    assert run((system[:15], greedy)) == [8]
    assert run((other + words(7), sampled)) == [16]  # evicts system's block 0 for its third
    assert run((system[:12] + words(3), greedy)) == [0]
    p = scheduler.prefix
    assert (p.hits, p.evictions) == (8 + 16 + 8 + 16, 3) and p.queries > p.hits

    # A conversation: each turn's prompt is the one before, its reply and a new user
    # turn. With one seq device the blocks of an ended request's prompt and reply (but
    # its last token, whose K/V no step wrote) are saved, so the next turn hits the
    # reply's blocks too; with two only its prompt's.
    greedy = Params(max_new_tokens=5)
    sampled = Params(max_new_tokens=5, sampling=Sampling(temperature=0.8, top_k=20), seed=7)
    turn, cached = words(6), []
    for params, user in ((greedy, 4), (sampled, 3), (greedy, 2)):
        handle = scheduler.submit(turn, params)
        scheduler.run()
        assert handle.tokens == plain(turn, params), (turn, params)
        cached.append(handle.cached_tokens)
        turn = turn + handle.tokens + words(user)  # 6, 15, 23 and 30 tokens
    # 6 + 4 = 10 tokens with K/V: block 0 (generated tokens in it); then 15 + 4 = 19: 2.
    assert cached == ([0, 8, 16] if mesh[1] == 1 else [0, 0, 8])
