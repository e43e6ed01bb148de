"""serve's Service without a server: a request's checks, named in the API's terms."""

import dataclasses
import functools

import pytest

from qwen3_spmd.model.config import PRESETS
from qwen3_spmd.pipeline.programs.sampling import Sampling
from qwen3_spmd.pipeline.requests import check_request
from qwen3_spmd.run.serve.protocol import APIError
from qwen3_spmd.run.serve.service import Ask, Service, Settings

CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=100)
SETTINGS = Settings(
    model_name="m",
    max_seq_len=64,
    vocab=100,
    eos_ids=(0,),
    defaults=Sampling(temperature=1.0),
    check=functools.partial(check_request, CFG, 1, 64),  # Engine.check of a 64-token cache
)


def _refused(ask: Ask) -> APIError:
    service = Service(scheduler=None, decode=None, settings=SETTINGS)  # job needs neither
    with pytest.raises(APIError) as e:
        service.job([[1, 2]], ask)
    return e.value


@pytest.mark.parametrize(
    "ask, field, message",
    [
        (Ask(top_p=1.5), "top_p", "top_p 1.5 must be in (0, 1] (1 = off)"),
        (Ask(temperature=-1.0), "temperature", "temperature -1.0 must be a finite number >= 0"),
        (Ask(n=0), "n", "n 0 must be between 1"),
        (Ask(max_tokens=63), "max_tokens", "prompt 0 (2 tokens) + max_tokens 63 = 65 exceeds"),
        (Ask(max_tokens=0), "max_tokens", "max_tokens 0 generates nothing: it needs echo true"),
        (Ask(max_tokens=-1), "max_tokens", "max_tokens -1 must be at least 1"),
        (Ask(stop_token_ids=(100,)), "stop_token_ids", "stop token id 100 is outside"),
        (
            Ask(min_tokens=1, stop_token_ids=tuple(range(1, 9))),
            "stop_token_ids",
            "min_tokens holds back at most 8 end ids, and this request has 9: pass fewer "
            "stop_token_ids",
        ),
    ],
)
def test_a_refusal_names_the_field(ask, field, message):
    """The library's SamplingError names `top_p` as the API does: no flag in the text."""
    e = _refused(ask)
    assert e.status == 400 and e.param == field and e.message.startswith(message)
    assert "--" + field.replace("_", "-") not in e.message


@pytest.mark.parametrize(
    "prompts, field, message",
    [
        ([[1, 2], [3, 100]], "prompt", "prompt 1 has token id 100 outside the vocabulary [0, 100)"),
        ([[1, 2], []], "prompt", "prompt 1 is empty"),
    ],
)
def test_prompts_are_checked_by_the_one_request_check(prompts, field, message):
    """The engine's check_request (Settings.check) refuses them, said in the API's terms."""
    with pytest.raises(APIError) as e:
        Service(None, None, SETTINGS).job(prompts, Ask(max_tokens=4))
    assert (e.value.status, e.value.param) == (400, field)
    assert e.value.message.startswith(message)


def test_a_prompt_past_the_servers_length_is_context_length_exceeded():
    e = _refused(Ask(max_tokens=63))
    assert e.code == "context_length_exceeded" and "the server's --max-seq-len 64" in e.message


def test_a_request_takes_the_defaults_it_leaves_out():
    job = Service(None, None, SETTINGS).job([[1, 2]], Ask(top_k=-1, seed=2**31 + 5))
    assert job.sampling == Sampling(temperature=1.0) and job.seed == 5
    assert job.max_tokens == [62] and job.stop_ids == (0,) and job.n == 1
