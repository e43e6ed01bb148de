"""`LLM`: the one Python door. A model and a mesh in, text or token ids to completions.

    from qwen3_spmd import LLM, SamplingParams

    llm = LLM("tests/fixtures/tiny", mesh="1x1", max_seq_len=64)
    for out in llm.generate(["Hello", "The sky"], SamplingParams(max_tokens=8)):
        print(out.finish_reason, out.token_ids, out.text)

vLLM's `LLM` + `SamplingParams`, over this project's pieces: `run.models.open_model`
resolves the model (a Hugging Face or orbax checkpoint folder, or a preset with seeded
random weights), `run.text.Text` tokenizes and renders the chat template, and every
prompt goes to one continuous-batching `pipeline.scheduler.Scheduler` over an
`Engine`, so prompts of different lengths and budgets share the decode rows, and
requests submitted later (`submit`) join the running ones. Prompt i of a `generate`
call samples with key (seed, i, step), as in `Engine.generate`: the same tokens.

Bad input raises `pipeline.requests.RequestError` naming the parameter as this API does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import re
import string

from qwen3_spmd.pipeline.handles import Handle, Params
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.sampling import Sampling

__all__ = ["LLM", "Output", "SamplingParams", "StructuredOutputsParams"]

# The engine's parameter names that this API spells its own way (vLLM's).
_NAMES = {"max_new_tokens": "max_tokens"}


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the answer must follow (vLLM's names): one of a JSON Schema (`json`, a dict
    or its text), a regular expression the whole answer matches (`regex`), one of a list
    of strings (`choice`), a Lark or GBNF grammar (`grammar`), or any JSON object
    (`json_object=True`). The answer ends ("stop") where the grammar admits nothing
    more; JSON is compact (no whitespace between tokens)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None,)]
        if self.json_object is False:
            given.remove("json_object")
        if len(given) != 1:
            raise RequestError(
                "$structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object ({', '.join(given) or 'none'} given)",
                "structured_outputs",
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    def constraint(self):
        """The engine's `Constraint` (from the first token)."""
        from qwen3_spmd.pipeline.constraints import Constraint

        if self.json_object:
            return Constraint.json_schema({"type": "object"})
        if self.json is not None:
            return Constraint.json_schema(self.json)
        if self.choice is not None:
            return Constraint.choice(self.choice)
        if self.regex is not None:
            return Constraint("regex", self.regex)
        return Constraint("grammar", self.grammar)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks besides its prompt (vLLM's names).

    max_tokens counts every generated token. temperature 0 is greedy; top_k 0 and top_p
    1 are off. Sampled tokens depend on (seed, the prompt's index in its `generate`
    call, step) only. A request stops at the model's EOS ids (unless ignore_eos) or at
    stop_token_ids, keeping that id as its last token; not before min_tokens tokens.
    skip_special_tokens leaves special tokens (<|im_end|>, ...) out of `Output.text`.
    structured_outputs: what the answer must follow (`StructuredOutputsParams`).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise RequestError(f"$max_tokens {self.max_tokens} must be at least 1", "max_tokens")
        if not 0 <= self.seed < 2**31:
            raise RequestError(f"$seed {self.seed} must be in [0, 2**31)", "seed")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        Sampling(self.temperature, self.top_k, self.top_p)  # its range checks, now

    def params(self, eos_ids: tuple[int, ...]) -> Params:
        """The scheduler's Params, with the model's EOS ids."""
        stop = (() if self.ignore_eos else tuple(eos_ids)) + self.stop_token_ids
        return Params(
            max_new_tokens=self.max_tokens,
            sampling=Sampling(self.temperature, self.top_k, self.top_p),
            seed=self.seed,
            eos_ids=tuple(dict.fromkeys(stop)),
            min_tokens=self.min_tokens,
            constraint=(self.structured_outputs.constraint() if self.structured_outputs else None),
        )


@dataclasses.dataclass(frozen=True)
class Output:
    """One prompt's completion. prompt: the text given (after the chat template, with
    chat=True), None for token ids; text: None when the model has no tokenizer.
    finish_reason: "stop" (an EOS or stop id, kept as the last token) or "length"."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str


class LLM:
    """A Qwen3 model on a (stage, seq, tensor) mesh, ready to generate.

    Args:
      model: a Hugging Face checkpoint folder, an orbax folder written by `qwen3-spmd
        convert`, or a preset name (tiny, 0.6B, ..., 32B: seeded random weights);
        None is the tiny preset. Text needs the folder's tokenizer.json.
      mesh: "SxC" or "SxCxX" (S pipeline stages x C sequence devices x X tensor
        devices), or a jax Mesh with axes ('stage', 'seq', 'tensor'). On CPU, a mesh of several devices is emulated when JAX has
        not started yet (else JAX must already see them).
      dtype: "float32" or "bfloat16" (default: float32 on CPU, bfloat16 elsewhere).
      max_seq_len: KV cache capacity per request (prompt + max_tokens).
      max_batch: decode rows: requests decoded at once (more wait for a row).
      weights_seed: the random weights' seed for a preset.
      chunk, microbatches, cp, experts: as `pipeline.engine.Engine`'s.
    """

    def __init__(
        self,
        model: str | None = None,
        mesh="1x1",
        dtype=None,
        max_seq_len: int = 2048,
        max_batch: int = 8,
        weights_seed: int = 0,
        chunk: int = 16,
        microbatches: int = 1,
        cp: str = "ring",
        experts: str = "tp",
    ):
        import jax.numpy as jnp

        from qwen3_spmd.pipeline.constraints import Grammars
        from qwen3_spmd.pipeline.engine import Engine
        from qwen3_spmd.pipeline.scheduler import Scheduler
        from qwen3_spmd.run.flags import DTYPES, dtype_name
        from qwen3_spmd.run.models import open_model

        with _as_arguments():
            self.spec = open_model(model, weights_seed)
            self.mesh = _mesh(mesh)
        name = dtype_name(None) if dtype is None else jnp.dtype(dtype).name
        if name not in DTYPES:
            raise RequestError(
                f"$dtype {name} is not supported: use {' or '.join(DTYPES)}", "dtype"
            )
        self.text = self.spec.text()
        self.eos_ids = self.spec.eos_ids()
        self.engine = Engine(
            self.spec.cfg,
            self.spec.source,
            self.mesh,
            dtype=jnp.dtype(name),
            max_seq_len=max_seq_len,
            microbatches=microbatches,
            chunk=chunk,
            cp=cp,
            experts=experts,
        )
        grammars = Grammars.of_text(self.text, self.spec.cfg.V, self.eos_ids)
        self.scheduler = Scheduler(self.engine, max_batch=max_batch, grammars=grammars)

    # ---- text ------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer` of the checkpoint (None without tokenizer.json)."""
        return self.text.tokenizer if self.text is not None else None

    def _need_text(self):
        if self.text is None:
            raise RequestError(
                f"text needs tokenizer.json in the model's folder, and {self.spec.label} has "
                "none: pass token ids (a list of ints), or a checkpoint folder with one",
                "prompts",
            )
        return self.text

    def encode(self, text: str, chat: bool = False, enable_thinking: bool = True) -> list[int]:
        """Token ids of text (with chat=True: one user turn in the chat template)."""
        t = self._need_text()
        return t.encode(t.chat(text, enable_thinking) if chat else text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._need_text().decode(ids, skip_special=skip_special_tokens)

    # ---- requests --------------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        chat: bool = False,
        enable_thinking: bool = True,
        sample_index: int = 0,
    ) -> Handle:
        """Queues one request and returns its `Handle` at once: iterate it for the token
        ids as they come (that runs the rounds unless `start()` did), read its `tokens`
        and `finish_reason`. Requests submitted while others run join their batch."""
        ids, _ = self._prompt_ids(prompt, chat, enable_thinking)
        sampling = sampling or SamplingParams()
        try:
            return self.scheduler.submit(ids, sampling.params(self.eos_ids), sample_index)
        except RequestError as e:
            raise _renamed(e) from None

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
        enable_thinking: bool = True,
    ) -> list[Output]:
        """Completes each prompt (text, or a list of token ids; one or a list of them),
        in the order given. chat=True wraps text prompts in the chat template.
        sampling: one SamplingParams for all, or one per prompt. Every prompt is checked
        before any runs."""
        batch = _as_batch(prompts)
        given = [self._prompt_ids(p, chat, enable_thinking) for p in batch]
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(batch):
                raise RequestError(
                    f"{len(sampling)} $sampling params for {len(batch)} prompts: give one "
                    "SamplingParams, or one per prompt",
                    "sampling",
                )
            each = list(sampling)
        else:
            each = [sampling or SamplingParams()] * len(batch)
        for i, ((ids, _), s) in enumerate(zip(given, each)):  # all checked before any runs
            try:
                self.engine.check([ids], s.max_tokens)
                if s.structured_outputs is not None:
                    self.scheduler.compile_constraint(s.structured_outputs.constraint())
            except RequestError as e:
                raise _renamed(e, i) from None
        handles = [self._queue(ids, s, i) for i, ((ids, _), s) in enumerate(zip(given, each))]
        for h in handles:
            for _ in h:  # runs rounds (or waits for the background loop) until done
                pass
        return [
            Output(
                prompt=text,
                prompt_token_ids=ids,
                text=(
                    self.text.decode(h.tokens, skip_special=s.skip_special_tokens)
                    if self.text is not None
                    else None
                ),
                token_ids=list(h.tokens),
                finish_reason=h.finish_reason,
            )
            for (ids, text), s, h in zip(given, each, handles)
        ]

    def _queue(self, ids: list[int], sampling: SamplingParams, index: int) -> Handle:
        """submit, running rounds while the scheduler's queue is full: a batch larger
        than max_batch + max_queue goes in as rows free up."""
        from qwen3_spmd.pipeline.scheduler import QueueFull

        while True:
            try:
                return self.submit(ids, sampling, sample_index=index)
            except QueueFull:
                self.scheduler.step()

    def _prompt_ids(
        self, prompt, chat: bool, enable_thinking: bool
    ) -> tuple[list[int], str | None]:
        """(token ids, the text they came from or None)."""
        if isinstance(prompt, str):
            t = self._need_text()
            shown = t.chat(prompt, enable_thinking) if chat else prompt
            return t.encode(shown), shown
        if chat:
            raise RequestError("$chat applies to text prompts, and this one is token ids", "chat")
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in prompt):
            raise RequestError(
                f"a prompt is text (str) or token ids (a list of ints), not {prompt!r:.60}",
                "prompts",
            )
        return [int(x) for x in prompt], None

    # ---- the background loop ---------------------------------------------------------

    def start(self) -> None:
        """Rounds on a background thread (for `Handle.stream()` and servers)."""
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_batch(prompts) -> list:
    """One prompt (text, or ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise RequestError("no prompt given: pass at least one", "prompts")
    if all(isinstance(x, numbers.Integral) for x in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _renamed(e: RequestError, index: int = 0) -> RequestError:
    """The engine's error with its parameters named as this API names them (and, for a
    check of one prompt of several, that prompt's index)."""
    template = string.Template(e.template).safe_substitute({k: f"${v}" for k, v in _NAMES.items()})
    if index:
        template = template.replace("prompt 0 ", f"prompt {index} ", 1)
    return type(e)(template, *(_NAMES.get(p, p) for p in e.params))


@contextlib.contextmanager
def _as_arguments():
    """The command line's model and mesh errors ("--model x: ...") said as this API's
    arguments ("model x: ...")."""
    from qwen3_spmd.model.config import ConfigError
    from qwen3_spmd.model.split import TensorError
    from qwen3_spmd.sharding.mesh import MeshError

    try:
        yield
    except (ConfigError, MeshError, TensorError) as e:
        raise type(e)(re.sub(r"--(model|mesh)\b", r"\1", str(e))) from None


def _mesh(mesh):
    """A ('stage', 'seq', 'tensor') Mesh from "SxC" or "SxCxX" over the first S*C*X
    devices (emulated on CPU when JAX has not started), or the Mesh given."""
    from jax.sharding import Mesh

    if isinstance(mesh, Mesh):
        return mesh
    import jax

    from qwen3_spmd.run.flags import platform_is_cpu, use_cpu_devices
    from qwen3_spmd.sharding.mesh import make_mesh, parse_mesh

    shape = parse_mesh(mesh)
    n = shape.devices
    if platform_is_cpu() and n > 1:
        try:
            use_cpu_devices(n)
        except RuntimeError:  # JAX has started: the devices it has are the ones
            pass
    devices = jax.devices()
    return make_mesh(
        shape.stage, shape.seq, devices[:n] if len(devices) > n else devices, tensor=shape.tensor
    )
