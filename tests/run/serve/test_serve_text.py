"""The server's text pipeline without a server: whole characters, stop strings."""

import random

import pytest
from reference import FIXTURES

from qwen3_spmd.run.serve.detok import Detokenizer, StopText
from qwen3_spmd.run.text import Text

FIXTURE = FIXTURES / "tiny"


@pytest.fixture(scope="module")
def text():
    return Text(FIXTURE)


def _stream(text, ids, stops=()):
    detok, stop = Detokenizer(lambda x: text.decode(x, skip_special=True)), StopText(stops)
    pieces = []
    for t in ids:
        piece = detok.add(t)
        assert "\ufffd" not in piece[-1:] or not piece, "an unfinished character went out"
        pieces.append(stop.add(piece))
        if stop.stopped:
            return pieces, True
    pieces.append(stop.add(detok.flush()))
    if not stop.stopped:
        pieces.append(stop.flush())
    return pieces, stop.stopped


def test_streamed_text_is_the_whole_text(text):
    """Random ids (bytes that split characters, ids past the tokenizer, special tokens):
    the deltas concatenate to the decoding of all ids at once."""
    rng = random.Random(0)
    word = text.encode("naïve café — 日本語 ✓")  # multi-byte characters over several ids
    for _ in range(200):
        ids = [rng.randrange(331) for _ in range(rng.randrange(1, 30))]
        ids[rng.randrange(len(ids)) :] = word + ids[len(word) :]
        pieces, _ = _stream(text, ids)
        assert "".join(pieces) == text.decode(ids, skip_special=True)


def test_multibyte_character_waits_for_its_last_byte(text):
    ids = text.encode("日")  # three bytes, three ids (no merge covers them)
    assert len(ids) == 3
    detok = Detokenizer(lambda x: text.decode(x, skip_special=True))
    assert [detok.add(i) for i in ids] == ["", "", "日"]


def test_stop_string_split_across_pieces_is_held_back():
    stop = StopText(["</end>", "xyz"])
    assert stop.add("hello <") == "hello "  # '<' may begin '</end>'
    assert stop.add("/e") == ""
    assert stop.add("nd> world") == ""
    assert stop.stopped
    assert stop.add("more") == "" and stop.flush() == ""


def test_held_text_that_is_no_stop_goes_out():
    stop = StopText(["</end>"])
    assert stop.add("a </e") == "a "
    assert stop.add("x") == "</ex"
    assert stop.add("</") == ""
    assert stop.flush() == "</"
    assert not stop.stopped


def test_stop_strings_wait_for_min_tokens():
    stop = StopText(["ab"])
    assert stop.add("xab", armed=False) == "xab"
    assert stop.add("cab") == "c" and stop.stopped
