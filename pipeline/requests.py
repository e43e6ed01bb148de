"""What a request may ask, checked in words before anything is loaded or compiled."""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Mapping

from qwen3_spmd.model.config import Qwen3Config
from qwen3_spmd.ring import padded_length, slots_per_device


class RequestError(ValueError):
    """A request the engine cannot serve as asked: the message says what to change.

    The message names the parameters it is about as the Python API does
    (`max_seq_len`): `message` writes each as `$name`, and `params` lists them, the one
    at fault first (`param`; None when no one parameter is). An interface that spells
    them its own way (the command line's `--max-seq-len`, an HTTP field) passes its
    names to `spelled` rather than reading the text.
    """

    def __init__(self, message: str, *params: str):
        self.template, self.params = message, params
        self.param = params[0] if params else None
        super().__init__(self.spelled({}))

    def at_prompt(self, index: int) -> RequestError:
        """This refusal of a prompt checked alone ("prompt 0 ...") said of prompt `index`
        of the caller's batch."""
        template = self.template.replace("prompt 0 ", f"prompt {index} ", 1)
        return type(self)(template, *self.params)

    def spelled(self, names: Mapping[str, str]) -> str:
        """The message with each parameter named as `names` has it (else as the API)."""
        if not self.params:
            return self.template
        names = {p: names.get(p, p) for p in self.params}
        return string.Template(self.template).safe_substitute(names)


SEEDS = 2**31  # a request's seed is taken modulo this: the sampling key's int32 seed


def key_seed(seed: int) -> int:
    """The sampling key's seed of a request's `seed`. Every door takes any integer (as
    vLLM and the OpenAI API do, whose clients send 64-bit seeds) and wraps it here."""
    return int(seed) % SEEDS


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS id was produced, and kept) or "length"


MAX_BANNED = 8  # end ids a request may hold back with min_tokens (a row's [MAX_BANNED] ban)


def check_request(
    cfg: Qwen3Config,
    seq: int,
    max_seq_len: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    min_tokens: int = 0,
    eos_ids: tuple[int, ...] = (),
    pooling: bool = False,
) -> None:
    """Every precondition of a request on C = seq devices, in words; needs no weights, so
    a caller can check before loading them. The one check of a request: every door
    calls it (through `Engine.check`) and says the parameters it names in its terms
    (RequestError.spelled). pooling: a pooling runner's request, which generates
    nothing (max_new_tokens 0)."""
    if not prompts:
        raise RequestError("no prompt given: pass at least one", "prompts")
    if pooling and max_new_tokens != 0:
        raise RequestError(
            f"a pooling runner generates no tokens, and this request asks for "
            f"$max_new_tokens {max_new_tokens}: serve the model with the generate runner",
            "max_new_tokens",
        )
    if not pooling and max_new_tokens < 1:
        raise RequestError(f"$max_new_tokens {max_new_tokens} must be at least 1", "max_new_tokens")
    for n, p in enumerate(prompts):
        if len(p) == 0:
            raise RequestError(f"prompt {n} is empty: give it at least one token", "prompts")
        bad = [t for t in p if not 0 <= t < cfg.V]
        if bad:
            raise RequestError(
                f"prompt {n} has token id {bad[0]} outside the vocabulary "
                f"[0, {cfg.V}): use ids the model's tokenizer produces",
                "prompts",
            )
        total = len(p) + max_new_tokens
        limit = min(cfg.max_position_embeddings, max_seq_len)
        if pooling and len(p) > limit:
            which = "$max_seq_len" if limit == max_seq_len else "the model's positions,"
            raise RequestError(
                f"prompt {n} has {len(p)} tokens, more than {which} {limit}: shorten it"
                + (f" (or raise $max_seq_len to {len(p)})" if limit == max_seq_len else ""),
                "max_seq_len" if limit == max_seq_len else "prompts",
            )
        if total > cfg.max_position_embeddings:
            raise RequestError(
                f"prompt {n} ({len(p)} tokens) + $max_new_tokens {max_new_tokens} = {total} "
                f"exceeds the model's {cfg.max_position_embeddings} positions: shorten one",
                "max_new_tokens",
            )
        if total > max_seq_len:
            raise RequestError(
                f"prompt {n} ({len(p)} tokens) + $max_new_tokens {max_new_tokens} = {total} "
                f"exceeds $max_seq_len {max_seq_len}: shorten the prompt or lower "
                f"$max_new_tokens (or raise $max_seq_len to {total})",
                "max_seq_len",
                "max_new_tokens",
            )
    if not 0 <= min_tokens < 2**31:  # a row's ban ends at an int32 step
        raise RequestError(f"$min_tokens {min_tokens} must be in [0, 2**31)", "min_tokens")
    if min_tokens and len(eos_ids) > MAX_BANNED:
        raise RequestError(
            f"$min_tokens holds back at most {MAX_BANNED} end ids, and this request has "
            f"{len(eos_ids)}: pass fewer $eos_ids",
            "eos_ids",
            "min_tokens",
        )
    longest = max(len(p) for p in prompts)
    slots = math.ceil(max_seq_len / seq)
    need = slots_per_device(longest, max_new_tokens, seq)
    if need > slots:
        raise RequestError(
            f"the longest prompt padded to {padded_length(longest, seq)} tokens (a multiple "
            f"of 2C = {2 * seq}) plus {max_new_tokens} new tokens needs {need} cache slots "
            f"per seq device, but $max_seq_len {max_seq_len} gives {slots}: raise "
            f"$max_seq_len to {need * seq}",
            "max_seq_len",
        )


def fitting_seq_len(prompt_len: int, new_tokens: int, seq: int) -> int:
    """The smallest max_seq_len check_request accepts for a prompt of prompt_len tokens
    and new_tokens more on C = seq devices: the cache slots they need, at least prompt +
    new tokens, as a multiple of C."""
    slots = seq * slots_per_device(prompt_len, new_tokens, seq)
    return seq * math.ceil(max(slots, prompt_len + new_tokens) / seq)
