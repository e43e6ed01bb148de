"""A batch of prompts laid out for the programs.

The batch is padded to a multiple of the microbatch and group counts with copies of the
first prompt (their results are dropped), every prompt to the padded length P_pad (a
multiple of 2C) and put in zigzag device order (with a prefix cache, block by block);
device c's first P_pad / C cache slots hold its zigzag share of the prompt.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from qwen3_spmd.pipeline.programs.prefill import PrefillInputs
from qwen3_spmd.ring import decode_slot, padded_length, to_device_order, zigzag, zigzag_blocks


@dataclasses.dataclass
class Batch:
    requests: int  # the caller's prompts; rows past them are padding copies
    groups: int  # decode groups
    lengths: np.ndarray  # [B] int32 prompt lengths
    P_pad: int  # padded prompt length
    prefill: PrefillInputs  # host arrays, zigzag device order
    slot_pos: np.ndarray  # [B, C, S_loc] int32 positions held by the cache slots, -1 = empty
    request: np.ndarray  # [B] int32 request index of each row (padding rows: 0)
    offset: int = 0  # local slots earlier chunks of these prompts hold (chunked prefill)
    block: int | None = None  # each block zigzagged on its own (a prefix cache's layout)

    @property
    def B(self) -> int:
        return len(self.lengths)

    @property
    def prompt_slots(self) -> int:
        """offset + P_pad / C: the local slots each device's share of the prompt (so far)
        takes."""
        return self.offset + self.P_pad // self.slot_pos.shape[1]


def bucket(n: int, unit: int) -> int:
    """n rounded up to `unit` times a power of two: a server that lays out batches of
    every size and length meets few distinct shapes, so compiles few programs."""
    units = -(-n // unit)
    return unit * (1 << (units - 1).bit_length())


def length_bucket(n: int, unit: int) -> int:
    """n rounded up to `unit` times 1, 2, 3, 4, 6, 8, 12, 16, ... (a power of two, or
    three quarters of one): a prompt's padding costs at most a third of its prefill's
    compute (half with powers of two alone), for twice as many compiled lengths."""
    units = -(-n // unit)
    power = 1 << (units - 1).bit_length()
    return unit * (3 * power // 4 if units <= 3 * power // 4 else power)


def whole_batch(n: int, unit: int) -> int:
    """The most of n requests that fill a `bucket`ed batch without padding rows (a
    multiple of `unit` times a power of two); n itself when fewer than `unit`."""
    if n < unit:
        return n
    return unit << ((n // unit).bit_length() - 1)


def lay_out(
    prompts: list[list[int]],
    microbatches: int,
    groups: int,
    C: int,
    slots_per_device: int,
    bucketed: bool = False,
    start: int = 0,
    offset: int = 0,
    P_pad: int | None = None,
    rows: int | None = None,
    block: int | None = None,
    targets: list[list[int]] | None = None,
) -> Batch:
    """`prompts` as rows of a batch of B = a multiple of lcm(microbatches, groups).
    bucketed: B rounded up further, to that multiple times a power of two (`bucket`),
    and P_pad to a `length_bucket` of 2C. start, offset: the prompts are chunks that
    begin at position `start`, after earlier chunks that hold each device's first
    `offset` local slots (chunked prefill); slot_pos lists this chunk's slots only.
    P_pad, rows: the padded length (a multiple of 2C, at least the longest prompt's) and
    the batch's rows (a multiple of that unit, at least the prompts), instead of the
    ones chosen here (`pipeline.runtime.shapes` decides them for a scheduler). block: each block
    of that many tokens zigzagged on its own (`ring.zigzag_blocks`, a prefix cache's
    layout; `start` is then a multiple of it), None: the whole P_pad at once.
    targets: for a prefill with the prompt's log-probabilities, each prompt's next
    prompt token after each of its tokens (-1 where none: its last), laid out as the
    tokens (`PrefillInputs.targets`); None: none asked."""
    n_req = len(prompts)
    unit = math.lcm(microbatches, groups)
    B = bucket(n_req, unit) if bucketed else math.ceil(n_req / unit) * unit
    if rows is not None:
        if rows < n_req or rows % unit:
            raise ValueError(f"rows {rows} must be a multiple of {unit} and at least {n_req}")
        B = rows
    rows = [list(p) for p in prompts] + [list(prompts[0])] * (B - n_req)
    lengths = np.array([len(p) for p in rows], np.int32)
    longest = int(lengths.max())
    if P_pad is None:
        P_pad = length_bucket(longest, 2 * C) if bucketed else padded_length(longest, C)
    elif P_pad < longest or P_pad % (2 * C):
        raise ValueError(f"P_pad {P_pad} must be a multiple of {2 * C} and at least {longest}")
    tokens = np.zeros((B, P_pad), np.int32)
    positions = np.full((B, P_pad), -1, np.int32)
    for b, p in enumerate(rows):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = start + np.arange(len(p))
    part = zigzag(P_pad, C) if block is None else zigzag_blocks(P_pad, C, block)
    tokens, positions = to_device_order(tokens, part), to_device_order(positions, part)
    if targets is not None:
        nexts = np.full((B, P_pad), -1, np.int32)
        for b, t in enumerate(list(targets) + [targets[0]] * (B - n_req)):
            nexts[b, : len(t)] = t
        # Padding gathers to_device_order's zero row: mark it as no target.
        targets = np.where(positions >= 0, to_device_order(nexts, part), -1).astype(np.int32)
    slot_pos = np.full((B, C, slots_per_device), -1, np.int32)
    slot_pos[:, :, offset : offset + P_pad // C] = positions.reshape(B, C, P_pad // C)
    request = np.arange(B, dtype=np.int32)
    request[n_req:] = 0
    return Batch(
        n_req,
        groups,
        lengths,
        P_pad,
        PrefillInputs(tokens, positions, start + lengths - 1, np.int32(offset), targets),
        slot_pos,
        request,
        offset,
        block,
    )


def list_decode_slots(
    slot_pos: np.ndarray,
    step: np.ndarray,
    take: int,
    limit: np.ndarray,
    lengths: np.ndarray,
    prompt_slots: np.ndarray,
) -> None:
    """Lists in slot_pos [B, C, S_loc] the positions a decode chunk of `take` steps will
    write: row b's steps step[b] .. step[b] + take - 1 below limit[b], at
    `ring.decode_slot` (step j holds position lengths[b] + j). The programs then mask
    by position, so listing a slot before its step runs shows nothing early."""
    C = slot_pos.shape[1]
    for b in range(len(step)):
        j = np.arange(step[b], min(step[b] + take, limit[b]))
        device, slot = decode_slot(j, prompt_slots[b], C)
        slot_pos[b, device, slot] = lengths[b] + j
