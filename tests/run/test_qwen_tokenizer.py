"""Qwen3's tokenizer shipped with the package (run.qwen_tokenizer): the demo's text, and
the folder `convert --random-preset NAME --out DIR` writes."""

import json
import re

import pytest

from qwen3_spmd.run import qwen_tokenizer as qt
from qwen3_spmd.run.cli import main
from qwen3_spmd.run.text import Text


@pytest.fixture(scope="module")
def text():
    return Text.qwen()


@pytest.mark.parametrize(
    "s",
    [
        "Hello, world! It's 2026.\n\tdef f(x):\n\t\treturn x ** 2  # squared",
        "你好，世界。我是通义千问，由阿里云开发。",
        "日本語のテキスト、한국어 텍스트, Ελληνικά, русский",
        "emoji 🎉👍🏽 and a family 👨‍👩‍👧 in one grapheme",
        "  spaces   and\n\n\nnewlines  \r\n",
    ],
)
def test_round_trip(text, s):
    ids = text.encode(s)
    assert text.decode(ids) == s
    assert all(0 <= i < qt.FIRST_ADDED for i in ids)  # plain text makes no added token
    assert b"".join(text.token_bytes(i) for i in ids) == s.encode()


def test_qwen_ids(text):
    """Ids of Qwen's published vocabulary (the same in Qwen2, 2.5 and 3)."""
    assert text.encode("Hello") == [9707]
    assert text.encode("Hello world") == [9707, 1879]
    assert text.vocab == 151669 <= qt.QWEN_VOCAB


def test_added_tokens_have_qwen3_ids_and_are_single_tokens(text):
    assert len(qt.ADDED) == 26
    for n, token in enumerate(qt.ADDED):
        assert text.tokenizer.token_to_id(token) == 151643 + n
        assert text.encode(token) == [151643 + n]
        assert text.encode(f"x{token}y") == [87, 151643 + n, 88]
    named = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    named |= {"<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659}
    named |= {"<tool_response>": 151665, "<think>": 151667, "</think>": 151668}
    assert all(text.tokenizer.token_to_id(t) == i for t, i in named.items())
    # As in Qwen3: <|im_end|> is special, <think> is not (a server keeps it in the text).
    assert text.decode([151667, 9707, 151645], skip_special=True) == "<think>Hello"


def test_chat_template_with_thinking_on_and_off(text):
    on = text.chat("你是谁？")
    off = text.chat("你是谁？", enable_thinking=False)
    assert on == "<|im_start|>user\n你是谁？<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    # docs/parallelism.md's prompt: this rendering, as Qwen's own tokenizer encodes it
    want = [151644, 872, 198, 105043, 100165, 11319, 151645, 198, 151644, 77091, 198]
    assert text.encode(off) == want + [151667, 271, 151668, 271]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert text.render(system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_convert_random_preset_writes_a_folder_generate_speaks(tmp_path, capsys):
    """The folder holds what a Qwen3 checkpoint holds; generate encodes text with its
    tokenizer and prints decoded text (on 1x1 in float32: no seq traffic, 4-byte values)."""
    out = tmp_path / "tiny"
    assert main(["convert", "--random-preset", "tiny", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["hidden_size"] == 64
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [
        151645,
        151643,
    ]
    assert (
        "enable_thinking"
        in json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    )
    capsys.readouterr()
    argv = ["generate", "--model", str(out), "--prompt", "Hello", "--max-new-tokens", "4"]
    assert main([*argv, "--mesh", "1x1"]) == 0
    printed = capsys.readouterr().out
    streamed = re.search(r"^mesh [^\n]*\n(.*?)\n\nstages", printed, re.M | re.S)[1]
    assert streamed and not re.fullmatch(r"( \d+)+", streamed)  # text, not ids
    assert "(hidden states at 4 bytes per value)" in printed
    assert re.search(r"seq attention: +none  \(one seq device\)", printed)
    # A second convert does not overwrite it; --force replaces it.
    assert main(["convert", "--random-preset", "tiny", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
