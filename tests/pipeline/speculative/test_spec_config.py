"""speculative_config: vLLM's keys read, a missing bound filled, bad values refused in
one line."""

import pytest

from qwen3_spmd.pipeline.speculative.config import SpeculativeConfig, SpeculativeConfigError


def test_config_reads_vllm_keys_and_fills_a_missing_bound():
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (4, 3, 3)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.method, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 2, 2)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 1}).prompt_lookup_max == 5
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert c.disable_by_batch_size is None
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "disable_by_batch_size": 4})
    assert c.disable_by_batch_size == 4


@pytest.mark.parametrize(
    "value, words",
    [
        ("{'method': 'ngram'}", "not JSON"),
        ("[4]", "list is not an object"),
        ({"num_speculative_tokens": 4, "lookahead": 2}, "unknown key 'lookahead'"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method 'eagle' is not one of"),
        ({"method": "draft_model", "num_speculative_tokens": 4}, "needs model"),
        (
            {"method": "ngram", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4},
            "model is a key of method 'draft_model', not of 'ngram'",
        ),
        (
            {"method": "draft_model", "model": "m", "num_speculative_tokens": 4}
            | {"prompt_lookup_max": 2},
            "prompt_lookup_max is a key of method 'ngram'",
        ),
        ({"method": "ngram"}, "num_speculative_tokens is missing"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens 0 must be an integer >= 1"),
        ({"num_speculative_tokens": "4"}, "num_speculative_tokens '4' must be an integer"),
        (
            {"num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size 0 must be an integer >= 1",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min 4 exceeds prompt_lookup_max 2",
        ),
    ],
)
def test_a_malformed_config_is_refused_in_one_line(value, words):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.parse(value)
    message = str(e.value)
    assert words in message and "\n" not in message
    assert message == f"speculative_config: {e.value.problem}"
