"""run.llm: the one Python door. Text and token-id prompts give the tokens
`static_batch.generate` gives on the same prompts (greedy and seeded sampling), budgets and
stop ids end requests with the right reason, requests submitted over time join the
running ones and get the tokens they get alone, and bad input is one line naming the
parameter as this API does."""

import dataclasses
import subprocess
import sys

import pytest
from reference import TINY

import qwen3_spmd
from qwen3_spmd import LLM, SamplingParams
from qwen3_spmd.pipeline.programs.sampling import Sampling, SamplingError
from qwen3_spmd.pipeline.requests import RequestError
from qwen3_spmd.pipeline.scheduling import static_batch

# Prompts of 17 to 24 tokens (the chat prompt's 19 too) share one padded length, 24, in
# the scheduler and in static_batch.generate (the longest is 24): few programs to compile.
IDS = [5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 2, 9, 31, 77, 150, 8, 200, 6, 19, 23, 4, 88, 1, 60]
TEXT = "Why is the sky blue? Hello world"


@pytest.fixture(scope="module")
def llm():
    with LLM(str(TINY), mesh="1x1", max_seq_len=48, max_batch=2, chunk=1) as llm:
        yield llm


def test_text_and_ids_match_engine_generate(llm):
    """Seeded sampling (greedy: the 2x2 test below; the programs are the same but for
    the sampling step, and each costs a compile)."""
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3)
    outs = llm.generate([TEXT, IDS], params)
    ids = [llm.text.encode(TEXT), IDS]
    ref = static_batch.generate(
        llm.engine,
        ids,
        params.max_tokens,
        sampling=Sampling(params.temperature, params.top_k, params.top_p),
        seed=params.seed,
        eos_ids=llm.eos_ids,
        with_logits=False,
    )
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == [c.token_ids for c in ref.completions]
    assert [o.finish_reason for o in outs] == [c.finish_reason for c in ref.completions]
    assert outs[0].prompt == TEXT and outs[1].prompt is None
    assert outs[1].text == llm.text.decode(outs[1].token_ids, skip_special=True)


def test_vllm_prompt_forms_and_sampling_params_keyword(llm):
    """vLLM's {"prompt": text} and {"prompt_token_ids": ids}, and its keyword: the
    tokens of the plain forms (the prompts and programs of the test above)."""
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3)
    plain = llm.generate([TEXT, IDS], params)
    forms = llm.generate([{"prompt": TEXT}, {"prompt_token_ids": IDS}], sampling_params=params)
    assert forms == plain
    alone = llm.generate({"prompt_token_ids": IDS}, params)  # one prompt, index 0
    assert alone == llm.generate([IDS], params)
    with pytest.raises(RequestError, match="one key, prompt"):
        llm.generate({"prompt": TEXT, "prompt_token_ids": IDS})


def test_budgets_and_stop_ids(llm):
    free = SamplingParams(max_tokens=6, temperature=0.9, seed=1, ignore_eos=True)
    base = llm.generate([IDS, IDS], free)  # prompt i samples with key (seed, i, step)
    assert [len(b.token_ids) for b in base] == [6, 6]
    assert [b.finish_reason for b in base] == ["length", "length"]
    stop = base[1].token_ids[2]
    short, stopped = llm.generate(
        [IDS, IDS],
        [
            dataclasses.replace(free, max_tokens=2),
            dataclasses.replace(free, stop_token_ids=(stop,)),
        ],
    )
    assert (short.token_ids, short.finish_reason) == (base[0].token_ids[:2], "length")
    end = base[1].token_ids.index(stop) + 1
    assert (stopped.token_ids, stopped.finish_reason) == (base[1].token_ids[:end], "stop")


def test_submit_over_time_joins_the_running_batch(llm):
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    first = llm.submit(IDS, params)
    tokens = iter(first)
    head = [next(tokens), next(tokens)]  # runs rounds: `first` is decoding now
    second = llm.submit(TEXT, params)
    assert not first.done and llm.scheduler.running == 1
    assert head + list(tokens) == first.tokens
    list(second)
    alone = llm.generate([IDS], params)[0], llm.generate(TEXT, params)[0]
    assert [first.tokens, second.tokens] == [a.token_ids for a in alone]
    assert first.finish_reason == second.finish_reason == "length"


def test_a_batch_past_the_queue_goes_in_as_rows_free_up(llm, monkeypatch):
    params = SamplingParams(max_tokens=3, temperature=0.9, seed=2, ignore_eos=True)
    want = llm.generate([IDS] * 3, params)
    monkeypatch.setattr(llm.scheduler, "max_queue", 0)  # 2 rows, no queue: 3 prompts
    assert llm.generate([IDS] * 3, params) == want


def test_chat_template(llm):
    out = llm.generate("Hi there", SamplingParams(max_tokens=1), chat=True)[0]
    rendered = llm.text.chat("Hi there")
    assert out.prompt == rendered and out.prompt_token_ids == llm.text.encode(rendered)
    assert llm.encode("Hi there", chat=True) == out.prompt_token_ids


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda llm: llm.generate(IDS, SamplingParams(max_tokens=60)), "max_tokens 60"),
        (lambda llm: llm.generate([IDS, [1, 2, 999]]), "prompt 1 has token id 999"),
        (lambda llm: llm.generate(IDS, chat=True), "chat applies to text prompts"),
        (lambda llm: llm.generate([[1.5, 2]]), "text (str) or token ids"),
        (lambda llm: llm.generate([]), "no prompt given"),
        (lambda llm: llm.generate([IDS], [SamplingParams()] * 2), "2 sampling_params"),
    ],
)
def test_bad_input_is_one_line(llm, call, words):
    with pytest.raises(RequestError) as e:
        call(llm)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert "max_new_tokens" not in str(e.value) and "--" not in str(e.value)


def test_sampling_params_take_vllm_spellings():
    """Any integer seed, wrapped as every door wraps it; top_k -1 is off, as in vLLM."""
    assert SamplingParams(seed=2**31 + 5).params(()).seed == 5
    assert SamplingParams(seed=-1).params(()).seed == 2**31 - 1
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_sampling_params_checked_on_construction():
    with pytest.raises(SamplingError, match=r"^temperature -1 must be"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match=r"^max_tokens 0 must be at least 1"):
        SamplingParams(max_tokens=0)


def test_prompt_logprobs_in_vllms_shape(llm):
    """SamplingParams(prompt_logprobs=k): None for the first prompt token, then per token
    a dict id -> Logprob of the token itself and its position's k most likely (the
    numbers: tests/pipeline/runtime/test_prompt_logprobs.py); out of range is one line naming it."""
    (out,) = llm.generate([IDS], SamplingParams(max_tokens=1, prompt_logprobs=2))
    scored = out.prompt_logprobs
    assert len(scored) == len(IDS) and scored[0] is None
    for token, position in zip(IDS[1:], scored[1:]):
        assert token in position and 2 <= len(position) <= 3
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks[:2] == [1, 2] and position[token].rank >= 1
        assert position[token].decoded_token == llm.text.decode([token])
        assert all(lp.logprob <= 0 for lp in position.values())
    (plain,) = llm.generate([IDS], SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids
    for k in (-1, 6):
        with pytest.raises(RequestError, match=rf"^prompt_logprobs {k} must be"):
            SamplingParams(prompt_logprobs=k)


def test_preset_has_no_text_but_runs_ids_on_2x2():
    llm = LLM("tiny", mesh="2x2", max_seq_len=32, max_batch=2, chunk=1)
    with pytest.raises(RequestError, match="pass token ids") as e:
        llm.generate("hello")
    assert "\n" not in str(e.value)
    out = llm.generate(IDS, SamplingParams(max_tokens=3))[0]
    ref = static_batch.generate(llm.engine, [IDS], 3, eos_ids=llm.eos_ids, with_logits=False)
    assert (out.token_ids, out.text) == (ref.completions[0].token_ids, None)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"model": "no/such/folder"}, "model no/such/folder: no such folder"),
        ({"mesh": "3"}, "mesh '3' is not of the form SxC"),
    ],
)
def test_bad_model_or_mesh_is_said_as_arguments(kwargs, words):
    with pytest.raises(ValueError) as e:
        LLM(**kwargs)
    assert str(e.value).startswith(words) and "--" not in str(e.value)


def test_package_import_leaves_jax_alone():
    code = "import sys, qwen3_spmd; assert 'jax' not in sys.modules; print(qwen3_spmd.__all__)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert qwen3_spmd.LLM is LLM
