"""Token ids outside the model's vocabulary are a 400 before the engine (policy/token_ids.py)."""

from __future__ import annotations

import pytest

from appliance.core.errors import BadRequest
from appliance.policy.token_ids import check_token_ids, vocabulary_size


def test_the_vocabulary_is_the_models_or_its_text_models() -> None:
    assert vocabulary_size({"vocab_size": 49152}) == 49152
    assert vocabulary_size({"text_config": {"vocab_size": 262144}}) == 262144
    assert vocabulary_size({}) is None


@pytest.mark.parametrize(("body", "field"), [
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999999999999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"allowed_token_ids": [5, 49152]}, "allowed_token_ids"),
])
def test_an_id_outside_the_vocabulary_is_refused_naming_its_field(
        body: dict[str, object], field: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_token_ids(body, 49152)
    assert refused.value.param == field and refused.value.code == "invalid_token_id"


def test_ids_inside_the_vocabulary_and_an_unknown_vocabulary_pass() -> None:
    check_token_ids({"logit_bias": {"0": -100, "49151": 100}, "allowed_token_ids": [1]}, 49152)
    check_token_ids({"logit_bias": {"-1": 1}}, None)
