"""The row book: which request each decode row holds, and where its K/V sits.

The decode batch is B rows in round-robin groups. A row holds one request: its tokens
so far, the local cache slots its prompt took, (in `slot_pos`) the position each of its
cache slots holds, and (in `table`) the pages of the KV pool those slots live in
(`ring.pages`; the free ones in `pages`). A row holds no page until a request starts
in it, then its prompt's pages, and more as its decode steps reach them, until it ends
(or is preempted); with a prefix cache a row's first pages may be shared with other
rows (a hit), and its whole blocks are named for later prompts
(`pipeline.batch.prefix`). A long prompt being prefilled a chunk a round holds a row
too (`chunking`) until its last chunk. The methods below are the only writers of this
state; the planner reads it, the executor writes it through them, and every process
of a job applies the same writes in the same order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen3_spmd.pipeline.batch.handles import Logprob, Request
from qwen3_spmd.pipeline.batch.pages import PageBook
from qwen3_spmd.pipeline.batch.prefix import PrefixBook, block_names, block_slot_pos
from qwen3_spmd.pipeline.batch.replicas import replica
from qwen3_spmd.pipeline.programs.decode import DecodeInputs
from qwen3_spmd.pipeline.programs.layout import Batch, list_decode_slots
from qwen3_spmd.pipeline.programs.sampling import RowSampling, Sampling


@dataclasses.dataclass
class Update:
    """What one round gave a request: its new tokens, and why it ended (None: it goes
    on). finish_reason is "stop" (an EOS id, kept as the last token), "length" or
    "cancelled"."""

    id: int
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None  # one per token, when the request asks
    cached_tokens: int = 0  # with its first token: prompt tokens the prefix cache gave
    # with its first token, when the request asks: each prompt token's after the first
    prompt_logprobs: list[Logprob] | None = None
    # a pooling runner's request, at its end (no tokens): its last prompt token's hidden
    # state after the final norm, [D] float32 (`model.pooling` makes its output of it)
    pooled: np.ndarray | None = None


@dataclasses.dataclass
class Row:
    """A request in a decode row."""

    request: Request
    generated: list[int]  # every token so far (token 0 came from the prefill)
    prompt_slots: int  # local slots before its first decode step's (`RowBook.start`)
    pace: object | None = None  # how far it drafts (pipeline.speculative.policy.Pace)

    @property
    def steps_left(self) -> int:
        """Decode steps it may still run (each gives one token)."""
        return self.request.params.max_new_tokens - len(self.generated)


@dataclasses.dataclass
class Chunking:
    """A long prompt being prefilled a chunk a round, holding decode row `row` for when
    it is done."""

    request: Request
    row: int
    done: int = 0  # prompt tokens prefilled so far
    offset: int = 0  # local cache slots its chunks hold so far (on every device)
    slot_pos: np.ndarray | None = None  # [C, S_loc] positions its chunks' slots hold
    cached_tokens: int = 0  # its first tokens, whose K/V came from the prefix cache


class RowBook:
    """B rows of a decode batch in `groups` groups, on C seq devices of `slots` local
    cache slots each, in pages of `block_size` slots (default: one page a row) from a
    pool of `pages` (default: every row's most); prefix_block: a prefix cache over the
    pool's pages in blocks of that many tokens (`pipeline.batch.prefix.prefix_block`,
    whole pages), in `self.prefix` (None: none). replicas: the `data` replicas the rows
    and the pool split into, B/D rows each, interleaved (row b is replica b mod D's:
    `pipeline.batch.replicas`), and P/D pages each, in order (`PageBook`): a row's
    pages are its replica's (table entries are the pool's page numbers; the device
    holds them less its replica's first, `Copies`)."""

    def __init__(
        self,
        rows: int,
        groups: int,
        C: int,
        slots: int,
        block_size: int | None = None,
        pages: int | None = None,
        prefix_block: int | None = None,
        replicas: int = 1,
    ):
        if rows % replicas:
            raise ValueError(f"{rows} rows do not split equally over {replicas} replicas")
        self.B, self.groups, self.replicas = rows, groups, replicas
        self.block_size = block_size or slots
        if slots % self.block_size:
            raise ValueError(f"{slots} slots a row are not whole pages of {self.block_size}")
        n = slots // self.block_size
        self.pages = PageBook(rows * n if pages is None else pages, replicas)
        # [B, n] each row's pages; past the pool (pages.pages) where it holds none
        self.table = np.full((rows, n), self.pages.pages, np.int32)
        self.rows: list[Row | None] = [None] * rows
        self.slot_pos = np.full((rows, C, slots), -1, np.int32)  # [B, C, S_loc], -1 = empty
        self.lengths = np.zeros(rows, np.int32)  # [B] prompt lengths
        self.chunking: Chunking | None = None
        self.prefix = None
        if prefix_block is not None:
            m = prefix_block // C // self.block_size  # a block's pages
            self.prefix = PrefixBook(self.pages, prefix_block, m)

    # ---- reading -----------------------------------------------------------------

    def live(self) -> list[int]:
        """The rows that hold a decoding request."""
        return [b for b, r in enumerate(self.rows) if r is not None]

    def free_rows(self) -> list[int]:
        """The rows that hold nothing (a long prompt's held row is not free)."""
        held = self.chunking.row if self.chunking is not None else None
        return [b for b, r in enumerate(self.rows) if r is None and b != held]

    def row_of(self, id: int) -> int | None:
        return next((b for b, r in enumerate(self.rows) if r and r.request.id == id), None)

    def replica_of(self, b: int) -> int:
        """The `data` replica that holds row b."""
        return replica(b, self.replicas)

    def held(self, b: int) -> int:
        """Pages row b holds."""
        return int((self.table[b] < self.pages.pages).sum())

    def lets_go(self, b: int) -> int:
        """Pages that are free again when row b lets its pages go: those no other row
        shares (a page the prefix cache keeps then counts free too)."""
        return int((self.pages.refs[self.table[b, : self.held(b)]] == 1).sum())

    def pages_for(self, slots: int) -> int:
        """Pages that hold a row's first `slots` local slots."""
        return -(-slots // self.block_size)

    def decode_slots(self, prompt_slots: int, steps: int) -> int:
        """The local slots a request holds on any device once `steps` decode steps have
        written: its prompt's, then one for every C steps (`ring.decode_slot`)."""
        C = self.slot_pos.shape[1]
        return prompt_slots + -(-max(steps, 0) // C)

    def ahead_slots(self, b: int, ahead: int) -> int:
        """The local slots row b holds after `ahead` more decode steps (within its
        budget: the last new token writes none; decode step j feeds token j)."""
        row = self.rows[b]
        steps = min(len(row.generated) - 1 + ahead, row.request.params.max_new_tokens - 1)
        return self.decode_slots(row.prompt_slots, steps)

    def decode_pages(self, b: int, ahead: int) -> int:
        """The pages row b lacks for `ahead` more decode steps."""
        return max(0, self.pages_for(self.ahead_slots(b, ahead)) - self.held(b))

    def grow_ahead(self, b: int, ahead: int) -> None:
        """Row b takes the pages `decode_pages` says it lacks."""
        self.grow(b, self.ahead_slots(b, ahead))

    # ---- writing -----------------------------------------------------------------

    def share(self, b: int, blocks) -> None:
        """Row b, holding no page yet, holds the prefix cache's `blocks` (`lookup`'s
        lists of pages) as its first pages."""
        pages = [p for block in blocks for p in block]
        self.table[b, : len(pages)] = pages
        self.pages.share(pages)

    def name_blocks(self, table: np.ndarray, tokens, slot_pos: np.ndarray) -> None:
        """The prefix cache names the whole blocks of `tokens` whose K/V a row with pages
        `table` [n] holds in a block's layout (slot_pos [C, S_loc]: the position each of
        its slots holds): a block whose slots hold other positions (a prompt's padding
        before generated tokens; decode's round-robin over several seq devices) ends
        the run."""
        if self.prefix is None:
            return
        block, C = self.prefix.block, slot_pos.shape[0]
        n = block // C  # a block's local slots
        # hashed here, not through the book's cache of waiting prompts' names: a row's
        # tokens are named once, and would push those out
        names = block_names(tokens, block)
        want = block_slot_pos(len(names), block, C, slot_pos.shape[1])
        for j, name in enumerate(names):
            at = slice(j * n, (j + 1) * n)
            if not np.array_equal(slot_pos[:, at], want[:, at]):
                break
            pages = table[j * n // self.block_size : (j + 1) * n // self.block_size]
            self.prefix.name(name, tuple(int(p) for p in pages))

    def grow(self, b: int, slots: int) -> None:
        """Row b holds the pages of its first `slots` local slots (it takes those it
        lacks, lowest first)."""
        have, want = self.held(b), self.pages_for(slots)
        if want > have:
            self.table[b, have:want] = self.pages.take(want - have, self.replica_of(b))

    def release(self, b: int) -> None:
        """Row b's pages are free again."""
        self.pages.give(self.table[b, : self.held(b)])
        self.table[b] = self.pages.pages

    def start(
        self,
        b: int,
        request: Request,
        token: int,
        prompt_slots: int,
        slot_pos: np.ndarray,
        done: bool = False,
    ) -> Update:
        """Request `request`, prefilled (its first token `token`, its slots' positions
        slot_pos [C, S_loc]), decodes in row b from now on, unless that token ends it
        (done: its constraint admits nothing more, an end for "stop"). With one seq
        device its decode steps write right after its prompt's last token (over the
        prompt's padding), so its tokens sit in order and its reply's blocks can be
        named too; with several, after its prompt's `prompt_slots` local slots."""
        C = self.slot_pos.shape[1]
        self.rows[b] = Row(request, [token], len(request.prompt) if C == 1 else prompt_slots)
        self.slot_pos[b] = slot_pos
        self.lengths[b] = len(request.prompt)
        self.name_blocks(self.table[b], request.prompt, slot_pos)
        reason = request.params.finish_reason([token]) or ("stop" if done else None)
        update = Update(request.id, [token], reason)
        if update.finish_reason:
            self.free(b)
        return update

    def extend(self, b: int, tokens, done: bool = False) -> Update:
        """Row b's new tokens from a decode chunk, up to the first that ends it (the
        rest were never asked for); the row is freed when it ends. done: after these
        tokens the row's constraint admits nothing more (an end for "stop")."""
        row = self.rows[b]
        params, got, reason = row.request.params, [], None
        for t in tokens:
            got.append(int(t))
            row.generated.append(int(t))
            reason = params.finish_reason(row.generated)
            if reason:
                break
        reason = reason or ("stop" if done else None)
        if reason:
            self.free(b)
        return Update(row.request.id, got, reason)

    def free(self, b: int) -> None:
        """Row b holds no request (it ended, was cancelled or preempted): it writes
        nothing from now on, the prefix cache names the blocks of its tokens with K/V
        (its prompt and generated tokens but the last), its pages are let go, and the
        slot positions of its last request are cleared, so a later request in the row
        sees none."""
        row = self.rows[b]
        if row is not None:
            tokens = row.request.prompt + tuple(row.generated[:-1])
            self.name_blocks(self.table[b], tokens, self.slot_pos[b])
        self._clear(b)
        self.release(b)

    def _clear(self, b: int) -> None:
        self.rows[b] = None
        self.slot_pos[b] = -1
        self.lengths[b] = 0

    def cancel(self, id: int) -> bool:
        """Ends request `id` where it runs (a row, or the long prompt being chunked);
        False when it holds neither."""
        b = self.row_of(id)
        if b is not None:
            self.free(b)
            return True
        if self.chunking is not None and self.chunking.request.id == id:
            self.release(self.chunking.row)
            self.chunking = None
            return True
        return False

    def move(self, src: int, dst: int) -> None:
        """The request in row src now sits in row dst, its pages with it (no K/V moves:
        both rows of one replica)."""
        if self.replica_of(src) != self.replica_of(dst):
            raise ValueError(f"rows {src} and {dst} are on different replicas")
        self.rows[dst], self.lengths[dst] = self.rows[src], self.lengths[src]
        self.slot_pos[dst] = self.slot_pos[src]
        self.table[dst] = self.table[src]
        self.table[src] = self.pages.pages
        self._clear(src)

    def hold(
        self,
        request: Request,
        row: int,
        done: int = 0,
        offset: int = 0,
        slot_pos: np.ndarray | None = None,
    ) -> Chunking:
        """A long prompt starts chunking, holding `row`; after a prefix cache's hit its
        first `done` tokens are in already, in `offset` local slots listed in slot_pos
        [C, S_loc]."""
        self.chunking = Chunking(request, row, done, offset, slot_pos)
        return self.chunking

    def chunk_prefilled(self, batch: Batch, end: int) -> None:
        """The chunking prompt's chunk `batch` ran: its tokens up to `end` are in, and
        its slots are listed."""
        ch = self.chunking
        if ch.slot_pos is None:
            ch.slot_pos = batch.slot_pos[0].copy()
        else:
            mine = slice(ch.offset, batch.prompt_slots)
            ch.slot_pos[:, mine] = batch.slot_pos[0][:, mine]
        ch.done, ch.offset = end, batch.prompt_slots
        self.name_blocks(self.table[ch.row], ch.request.prompt[:end], ch.slot_pos)

    def chunked_in(self) -> Chunking:
        """The chunking prompt's last chunk ran: it leaves the chunking seat (the caller
        starts its row)."""
        ch, self.chunking = self.chunking, None
        return ch

    def list_ahead(
        self, step: np.ndarray, count: np.ndarray, prompt_slots: np.ndarray, n: int
    ) -> None:
        """Lists in slot_pos the slots a verify pass writes (`pipeline.speculative.verify`): row b's
        steps step[b] .. step[b] + count[b] - 1, for rows 0..n-1 (count 0: none)."""
        list_decode_slots(
            self.slot_pos,
            step,
            int(max(count, default=0)),
            step + count,
            self.lengths[:n],
            prompt_slots,
        )

    def roll_back(self, b: int) -> None:
        """Row b keeps K/V only for its tokens but the newest (the next step feeds it):
        the slots listed past them (a verify pass's rejected drafts) hold nothing now."""
        kept = self.lengths[b] + len(self.rows[b].generated) - 1  # positions below it
        self.slot_pos[b][self.slot_pos[b] >= kept] = -1

    def decode_inputs(self, n: int, steps: int) -> DecodeInputs:
        """The inputs of a decode chunk over rows 0..n-1 that runs `steps` steps, each
        busy row at its own step (empty rows write nothing); lists in slot_pos the slots
        those steps write. Host arrays."""
        step = np.zeros(n, np.int32)
        limit = np.zeros(n, np.int32)  # an empty row: no step writes
        prompt_slots = np.zeros(n, np.int32)
        tokens = np.zeros(n, np.int32)
        per_row = [(Sampling(), 0, 0)] * n
        for b in self.live():
            if b >= n:
                continue
            row = self.rows[b]
            step[b] = len(row.generated) - 1  # decode step j feeds token j
            limit[b] = row.request.params.max_new_tokens - 1
            prompt_slots[b] = row.prompt_slots
            tokens[b] = row.generated[-1]
            per_row[b] = row_sampling(row.request)
        list_decode_slots(self.slot_pos, step, steps, limit, self.lengths[:n], prompt_slots)
        return DecodeInputs(
            tokens=tokens,
            positions=self.lengths[:n] + step,
            step=step,
            limit=limit,
            prompt_slots=prompt_slots,
            sampling=RowSampling.stack(per_row),
            run_steps=np.int32(steps),
        )


def row_sampling(request: Request) -> tuple:
    """A request's row of RowSampling.stack: its settings, seed and sample index, its
    end ids banned before step min_tokens, and the steps it made before a preemption."""
    p = request.params
    ban = (p.min_tokens, p.eos_ids) if p.min_tokens > 0 else (0, ())
    return (p.sampling, p.seed, request.sample_index, ban, request.made)
