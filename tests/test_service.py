"""serve's Service without a server: a request's checks, named in the API's terms."""

import pytest

from qwen3_spmd.pipeline.sampling import Sampling
from qwen3_spmd.run.serve.protocol import APIError
from qwen3_spmd.run.serve.service import Ask, Service, Settings

SETTINGS = Settings(
    model_name="m", max_seq_len=64, vocab=100, eos_ids=(0,), defaults=Sampling(temperature=1.0)
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
        (Ask(max_tokens=63), "max_tokens", "the prompt's 2 tokens plus max_tokens 63 exceed"),
    ],
)
def test_a_refusal_names_the_field(ask, field, message):
    """The library's SamplingError names `top_p` as the API does: no flag in the text."""
    e = _refused(ask)
    assert e.status == 400 and e.param == field and e.message.startswith(message)
    assert "--" + field.replace("_", "-") not in e.message


def test_a_request_takes_the_defaults_it_leaves_out():
    job = Service(None, None, SETTINGS).job([[1, 2]], Ask(top_k=-1, seed=2**31 + 5))
    assert job.sampling == Sampling(temperature=1.0) and job.seed == 5
    assert job.max_tokens == [62] and job.stop_ids == (0,) and job.n == 1
