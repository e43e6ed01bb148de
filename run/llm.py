"""`LLM`: the one Python door. A model and a mesh in, text or token ids to completions.

    from qwen3_spmd import LLM, SamplingParams

    llm = LLM("tests/fixtures/tiny", mesh="1x1", max_seq_len=64)
    for out in llm.generate(["Hello", "The sky"], SamplingParams(max_tokens=8)):
        print(out.finish_reason, out.token_ids, out.text)

vLLM's `LLM` + `SamplingParams`, over this project's pieces: `run.models.open_model`
resolves the model (a Hugging Face or orbax checkpoint folder, or a preset with seeded
random weights), `run.text.Text` tokenizes and renders the chat template, and every
prompt goes to one continuous-batching `pipeline.scheduling.scheduler.Scheduler` over an
`Engine`, so prompts of different lengths and budgets share the decode rows, and
requests submitted later (`submit`) join the running ones. Prompt i of a `generate`
call samples with key (seed, i, step), as in `static_batch.generate`: the same tokens.

Bad input raises `pipeline.requests.RequestError` naming the parameter as this API does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import numbers
import string

from qwen3_spmd.pipeline.batch.handles import Handle, Params, prompt_positions
from qwen3_spmd.pipeline.batch.handles import Logprob as TokenLogprob
from qwen3_spmd.pipeline.programs.sampling import TOP_LOGPROBS, Sampling
from qwen3_spmd.pipeline.requests import RequestError, key_seed
from qwen3_spmd.run import pooled
from qwen3_spmd.run.engine_args import ALIASES, EngineArgs
from qwen3_spmd.run.flags import CLIError, in_names
from qwen3_spmd.run.request_fields import constraint, end_ids, one_format

__all__ = [
    "LLM",
    "Logprob",
    "Output",
    "PoolingOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


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
        try:
            one_format(self._fields())
        except ValueError as e:
            raise RequestError(f"$structured_outputs {e}", "structured_outputs") from None
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    def constraint(self, closed: bool = True):
        """The engine's `Constraint` (from the first token); closed: a JSON Schema's
        objects take only the properties they list (`LLM`'s structured_outputs_config)."""
        return constraint(*one_format(self._fields()), closed=closed)

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks besides its prompt: vLLM's names, and vLLM's defaults but two.

    max_tokens counts every generated token. temperature 0 is greedy; top_k 0 (or -1)
    and top_p 1 are off. Sampled tokens depend on (seed, the prompt's index in its
    `generate` call, step) only; a seed is any integer, taken modulo 2**31 (as by every
    door: pipeline.requests.key_seed). A request stops at the model's EOS ids (unless
    ignore_eos) or at stop_token_ids, keeping that id as its last token; not before
    min_tokens tokens. skip_special_tokens leaves special tokens (<|im_end|>, ...) out
    of `Output.text`. prompt_logprobs: k (0 to sampling.TOP_LOGPROBS) asks for the
    prompt's log-probabilities (`Output.prompt_logprobs`): each prompt token's and its
    position's k most likely; None asks for none. Such a prompt is prefilled whole
    (never from a prefix cache). structured_outputs: what the answer must follow
    (`StructuredOutputsParams`).

    Where vLLM differs: temperature 0.0 here, 1.0 there; seed 0 here, None (a fresh one
    each request) there. So a call that names neither repeats its tokens.
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
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise RequestError(f"$max_tokens {self.max_tokens} must be at least 1", "max_tokens")
        if self.top_k == -1:  # vLLM's older spelling of off
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        k = self.prompt_logprobs
        if k is not None and not (isinstance(k, int) and 0 <= k <= TOP_LOGPROBS):
            raise RequestError(
                f"$prompt_logprobs {k!r} must be None or between 0 and {TOP_LOGPROBS}",
                "prompt_logprobs",
            )
        Sampling(self.temperature, self.top_k, self.top_p)  # its range checks, now

    def params(self, eos_ids: tuple[int, ...], closed: bool = True) -> Params:
        """The scheduler's Params, with the model's EOS ids; closed: as
        `StructuredOutputsParams.constraint`."""
        return Params(
            max_new_tokens=self.max_tokens,
            sampling=Sampling(self.temperature, self.top_k, self.top_p),
            seed=key_seed(self.seed),
            eos_ids=end_ids(eos_ids, self.stop_token_ids, self.ignore_eos),
            min_tokens=self.min_tokens,
            prompt_logprobs=self.prompt_logprobs is not None,
            constraint=(
                self.structured_outputs.constraint(closed) if self.structured_outputs else None
            ),
        )


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model (vLLM's): its rank among all tokens
    (1: the most likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True)
class Output:
    """One prompt's completion. prompt: the text given (after the chat template, with
    chat=True), None for token ids; text: None when the model has no tokenizer.
    finish_reason: "stop" (an EOS or stop id, kept as the last token) or "length".
    prompt_logprobs (with SamplingParams.prompt_logprobs = k, vLLM's shape): None for
    the first prompt token, then for each token a dict id -> Logprob of the token
    itself and its position's k most likely."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclasses.dataclass(frozen=True)
class PoolingOutput:
    """One input's embedding or one pair's score (vLLM's EmbeddingRequestOutput and
    ScoringRequestOutput): `outputs.embedding` or `outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    finished: bool = True


class LLM:
    """A Qwen3 model on a (data, stage, seq, tensor) mesh, ready to generate, or with
    runner="pooling" to embed (Qwen3-Embedding) or score (Qwen3-Reranker, with vLLM's
    hf_overrides).

    Args:
      model: a Hugging Face checkpoint folder, an orbax folder written by `qwen3-spmd
        convert`, a hub id, or a preset name (tiny, 0.6B, ..., 32B: seeded random
        weights); None: the demo (the tiny preset's layers with Qwen3's tokenizer). Text
        needs the folder's tokenizer.json.
      mesh: "SxC", "SxCxX" or "DxSxCxX" (D replicas x S pipeline stages x C sequence
        devices x X tensor devices), or a jax Mesh with axes ('data', 'stage', 'seq',
        'tensor'). On CPU, a mesh of
        several devices is emulated when JAX has not started yet (else JAX must already
        see them).
      **settings: any other field of `run.engine_args.EngineArgs` (dtype, max_seq_len,
        max_batch, chunk, microbatches, cp, expert_split, weights_seed, prefill_tokens,
        enable_prefix_caching, compile_cache, ...), with the default and meaning it has
        for every door; vLLM's names too (max_model_len, max_num_seqs,
        max_num_batched_tokens, tensor_parallel_size, pipeline_parallel_size,
        data_parallel_size).
    """

    def __init__(self, model: str | None = None, mesh=None, **settings):
        from jax.sharding import Mesh

        from qwen3_spmd.sharding.mesh import MeshShape

        given = mesh if isinstance(mesh, Mesh) else None
        text = str(MeshShape.of(given)) if given is not None else mesh
        args = engine_args(model=model, mesh=text, **settings)
        with _as_arguments():
            built = args.build(given)
        self.args, self.spec, self.mesh = args, built.spec, built.engine.mesh
        self.text = self.spec.text()
        self.eos_ids = self.spec.eos_ids()
        self.engine, self.scheduler = built.engine, built.scheduler
        self.pooling = built.pooling  # pipeline.pooling.Pooling, with runner="pooling"
        self.closed_objects = args.structured_outputs().disable_additional_properties

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
            return self.scheduler.submit(
                ids, sampling.params(self.eos_ids, self.closed_objects), sample_index
            )
        except RequestError as e:
            raise _renamed(e) from None

    def generate(
        self,
        prompts: str | list[int] | dict | list[str | list[int] | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
        enable_thinking: bool = True,
    ) -> list[Output]:
        """Completes each prompt, in the order given: one prompt or a list of them, each
        text, a list of token ids, or vLLM's forms `{"prompt": text}` and
        `{"prompt_token_ids": ids}`. chat=True wraps text prompts in the chat template.
        sampling_params: one SamplingParams for all, or one per prompt. Every prompt is
        checked before any runs."""
        sampling = sampling_params
        batch = _as_batch(prompts)
        given = [self._prompt_ids(p, chat, enable_thinking) for p in batch]
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(batch):
                raise RequestError(
                    f"{len(sampling)} $sampling_params for {len(batch)} prompts: give one "
                    "SamplingParams, or one per prompt",
                    "sampling_params",
                )
            each = list(sampling)
        else:
            each = [sampling or SamplingParams()] * len(batch)
        for i, ((ids, _), s) in enumerate(zip(given, each)):  # all checked before any runs
            try:
                self.engine.check([ids], s.max_tokens)
                if s.structured_outputs is not None:
                    self.scheduler.compile_constraint(
                        s.structured_outputs.constraint(self.closed_objects)
                    )
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
                prompt_logprobs=self._prompt_logprobs(ids, h.prompt_logprobs, s.prompt_logprobs),
            )
            for (ids, text), s, h in zip(given, each, handles)
        ]

    def embed(
        self,
        prompts,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        prompt_name: str | None = None,
    ) -> list[PoolingOutput]:
        """Each prompt's embedding (vLLM's `LLM.embed`): one prompt or a list, each text
        (tokenized with the tokenizer's post-processor), token ids, or vLLM's dict forms.
        dimensions: a Matryoshka model's first d values, renormalised. prompt_name:
        sentence-transformers' named prompt put before each text (Qwen3-Embedding's
        "query" instruction, from config_sentence_transformers.json). Needs an
        embedding model on the pooling runner."""
        pooling = self._pooling("embed")
        pooling.check_dimensions(dimensions)
        batch = [_unwrapped(p) for p in _as_batch(prompts)]
        if prompt_name is not None:
            prefix = pooling.prompt(prompt_name)
            batch = [prefix + p if isinstance(p, str) else p for p in batch]
        ids = pooled.input_ids(batch, self.text, "prompts", truncate_prompt_tokens)
        hidden = self._pool(ids)
        return [
            PoolingOutput(str(i), x, EmbeddingOutput(pooling.embed(h, dimensions).tolist()))
            for i, (x, h) in enumerate(zip(ids, hidden))
        ]

    def score(
        self, data_1, data_2, truncate_prompt_tokens: int | None = None
    ) -> list[PoolingOutput]:
        """Each pair's score (vLLM's `LLM.score`): data_1 a text (a query) or a list of
        them, data_2 a text or a list (documents); one data_1 against every data_2, or
        pairwise. A pair is data_1's tokens followed by data_2's, each formatted by the
        caller as the model card says. Needs a reranker on the pooling runner."""
        pooling = self._pooling("score")
        ids = pooled.pairs(
            data_1, data_2, self.text, truncate_prompt_tokens, names=("data_1", "data_2")
        )
        hidden = self._pool(ids)
        return [
            PoolingOutput(str(i), x, ScoringOutput(pooling.score(h)))
            for i, (x, h) in enumerate(zip(ids, hidden))
        ]

    def _pooling(self, task: str):
        """This LLM's Pooling, when it does `task` ("embed" or "score")."""
        if self.pooling is not None and self.pooling.task == task:
            return self.pooling
        needs = {
            "embed": "an embedding model on the pooling runner: LLM(model, runner='pooling')",
            "score": "a reranker on the pooling runner: LLM(model, runner='pooling', "
            "hf_overrides=...) as vLLM serves Qwen3-Reranker",
        }[task]
        does = "generates" if self.pooling is None else f"runs {self.pooling.task}"
        raise RequestError(f"{task} needs {needs}; this LLM {does}", "runner")

    def _pool(self, ids: list[list[int]]) -> list:
        """Each id list's hidden state (`run.pooled.run`)."""
        try:
            return pooled.run(self.engine, self.scheduler, ids)
        except RequestError as e:
            raise _renamed(e) from None

    def _prompt_logprobs(
        self, ids: list[int], scored: list[TokenLogprob] | None, k: int | None
    ) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs from a handle's: per token after the first, the token's
        own and the k most likely (ranks 1..k), the token first."""
        if k is None or scored is None:
            return None
        text = self.text

        def entry(id: int, logprob: float, rank: int) -> Logprob:
            shown = text.decode([id]) if text is not None else None
            return Logprob(logprob, rank, shown)

        return prompt_positions(ids, scored, k, entry)

    def _queue(self, ids: list[int], sampling: SamplingParams, index: int) -> Handle:
        """submit, running rounds while the scheduler's queue is full: a batch larger
        than max_batch + max_queue goes in as rows free up."""
        from qwen3_spmd.pipeline.scheduling.scheduler import QueueFull

        while True:
            try:
                return self.submit(ids, sampling, sample_index=index)
            except QueueFull:
                self.scheduler.step()

    def _prompt_ids(
        self, prompt, chat: bool, enable_thinking: bool
    ) -> tuple[list[int], str | None]:
        """(token ids, the text they came from or None)."""
        if isinstance(prompt, dict):  # vLLM's TextPrompt and TokensPrompt
            return self._prompt_ids(_unwrapped(prompt), chat, enable_thinking)
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
    """One prompt (text, ids, or vLLM's dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise RequestError("no prompt given: pass at least one", "prompts")
    if all(isinstance(x, numbers.Integral) for x in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _unwrapped(prompt):
    """vLLM's dict prompt forms (TextPrompt, TokensPrompt) -> the text or ids they hold;
    anything else as it is."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
        raise RequestError(
            f"a prompt as a dict has one key, prompt (text) or prompt_token_ids, not "
            f"{sorted(prompt)}",
            "prompts",
        )
    (inner,) = prompt.values()
    if isinstance(inner, dict):
        raise RequestError("a prompt's text or ids are not a dict", "prompts")
    return inner


def _renamed(e: RequestError, index: int = 0) -> RequestError:
    """The engine's error with its parameters named as this API names them (and, for a
    check of one prompt of several, that prompt's index)."""
    e = e.at_prompt(index)
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    names = {p: alias for p, alias in ALIASES.items() if alias in fields}  # max_tokens
    template = string.Template(e.template).safe_substitute({k: f"${v}" for k, v in names.items()})
    return type(e)(template, *(names.get(p, p) for p in e.params))


def engine_args(**settings) -> EngineArgs:
    """LLM's arguments as the EngineArgs every door builds from (vLLM's names accepted;
    a name that is neither is refused with the nearest one)."""
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    aliases = {alias: name for name, alias in ALIASES.items() if name in fields}
    given = {}
    for name, value in settings.items():
        field = aliases.get(name, name)
        if field not in fields:
            near = difflib.get_close_matches(name, [*fields, *aliases], n=1)
            hint = f": did you mean {near[0]}?" if near else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
        if field in given:
            raise TypeError(f"LLM() got {field!r} twice (once as {name!r}): give one")
        given[field] = value
    if given.get("dtype") is not None and not isinstance(given["dtype"], str):
        import jax.numpy as jnp

        given["dtype"] = jnp.dtype(given["dtype"]).name  # jnp.float32 as "float32"
    args = EngineArgs(**given)
    with _as_arguments():
        args.check()
    return args


@contextlib.contextmanager
def _as_arguments():
    """The command line's errors ("--model x: ...", "--chunk 0 must ...") said as this
    API's arguments ("model x: ...", "chunk 0 must ..."); the command line's own
    (CLIError) as RequestError, this API's error for bad input."""
    from qwen3_spmd.model.config import ConfigError
    from qwen3_spmd.model.split import TensorError
    from qwen3_spmd.sharding.mesh import MeshError

    try:
        yield
    except (ConfigError, MeshError, TensorError) as e:
        raise type(e)(in_names(str(e))) from None
    except CLIError as e:
        raise RequestError(in_names(str(e))) from None
