"""max_tokens_limit: over-limit requests are a 400 naming the parameter (no Ray needed;
tests/test_faults.py checks the same through the served app)."""

import pytest

from pipeline.api.media_parts import request_models
from pipeline.api.sampling import check_max_tokens
from pipeline.errors import IrisError

MODELS = request_models()


def validate_sampling(body: dict, route: str):
    return MODELS[route].validate_python(body)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_over_the_limit_names_the_parameter(field):
    req = validate_sampling({**CHAT, field: 101}, "chat")
    with pytest.raises(IrisError) as err:
        check_max_tokens(req, 100)
    assert err.value.status_code == 400 and err.value.param == field and err.value.code == "invalid_value"
    assert "101" in err.value.message and "100" in err.value.message


def test_max_completion_tokens_wins_over_max_tokens():
    # vLLM reads max_completion_tokens first; the check must judge the value that is used.
    check_max_tokens(validate_sampling({**CHAT, "max_tokens": 500, "max_completion_tokens": 100}, "chat"), 100)
    with pytest.raises(IrisError) as err:
        check_max_tokens(validate_sampling({**CHAT, "max_tokens": 5, "max_completion_tokens": 101}, "chat"), 100)
    assert err.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    "body,limit", [({**CHAT, "max_tokens": 100}, 100), (CHAT, 100), ({**CHAT, "max_tokens": 10**6}, None)]
)
def test_within_the_limit_or_unset_or_no_limit_passes(body, limit):
    check_max_tokens(validate_sampling(body, "chat"), limit)


def test_completions_too():
    with pytest.raises(IrisError) as err:
        check_max_tokens(validate_sampling({"prompt": "hi", "max_tokens": 101}, "completion"), 100)
    assert err.value.param == "max_tokens"


def test_responses_max_output_tokens_too():
    body = {"input": "hi", "max_output_tokens": 101}
    with pytest.raises(IrisError) as err:
        check_max_tokens(validate_sampling(body, "responses"), 100)
    assert err.value.param == "max_output_tokens"
    check_max_tokens(validate_sampling({**body, "max_output_tokens": 100}, "responses"), 100)
