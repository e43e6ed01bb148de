"""A batch of prompts laid out for the programs.

The batch is padded to a multiple of the microbatch and group counts with copies of the
first prompt (their results are dropped), every prompt to the padded length P_pad (a
multiple of 2C) and put in zigzag device order; device c's first P_pad / C cache slots
hold its zigzag share of the prompt.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from qwen3_spmd.pipeline.prefill import PrefillInputs
from qwen3_spmd.ring import padded_length, to_device_order, zigzag


@dataclasses.dataclass
class Batch:
    requests: int  # the caller's prompts; rows past them are padding copies
    groups: int  # decode groups
    lengths: np.ndarray  # [B] int32 prompt lengths
    P_pad: int  # padded prompt length
    prefill: PrefillInputs  # host arrays, zigzag device order
    slot_pos: np.ndarray  # [B, C, S_loc] int32 positions held by the cache slots, -1 = empty
    request: np.ndarray  # [B] int32 request index of each row (padding rows: 0)

    @property
    def B(self) -> int:
        return len(self.lengths)

    @property
    def prompt_slots(self) -> int:
        """P_pad / C: the local slots each device's share of the prompt takes."""
        return self.P_pad // self.slot_pos.shape[1]


def lay_out(
    prompts: list[list[int]], microbatches: int, groups: int, C: int, slots_per_device: int
) -> Batch:
    """`prompts` as rows of a batch of B = a multiple of lcm(microbatches, groups)."""
    n_req = len(prompts)
    unit = math.lcm(microbatches, groups)
    B = math.ceil(n_req / unit) * unit
    rows = [list(p) for p in prompts] + [list(prompts[0])] * (B - n_req)
    lengths = np.array([len(p) for p in rows], np.int32)
    P_pad = padded_length(int(lengths.max()), C)
    tokens = np.zeros((B, P_pad), np.int32)
    positions = np.full((B, P_pad), -1, np.int32)
    for b, p in enumerate(rows):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    part = zigzag(P_pad, C)
    tokens, positions = to_device_order(tokens, part), to_device_order(positions, part)
    slot_pos = np.full((B, C, slots_per_device), -1, np.int32)
    slot_pos[:, :, : P_pad // C] = positions.reshape(B, C, P_pad // C)
    request = np.arange(B, dtype=np.int32)
    request[n_req:] = 0
    return Batch(
        n_req,
        groups,
        lengths,
        P_pad,
        PrefillInputs(tokens, positions, lengths - 1),
        slot_pos,
        request,
    )
