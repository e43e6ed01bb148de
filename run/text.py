"""Text in and out: `tokenizer.json` through `tokenizers`, chat templates through jinja2.

A checkpoint without a tokenizer still runs on token ids; asking it for text is an
error that says to pass ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from qwen3_spmd.run import qwen_tokenizer


class TextError(ValueError):
    pass


class Text:
    """The tokenizer and chat template of a checkpoint folder."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.folder = folder
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise TextError(
                f"{folder / 'tokenizer.json'} cannot be read ({e}): replace it, "
                "or remove it and pass --prompt-ids"
            ) from None
        config_path = folder / "tokenizer_config.json"
        try:
            self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except json.JSONDecodeError as e:
            raise TextError(f"{config_path} is not valid JSON ({e}): fix or remove it") from None
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def qwen(cls) -> Text:
        """Qwen3's own tokenizer and chat template, shipped with the package
        (run.qwen_tokenizer): the text of the demo and of random presets."""
        self = cls.__new__(cls)
        self.folder = None
        self.tokenizer = qwen_tokenizer.tokenizer()
        self.config = qwen_tokenizer.tokenizer_config()
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return self

    @classmethod
    def find(cls, folder: str | Path | None) -> Text | None:
        if folder is None or not (Path(folder) / "tokenizer.json").is_file():
            return None
        return cls(folder)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text (special tokens written in it are read as such);
        add_special_tokens: also those the tokenizer's post-processor adds (none for
        Qwen's)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of ids; an id past the tokenizer's vocabulary (a random model can emit
        one) shows as <|id:N|> rather than vanishing. skip_special leaves special tokens
        (<|im_end|>, ...) out, as a server shows text."""
        out, run = [], []
        for i in ids:
            if i < self.vocab:
                run.append(i)
                continue
            if run:
                out.append(self.tokenizer.decode(run, skip_special_tokens=skip_special))
                run = []
            out.append(f"<|id:{i}|>")
        if run:
            out.append(self.tokenizer.decode(run, skip_special_tokens=skip_special))
        return "".join(out)

    def token_bytes(self, id: int) -> bytes:
        """The bytes token `id` stands for (byte-level BPE: a token may hold part of a
        character); an id past the tokenizer's vocabulary gives b"<|id:N|>"."""
        if not 0 <= id < self.vocab:
            return f"<|id:{id}|>".encode()
        piece = self.tokenizer.id_to_token(id) or ""
        table = qwen_tokenizer.bytes_of_symbols()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode()  # an added token outside the byte alphabet: its own text

    def chat(self, user: str, enable_thinking: bool = True) -> str:
        """One user turn rendered with the checkpoint's chat template, ready for the reply."""
        messages = [{"role": "user", "content": user}]
        return self.render(messages, True, enable_thinking=enable_thinking)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Messages rendered with the checkpoint's chat template; kwargs reach the
        template (Qwen3's enable_thinking)."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise TextError(
                "this checkpoint has no chat_template in tokenizer_config.json: give the "
                "prompt as plain text (without --chat; /v1/completions when serving)"
            )
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(
                **{
                    "bos_token": self.config.get("bos_token") or "",
                    "eos_token": self.config.get("eos_token") or "",
                    **kwargs,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except Exception as e:  # TemplateError, or a TypeError on a message's odd field
            raise TextError(f"the chat template of this checkpoint failed ({e})") from None
