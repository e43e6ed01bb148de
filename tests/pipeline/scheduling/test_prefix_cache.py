"""pipeline.batch.prefix: blocks named by a hash chain in the KV pool's pages (lookups,
pages shared by rows, blocks kept for no row and evicted least recently let go first,
which blocks a row names), the block layout, and a scheduler whose requests get the
same tokens with the cache as without it, on every mesh shape, through hits that end
mid-block, evictions, two requests of one prefix in a round, and a conversation whose
turns hit the blocks of the replies before."""

import jax
import numpy as np
import pytest
from reference import TINY

from qwen3_spmd.model.checkpoint.hf import HFCheckpoint
from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.pipeline.batch.handles import Params
from qwen3_spmd.pipeline.batch.pages import PageBook
from qwen3_spmd.pipeline.batch.prefix import (
    PrefixBook,
    block_names,
    block_slot_pos,
    hit_blocks,
    prefix_block,
)
from qwen3_spmd.pipeline.batch.rowbook import RowBook
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.runtime.engine import Engine
from qwen3_spmd.pipeline.runtime.shapes import PrefillShape
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


def _named(prompt, pages, book: PrefixBook) -> None:
    """Names the prompt's whole blocks as held in `pages`, one page a block."""
    for name, page in zip(block_names(prompt, BLOCK), pages):
        book.name(name, (page,))


def test_a_hit_leaves_the_prompts_last_token_to_compute():
    assert [hit_blocks(n, BLOCK) for n in (1, 8, 9, 16, 17)] == [0, 0, 1, 1, 2]
    book = PrefixBook(PageBook(4), block=BLOCK, m=1)
    prompt = list(range(16))
    _named(prompt, [2, 0], book)
    assert book.lookup(prompt) == [(2,)]  # 16 tokens: block 1 would leave nothing to compute
    assert book.lookup(prompt + [5]) == [(2,), (0,)]
    assert book.lookup([7] + prompt) == []


def test_kept_blocks_count_free_and_go_least_recently_let_go_later_blocks_first():
    pages = PageBook(4)
    book = PrefixBook(pages, block=BLOCK, m=1)
    old, new = list(range(100, 117)), list(range(200, 217))
    a, b = pages.take(2), pages.take(1)  # two rows: pages 0, 1 and 2
    _named(old, a, book)
    _named(new, b, book)
    assert (pages.free, book.idle_pages, book.blocks_held) == (1, 0, 3)
    pages.give(a)  # old's blocks: the later (page 1) is let go first
    pages.give(b)
    assert (pages.free, pages.used, book.idle_pages) == (4, 0, 3)
    assert pages.take(2) == [1, 3]  # the free page 3, then old's later block evicted
    assert book.evictions == 1 and book.lookup(old) == [(0,)]
    # a row shares new's block: no longer evictable; old's first block is
    hit = book.lookup(new)
    assert hit == [(2,)] and book.idle_of(hit) == 1
    pages.share([2])
    assert (pages.free, book.idle_of(hit)) == (1, 0)
    assert pages.take(1) == [0] and book.lookup(old) == []
    with pytest.raises(ValueError, match="1 pages asked for, 0 of 4 free"):
        pages.take(1)
    # two rows hold page 2: it is kept only once both let it go
    pages.share([2])
    pages.give([2])
    assert pages.refs[2] == 1 and book.idle_pages == 0
    pages.give([2])
    assert book.idle_pages == 1 and book.lookup(new) == [(2,)]
    with pytest.raises(ValueError, match="page 2 is not"):
        pages.give([2])


def test_a_row_names_only_blocks_whose_slots_hold_their_positions():
    """One seq device: a 5-token prompt padded to 8 slots and 11 tokens after it. Decode
    right after the prompt (`RowBook.start`) leaves its tokens in order: two blocks; had
    it started past the padding, no block would hold its positions."""
    book = RowBook(1, 1, C=1, slots=32, block_size=BLOCK, prefix_block=BLOCK)
    tokens = list(range(50, 66))  # 16 tokens with K/V
    table = np.array(book.pages.take(4))
    in_order = np.full((1, 32), -1, np.int32)
    in_order[0, :16] = np.arange(16)
    book.name_blocks(table, tokens, in_order)
    assert book.prefix.lookup(tokens + [1]) == [(table[0],), (table[1],)]
    past_padding = np.full((1, 32), -1, np.int32)
    past_padding[0, :5], past_padding[0, 8:19] = np.arange(5), np.arange(5, 16)
    other = list(range(70, 86))
    book.name_blocks(table[2:], other, past_padding)
    assert book.prefix.lookup(other + [1]) == [] and book.prefix.blocks_held == 2
    assert prefix_block(C=1, block_size=8) == 8 and prefix_block(C=2, block_size=4) == 8
    assert prefix_block(C=2, block_size=3) == 12  # a page's 6 tokens: two, for 2C parts


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


def test_a_hit_survives_the_rounds_json():
    chunk = Chunk(3, 16, 21, PrefillShape(1, 8, True), cached=2)
    round = Round(chunk=chunk, preempts=(4,))
    assert Round.from_json(round.to_json()) == round


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


def _engine(cfg, S, C, X=1):
    """One engine per mesh for the module (1x1's serves the reference too: the programs
    of one `seq` device are the same with the cache and without it), in pages of
    BLOCK tokens: the cache's block is a page's."""
    if (S, C, X) not in _ENGINES:
        mesh = make_mesh(S, C, jax.devices()[: S * C * X], tensor=X)
        _ENGINES[S, C, X] = Engine(
            cfg, HFCheckpoint(TINY, cfg), mesh, max_seq_len=64, chunk=4, block_size=BLOCK // C
        )
    return _ENGINES[S, C, X]


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


@pytest.mark.parametrize(
    "mesh",
    [(1, 1), (2, 1), (1, 2), (2, 2), (1, 1, 2)],
    ids=lambda m: "x".join(map(str, m)),
)
def test_requests_get_the_same_tokens_with_the_cache_as_without(cfg, plain, mesh):
    engine = _engine(cfg, *mesh)
    pages = 9  # a row's most (8) and one: a long request evicts a kept block
    scheduler = Scheduler(
        engine,
        max_batch=4,
        prefill_tokens=32,
        prefix_caching=True,
        kv_cache_memory_bytes=pages * engine.copies.page_bytes_per_device(),
    )
    p, book = scheduler.prefix, scheduler.book
    assert (scheduler.pages, p.block, p.m) == (pages, BLOCK, 1)
    rng = np.random.default_rng(1)
    words = lambda n: rng.integers(0, cfg.V, n).tolist()  # noqa: E731
    system, other = words(19), words(17)
    # Requests that end at their first token first: only prompt blocks are named.
    greedy = Params(max_new_tokens=1)
    sampled = Params(max_new_tokens=1, sampling=Sampling(temperature=0.8, top_k=20), seed=7)

    def run(*requests):
        """Submits together (one round admits them), runs, returns (tokens, cached)."""
        handles = [scheduler.submit(p, params) for p, params in requests]
        scheduler.run()
        for h, (p, params) in zip(handles, requests):
            assert h.tokens == plain(p, params), (p, params)
        assert (book.pages.free, book.pages.refs.any()) == (pages, False)  # all let go
        return [h.cached_tokens for h in handles]

    # Every hit below leaves 7 or 8 tokens to compute: one chunk shape after a hit.
    # Misses: two short requests of one prefix admitted in one round; block 0 named once.
    assert run((system[:12] + words(3), greedy), (system[:12] + words(2), greedy)) == [0, 0]
    assert p.blocks_held == 1
    # A prompt of two whole blocks takes one: its last token is computed.
    assert run((system[:16], greedy)) == [8]
    # A hit that ends mid-block: 19 shared tokens, two whole blocks.
    assert run((system + words(4), sampled)) == [16]
    assert (p.blocks_held, p.evictions) == (2, 0)
    # A request of a row's 8 pages: its eighth is system's block 1's (let go before its
    # block 0, which the later need); with one seq device its reply's blocks are named
    # too (60 tokens with K/V: 7 blocks), with two its prompt's (21 tokens: 2).
    long = Params(max_new_tokens=40)
    assert run((other + words(4), long)) == [0]
    assert p.evictions == 1 and p.blocks_held == 1 + (7 if mesh[1] == 1 else 2)
    # Its chunk after the hit is padded to 16 tokens: 3 pages, 2 its own. With one seq
    # device one page is free, and the block let go least recently goes: the reply's last.
    assert run((system[:15], greedy)) == [8]
    evicted = 2 if mesh[1] == 1 else 1
    assert p.evictions == evicted and p.lookup(other + words(1))  # other's first blocks stay
    assert run((other + words(7), sampled)) == [16]
    assert (p.hits, p.evictions) == (8 + 16 + 8 + 16, evicted) and p.queries > p.hits

    # A conversation: each turn's prompt is the one before, its reply and a new user
    # turn. With one seq device the blocks of an ended request's prompt and reply (but
    # its last token, whose K/V no step wrote) are named, so the next turn hits the
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
    assert (book.pages.free, book.pages.refs.any()) == (pages, False)
