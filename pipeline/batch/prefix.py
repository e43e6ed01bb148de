"""Automatic prefix caching: the pages of prompt blocks a later prompt reads instead of
computing them.

Chat traffic repeats itself (a system prompt, tool definitions, the turns before), so
the K/V pages a request wrote for its tokens' whole blocks stay named in the KV pool
after it ends, and a prompt that begins with named blocks puts those pages in its own
block table (shared by reference: no K/V is copied) and prefills only the rest, as a
long prompt's later chunks do (`ring.context_attention` reads the shared pages).

    block   `block` tokens, one page's (C x block_size tokens), or two where a page's
            are not a multiple of 2C. With the cache on every prompt is laid out block
            by block (`ring.zigzag_blocks`), so block j of any prompt sits at the same
            local slots of every `seq` device, [j*n, (j+1)*n) with n = block / C: the
            pages of table entries [j*n/bs, (j+1)*n/bs), the same K/V wherever the same
            tokens come first.
    name    a hash chain: block j's name hashes block j-1's name and block j's tokens,
            so equal names mean equal tokens from position 0 on, hence equal K/V.
    book    `PrefixBook`, on the host: which pages hold each named block, and which
            blocks no row holds (evictable, least recently let go first). The page book
            (`pipeline.batch.pages`) counts them free; it evicts them only when a row
            needs a page and no other is free. The planner reads the book (the longest
            named run of a prompt's blocks); the row book names blocks and the page
            book evicts them, in the round's order, on every process alike.

A request writes only pages it owns: a named block is whole (its tokens all before
the request's next slot), and a hit's prompt computes from its first unnamed block
on, into pages of its own. A prompt's last token is always computed (its logits give
the first token), so a hit covers at most (len - 1) // block blocks. A row names its
whole blocks as its prefill writes them, and when it lets its pages go (it ended, was
cancelled or preempted) the blocks of its prompt and generated tokens together (those
whose K/V it holds: all but the last token), so a conversation's next turn (the
prompt, the reply, a new user turn) hits the reply's blocks too, and a preempted
request its own. Generated tokens sit in a block's layout with one `seq` device only
(decode continues right after the prompt); with several they sit round-robin over the
devices (`ring.decode_slot`) and only prompt blocks are named. The generated tokens'
K/V were computed by decode steps, not by a prefill, so a turn that hits them differs
from one that computes them by float rounding only, as two mesh shapes do.

With `data` replicas each replica's pages are its own, and so are its named blocks:
a name is looked up on one replica (the planner routes a prompt to the replica that
holds its blocks, `pipeline.scheduling.planner`), two replicas may each hold the same
block, and each replica evicts its own least recently let go.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from typing import TYPE_CHECKING

import numpy as np

from qwen3_spmd.ring import zigzag_blocks

if TYPE_CHECKING:
    from qwen3_spmd.pipeline.batch.pages import PageBook

ROOT = b"qwen3-spmd prefix"


def block_names(prompt, block: int) -> list[str]:
    """The names of the prompt's whole blocks, in order: block j's name hashes block
    j-1's and block j's token ids (hex, 32 characters)."""
    names, previous = [], ROOT
    tokens = np.asarray(prompt, np.int64)
    for j in range(len(tokens) // block):
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(tokens[j * block : (j + 1) * block].tobytes())
        previous = h.digest()
        names.append(h.hexdigest())
    return names


def hit_blocks(length: int, block: int) -> int:
    """The most blocks a prompt of `length` tokens can take from the pool: its last
    token is always computed."""
    return max(length - 1, 0) // block


def block_slot_pos(blocks: int, block: int, C: int, slots: int) -> np.ndarray:
    """[C, slots] the positions the local cache slots of a row's first `blocks` blocks
    hold (the rest -1), as `pipeline.programs.layout.lay_out` lays them."""
    slot_pos = np.full((C, slots), -1, np.int32)
    if blocks:
        part = zigzag_blocks(blocks * block, C, block)
        slot_pos[:, : blocks * block // C] = np.stack(part)
    return slot_pos


def prefix_block(C: int, block_size: int) -> int:
    """The prefix cache's block in tokens on C seq devices with pages of `block_size`
    local slots: a page's C x block_size tokens, or two pages' where that is not a
    multiple of 2C (a block's zigzag layout splits it into 2C parts)."""
    page = C * block_size
    return page if page % (2 * C) == 0 else 2 * page


Key = tuple[int, str]  # (replica, block name): a named block on one replica's pages


class PrefixBook:
    """The named blocks of the page book `pages`, each `block` tokens in `m` pages, each
    on its replica's pages. Counts, for /metrics: prompt tokens looked up (`queries`),
    those found (`hits`), blocks evicted."""

    def __init__(self, pages: PageBook, block: int, m: int):
        self.book, self.block, self.m = pages, block, m
        pages.cache = self
        # A waiting prompt is looked up every round until admitted: hash each prompt
        # once. As many as the server's default queue (256) and as many again, not
        # every prompt ever seen.
        self.names = functools.lru_cache(maxsize=512)(lambda prompt: block_names(prompt, block))
        self.where: dict[Key, tuple[int, ...]] = {}  # a named block -> its pages
        self.name_of: dict[int, Key] = {}  # page -> the block it is part of
        # Each replica's blocks no row holds, least recently let go first (a request's
        # later blocks before its earlier ones, which the later need).
        self._idle: list[collections.OrderedDict[Key, None]] = [
            collections.OrderedDict() for _ in range(pages.replicas)
        ]
        self.queries = self.hits = self.evictions = 0

    # ---- reading (the planner) ---------------------------------------------------

    def lookup(self, prompt, replica: int = 0) -> list[tuple[int, ...]]:
        """The pages of the longest run of the prompt's first blocks the book names on
        `replica` (at most `hit_blocks`), block by block."""
        found = []
        for name in self.names(tuple(prompt))[: hit_blocks(len(prompt), self.block)]:
            pages = self.where.get((replica, name))
            if pages is None:
                break
            found.append(pages)
        return found

    def idle_of(self, blocks) -> int:
        """Pages of `blocks` (lists of pages, `lookup`'s) that no row holds: a row that
        shares them takes them out of the free count."""
        return sum(len(pages) for pages in blocks if self._is_idle(self.name_of[pages[0]]))

    def _is_idle(self, key: Key) -> bool:
        return key in self._idle[key[0]]

    @property
    def idle_pages(self) -> int:
        """Pages the book keeps for no row."""
        return sum(map(len, self._idle)) * self.m

    def idle_in(self, replica: int) -> int:
        """Pages the book keeps for no row on `replica`."""
        return len(self._idle[replica]) * self.m

    @property
    def blocks_held(self) -> int:
        return len(self.where)

    def keeps(self, page: int) -> bool:
        return page in self.name_of

    # ---- writing (the row book and the page book, in the round's order) ----------

    def name(self, name: str, pages: tuple[int, ...]) -> None:
        """A row's `pages` hold block `name` (whole): later prompts on their replica may
        share them. A name that replica has already, or pages of another name, stay as
        they are."""
        key = (self.book.replica(pages[0]), name)
        if key in self.where or any(p in self.name_of for p in pages):
            return
        self.where[key] = pages
        self.name_of.update((p, key) for p in pages)

    def idle(self, page: int) -> None:
        """No row holds `page` any more: its block, once no row holds any of its pages,
        is its replica's most recently let go."""
        key = self.name_of[page]
        if not self.book.refs[list(self.where[key])].any():
            idle = self._idle[key[0]]
            idle[key] = None
            idle.move_to_end(key)

    def busy(self, page: int) -> None:
        """A row shares `page`: its block is not evictable while it does."""
        key = self.name_of[page]
        self._idle[key[0]].pop(key, None)

    def evict(self, replica: int = 0) -> tuple[int, ...]:
        """The least recently let go block of `replica` is forgotten: its pages (free
        now)."""
        key, _ = self._idle[replica].popitem(last=False)
        pages = self.where.pop(key)
        for p in pages:
            del self.name_of[p]
        self.evictions += 1
        return pages

    def use(self, blocks: int, prompt_tokens: int) -> None:
        """A prompt of `prompt_tokens` tokens starts its prefill, its first `blocks`
        blocks shared."""
        self.queries += prompt_tokens
        self.hits += blocks * self.block
