"""The row book's writers: a verify pass's slots listed ahead, then rolled back past the
tokens kept."""

import numpy as np

from qwen3_spmd.pipeline.batch.handles import Params, Request
from qwen3_spmd.pipeline.batch.rowbook import RowBook


def test_verify_slots_are_listed_then_rolled_back_past_the_kept_tokens():
    book = RowBook(1, 1, 2, 8)  # C = 2 devices of 8 local slots
    book.start(0, Request(0, (1, 2, 3), Params(10)), 4, 2, np.full((2, 8), -1, np.int32))
    book.slot_pos[0, :, :2] = [[0, 2], [1, -1]]  # the prompt's slots (positions 0..2)
    # A verify of the newest token and 3 drafts: steps 0..3 at positions 3..6.
    book.list_ahead(np.array([0]), np.array([4]), np.array([2]), 1)
    assert sorted(book.slot_pos[0][book.slot_pos[0] >= 0].tolist()) == list(range(7))
    book.extend(0, [5, 6])  # one draft kept, then the model's token: tokens 4, 5, 6
    book.roll_back(0)
    # K/V stays for positions 0..4 (prompt, 4, 5); 6 is fed next, the rest were rejected.
    assert sorted(book.slot_pos[0][book.slot_pos[0] >= 0].tolist()) == list(range(5))
