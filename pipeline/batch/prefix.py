"""Automatic prefix caching: prompt blocks whose K/V a later prompt copies instead of
computing.

Chat traffic repeats itself (a system prompt, tool definitions, the turns before), so
the scheduler keeps a pool of prompt blocks in device memory and a prompt that begins
with blocks in the pool prefills only the rest, as a long prompt's later chunks do
(`ring.context_attention` reads the copied blocks from the row's cache).

    block   `block` prompt tokens (a multiple of 2C that divides the scheduler's chunk).
            With the cache on every prompt is laid out block by block
            (`ring.zigzag_blocks`), so block j of any prompt sits at the same local
            slots of every `seq` device, [j*n, (j+1)*n) with n = block / C, and its K/V
            is the same wherever the same tokens come first.
    name    a hash chain: block j's name hashes block j-1's name and block j's tokens,
            so equal names mean equal tokens from position 0 on, hence equal K/V.
    pool    k and v [L_pad, slots, K', C*n, H], sharded as the cache (each stage its
            layers, each `seq` device its n slots of every block, each `tensor`
            device its heads): a copy between a row and the pool moves no byte
            between devices (`pipeline.runtime.copies`).
    book    `PrefixBook`, on the host: which name each pool slot holds and when it was
            last used. The planner reads it (the longest cached run of a prompt's
            blocks; the slots new blocks go to, free ones first, then the least
            recently used); the executor is its only writer, in the round's order, on
            every process alike (the pool's decisions travel in the `Round`).

A prompt's last token is always computed (its logits give the first token), so a hit
covers at most (len - 1) // block blocks. A prompt's blocks are saved right after its
prefill, from the row it went into. When a request ends, the blocks of its prompt and
generated tokens together (those whose K/V its row holds: all but the last token) are
saved the next round, before anything writes to its row, so a conversation's next turn
(the prompt, the reply, a new user turn) hits the reply's blocks too. That needs one
`seq` device: with several, generated tokens sit round-robin over the devices
(`ring.decode_slot`), not in a block's layout, and only prompt blocks are saved. The
generated tokens' K/V were computed by decode steps, not by a prefill, so a turn that
hits them differs from one that computes them by float rounding only, as two mesh
shapes do.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import numpy as np

from qwen3_spmd.ring import zigzag_blocks

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


@dataclasses.dataclass(frozen=True)
class Save:
    """Block `block` of the tokens in row `row` (a prompt just prefilled, or a request
    that ended: `Round`) goes into pool slot `slot`, as `name`."""

    row: int
    block: int
    slot: int
    name: str


class PrefixBook:
    """The pool's index: which block name each of `slots` slots holds, and the round
    each was last used in. Counts, for /metrics: prompt tokens looked up (`queries`),
    those found (`hits`), blocks evicted."""

    def __init__(self, slots: int, block: int):
        self.slots, self.block = slots, block
        # A waiting prompt is looked up every round until admitted, then its blocks are
        # named again for the saves: hash each prompt once. As many as the server's
        # default queue (256) and as many again, not every prompt ever seen (it holds them).
        self.names = functools.lru_cache(maxsize=512)(lambda prompt: block_names(prompt, block))
        self.where: dict[str, int] = {}  # block name -> slot
        self.held: list[tuple[str, int] | None] = [None] * slots  # (name, block index)
        self.used = [0] * slots
        self.clock = 0
        self.queries = self.hits = self.evictions = 0

    # ---- reading (the planner) ---------------------------------------------------

    def lookup(self, prompt) -> tuple[int, ...]:
        """The slots of the longest run of the prompt's first blocks in the pool (at
        most `hit_blocks`), in block order."""
        found = []
        for name in self.names(tuple(prompt))[: hit_blocks(len(prompt), self.block)]:
            slot = self.where.get(name)
            if slot is None:
                break
            found.append(slot)
        return tuple(found)

    def victims(self, n: int, keep: set[int]) -> list[int]:
        """Up to n slots for new blocks: empty ones first, then the least recently used
        (the later block of a prompt before its earlier ones, which the later need),
        none of `keep`."""
        order = sorted(
            (s for s in range(self.slots) if s not in keep),
            key=lambda s: (self.held[s] is not None, self.used[s], -(self.held[s] or ("", 0))[1]),
        )
        return order[:n]

    @property
    def blocks_held(self) -> int:
        return len(self.where)

    def after(self, saves) -> PrefixBook:
        """What the book will say once `saves` run at the start of the next round (the
        planner's view of a round that saves before it reads)."""
        view = PrefixBook.__new__(PrefixBook)
        view.__dict__.update(self.__dict__)
        view.where, view.held, view.used = dict(self.where), list(self.held), list(self.used)
        view.clock = self.clock + 1
        for save in saves:
            view._put(save)
        return view

    # ---- writing (the executor, in the round's order) ----------------------------

    def tick(self) -> None:
        """A round begins: what it uses is more recent than anything before."""
        self.clock += 1

    def use(self, slots, prompt_tokens: int) -> None:
        """A request of `prompt_tokens` tokens was admitted, its first blocks read from
        `slots`."""
        for s in slots:
            self.used[s] = self.clock
        self.queries += prompt_tokens
        self.hits += len(slots) * self.block

    def store(self, save: Save) -> None:
        """`save` ran: its slot holds its block now (evicting what it held)."""
        self.evictions += self.held[save.slot] is not None
        self._put(save)

    def _put(self, save: Save) -> None:
        old = self.held[save.slot]
        if old is not None:
            del self.where[old[0]]
        self.held[save.slot] = (save.name, save.block)
        self.where[save.name] = save.slot
        self.used[save.slot] = self.clock


def plan_saves(book: PrefixBook, admitted: list[tuple[int, tuple[int, ...]]], keep: set[int]):
    """The saves of (row, tokens) sequences (prompts just prefilled, or the tokens of
    requests that ended), in order: each one's whole blocks not in the pool (nor saved
    earlier this round), into the slots `PrefixBook.victims` gives, none of `keep` (the
    round's hits) nor of the blocks those sequences already have in the pool. Earlier
    blocks first: a later block is found only after the ones before it."""
    wanted, seen, keep = [], set(book.where), set(keep)
    for row, tokens in admitted:
        for j, name in enumerate(book.names(tuple(tokens))):
            if name in book.where:  # the earlier blocks a new one needs stay
                keep.add(book.where[name])
            elif name not in seen:
                seen.add(name)
                wanted.append((row, j, name))
    slots = book.victims(len(wanted), keep)
    return tuple(Save(row, j, slot, name) for (row, j, name), slot in zip(wanted, slots))


def block_slots(slot_pos: np.ndarray, block: int, blocks: int) -> np.ndarray:
    """[blocks, block] the cache slots of a row on one `seq` device that hold the
    positions of its first `blocks` blocks, in position order. slot_pos: [S_loc] the
    position each slot holds (-1: none), as `RowBook` lists them; every position of
    those blocks must be held."""
    slot_of = np.full(blocks * block, -1, np.int64)
    held = (slot_pos >= 0) & (slot_pos < blocks * block)
    slot_of[slot_pos[held]] = np.flatnonzero(held)
    if (slot_of < 0).any():
        raise ValueError("a block's position is in no slot of the row")
    return slot_of.reshape(blocks, block).astype(np.int32)
