"""A client's rules on its body: the max_tokens ceiling, its priority, the usage its meter needs."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.core.errors import BadRequest
from appliance.policy.client import ask_usage, cap_max_tokens, drop_priority
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET


def test_no_ceiling_changes_nothing() -> None:
    body = {"max_tokens": 10**6}
    assert cap_max_tokens(body, COMPLETION_BUDGET, None) == (False, None)
    assert body == {"max_tokens": 10**6}


def test_a_budget_above_the_ceiling_is_clamped_and_reported() -> None:
    body: dict[str, Any] = {"max_tokens": 2000}
    changed, clamp = cap_max_tokens(body, COMPLETION_BUDGET, 512)
    assert changed and body["max_tokens"] == 512
    assert clamp is not None and (clamp.field, clamp.requested, clamp.applied) == (
        "max_tokens", 2000, 512)


def test_a_budget_within_the_ceiling_is_left_alone() -> None:
    body = {"max_tokens": 100}
    assert cap_max_tokens(body, COMPLETION_BUDGET, 512) == (False, None)


def test_no_budget_gets_the_ceiling_without_a_clamp_report() -> None:
    body: dict[str, Any] = {}
    assert cap_max_tokens(body, CHAT_BUDGET, 256) == (True, None)
    assert body == {"max_completion_tokens": 256}


def test_every_chat_budget_field_is_capped_and_the_one_vllm_obeys_is_reported() -> None:
    body: dict[str, Any] = {"max_completion_tokens": 900, "max_tokens": 50}
    changed, clamp = cap_max_tokens(body, CHAT_BUDGET, 300)
    assert changed and body == {"max_completion_tokens": 300, "max_tokens": 50}
    assert clamp is not None and clamp.field == "max_completion_tokens"
    body = {"max_completion_tokens": 100, "max_tokens": 900}
    changed, clamp = cap_max_tokens(body, CHAT_BUDGET, 300)
    assert changed and clamp is None and body["max_tokens"] == 300  # vLLM obeys the first


def test_a_budget_of_the_wrong_type_is_a_400_naming_it() -> None:
    with pytest.raises(BadRequest) as refused:
        cap_max_tokens({"max_tokens": "lots"}, COMPLETION_BUDGET, 10)
    assert refused.value.param == "max_tokens"


@pytest.mark.parametrize("sent", [-100, 3, "urgent", 0.5, True, None])
def test_a_priority_the_client_sent_is_taken_out_whatever_it_is(sent: object) -> None:
    body: dict[str, Any] = {"priority": sent, "model": "m"}
    assert drop_priority(body)
    assert body == {"model": "m"}


def test_a_body_without_a_priority_is_left_unchanged() -> None:
    body: dict[str, Any] = {"model": "m"}
    assert not drop_priority(body) and body == {"model": "m"}


def test_no_ceiling_on_a_route_without_a_budget_field() -> None:
    """count_tokens, tokenize: nothing to cap, and no budget field is made up."""
    body: dict[str, Any] = {"messages": []}
    assert cap_max_tokens(body, (), 10) == (False, None) and body == {"messages": []}


def test_a_stream_is_asked_for_its_usage_once_and_keeps_its_other_options() -> None:
    body: dict[str, Any] = {"stream": True, "stream_options": {"other": 1}}
    assert ask_usage(body)
    assert body["stream_options"] == {"other": 1, "include_usage": True}
    assert not ask_usage(body)  # now asked: nothing to strip


def test_continuous_usage_the_client_could_not_have_had_is_not_turned_on() -> None:
    body: dict[str, Any] = {"stream": True,
                            "stream_options": {"include_usage": False,
                                               "continuous_usage_stats": True}}
    assert ask_usage(body)
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("body", [{"stream": False}, {}, {"stream": "yes"},
                                  {"stream": True, "stream_options": {"include_usage": True}}])
def test_a_body_that_needs_no_usage_request_is_left_alone(body: dict[str, Any]) -> None:
    before = dict(body)
    assert not ask_usage(body) and body == before
