"""Clamping the completion budget to the room the context window leaves after the prompt."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.apis.openai.api import CHAT, COMPLETION
from appliance.core.errors import BadRequest
from appliance.policy import CLAMP_HEADER, Clamp, clamp_max_tokens, header_value
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET, effective_prompt_tokens
from tests.unit.appliance.gate.counting import counting_gate, through


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", **fields}


def clamp(body: dict[str, Any], prompt: int, window: int = 1000) -> Clamp | None:
    """The rule alone: the budget in `body` fitted to the room `prompt` tokens leave."""
    fields = CHAT_BUDGET if "messages" in body else COMPLETION_BUDGET
    return clamp_max_tokens(body, fields=fields, prompt_tokens=prompt, max_model_len=window,
                            defaulted=False)


def gated(body: dict[str, Any], prompt: int, default: int, window: int = 1000) -> str | None:
    """`body` through the real gate, policy.default_max_tokens = `default`: the clamp header
    the client gets (None without one); `body` becomes what is forwarded to the worker."""
    api = CHAT if "messages" in body else COMPLETION
    vetted = through(counting_gate(prompt, window, default_max_tokens=default), body, api)
    body.clear()
    body.update(vetted.payload)
    return vetted.headers.get(CLAMP_HEADER)


def refusal(body: dict[str, Any], prompt: int, window: int = 1000) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        clamp(body, prompt, window)
    assert caught.value.status == 400
    return caught.value


def test_a_budget_above_the_room_is_clamped_to_the_room() -> None:
    body = chat(max_tokens=1_000_000)
    assert clamp(body, prompt=157, window=2000) == Clamp("max_tokens", 1_000_000, 1843)
    assert body["max_tokens"] == 1843


def test_a_budget_exactly_equal_to_the_room_is_left_alone() -> None:
    body = chat(max_tokens=900)
    assert clamp(body, prompt=100) is None
    assert body["max_tokens"] == 900


def test_a_budget_one_above_the_room_is_clamped() -> None:
    body = chat(max_tokens=901)
    assert clamp(body, prompt=100) == Clamp("max_tokens", 901, 900)


def test_a_room_of_exactly_one_token_clamps_to_one() -> None:
    body = chat(max_completion_tokens=50)
    assert clamp(body, prompt=999) == Clamp("max_completion_tokens", 50, 1)
    assert body["max_completion_tokens"] == 1


def test_a_prompt_exactly_filling_the_window_is_refused() -> None:
    error = refusal(chat(max_tokens=1), prompt=1000)
    assert (error.param, error.code) == ("messages", "context_length_exceeded")
    assert error.message == (
        "This model's maximum context length is 1000 tokens. However, your messages resulted "
        "in 1000 tokens. Please reduce the length of the messages."
    )


def test_a_prompt_over_the_window_is_refused_even_without_a_budget() -> None:
    error = refusal(chat(), prompt=1500)
    assert error.code == "context_length_exceeded"
    assert "resulted in 1500 tokens" in error.message


def test_a_completion_prompt_over_the_window_names_the_prompt() -> None:
    error = refusal(completion(), prompt=1000)
    assert error.param == "prompt"
    assert "your prompt resulted in 1000 tokens" in error.message


def test_chat_clamps_both_budget_fields_and_reports_the_one_vllm_obeys() -> None:
    body = chat(max_tokens=5000, max_completion_tokens=4000)
    assert clamp(body, prompt=100) == Clamp("max_completion_tokens", 4000, 900)
    assert (body["max_tokens"], body["max_completion_tokens"]) == (900, 900)


def test_chat_reports_max_tokens_when_only_it_needed_clamping() -> None:
    body = chat(max_tokens=5000, max_completion_tokens=10)
    assert clamp(body, prompt=100) == Clamp("max_tokens", 5000, 900)
    assert body["max_completion_tokens"] == 10


def test_completions_know_only_max_tokens() -> None:
    body = completion(max_completion_tokens=10**6)
    assert clamp(body, prompt=100) is None
    assert body == completion(max_completion_tokens=10**6)


def test_no_budget_and_no_default_leaves_the_field_absent() -> None:
    body = chat()
    assert clamp(body, prompt=100) is None
    assert body == chat()


def test_a_null_budget_counts_as_absent_and_takes_the_default() -> None:
    body = chat(max_tokens=None)
    assert gated(body, prompt=100, default=256) is None
    assert body["max_completion_tokens"] == 256


def test_no_budget_takes_the_default_when_it_fits_and_reports_no_clamp() -> None:
    body = completion()
    assert gated(body, prompt=100, default=900) is None
    assert body["max_tokens"] == 900


def test_a_default_larger_than_the_room_is_clamped_and_marked_as_the_default() -> None:
    body = chat()
    assert gated(body, prompt=100, default=4096) == "requested=4096; applied=900; source=default"
    assert body["max_completion_tokens"] == 900


def test_a_completion_default_goes_in_max_tokens() -> None:
    body = completion()
    assert gated(body, prompt=100, default=4096) == "requested=4096; applied=900; source=default"
    assert body["max_tokens"] == 900


def test_a_client_budget_is_kept_over_the_default() -> None:
    body = chat(max_tokens=10)
    assert gated(body, prompt=100, default=500) is None
    assert body["max_tokens"] == 10 and "max_completion_tokens" not in body


def test_truncate_prompt_tokens_shrinks_the_prompt_that_is_counted() -> None:
    body = chat(max_tokens=10**6, truncate_prompt_tokens=200)
    assert clamp(body, prompt=5000) == Clamp("max_tokens", 10**6, 800)


def test_truncate_prompt_tokens_above_the_prompt_length_changes_nothing() -> None:
    body = chat(max_tokens=10**6, truncate_prompt_tokens=900)
    assert clamp(body, prompt=100) == Clamp("max_tokens", 10**6, 900)


def test_truncate_prompt_tokens_of_minus_one_means_the_window_and_leaves_no_room() -> None:
    error = refusal(chat(truncate_prompt_tokens=-1), prompt=5000)
    assert error.code == "context_length_exceeded"
    assert "resulted in 1000 tokens" in error.message


def test_truncate_prompt_tokens_of_minus_one_with_a_short_prompt_keeps_the_prompt() -> None:
    assert effective_prompt_tokens(chat(truncate_prompt_tokens=-1), 10, 1000) == 10


def test_truncate_prompt_tokens_equal_to_the_window_leaves_no_room() -> None:
    assert refusal(chat(truncate_prompt_tokens=1000), prompt=1200).code == "context_length_exceeded"


def test_truncate_prompt_tokens_above_the_window_is_refused_as_vllm_does() -> None:
    error = refusal(chat(truncate_prompt_tokens=1001), prompt=10)
    assert (error.param, error.code) == ("truncate_prompt_tokens", "invalid_value")


@pytest.mark.parametrize("value", [0, -2, "5", True])
def test_a_bad_truncate_prompt_tokens_is_refused_here_too(value: Any) -> None:
    assert refusal(chat(truncate_prompt_tokens=value), prompt=10).param == "truncate_prompt_tokens"


@pytest.mark.parametrize("value", [0, True, "100", 1.5])
def test_a_bad_budget_is_a_400_not_a_crash(value: Any) -> None:
    assert refusal(chat(max_tokens=value), prompt=10).param == "max_tokens"


def test_header_value_shows_requested_and_applied() -> None:
    assert header_value(Clamp("max_tokens", 1_000_000, 1843)) == "requested=1000000; applied=1843"


def test_header_value_says_when_the_budget_was_the_default() -> None:
    clamped = Clamp("max_tokens", 4096, 900, defaulted=True)
    assert header_value(clamped) == "requested=4096; applied=900; source=default"


@given(
    prompt=st.integers(0, 5000),
    window=st.integers(16, 5000),
    requested=st.integers(1, 10**9),
)
def test_the_applied_budget_always_fits_and_never_grows(prompt: int, window: int, requested: int) -> None:
    body = chat(max_tokens=requested)
    try:
        result = clamp(body, prompt=prompt, window=window)
    except BadRequest:
        assert prompt >= window
        return
    assert 1 <= body["max_tokens"] <= min(requested, window - prompt)
    assert (result is None) == (requested <= window - prompt)
