"""Tool-call prerequisites and the thinking switch in chat_template_kwargs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from appliance.core.errors import BadRequest
from appliance.policy import apply_thinking, check_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def refusal(call: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


# --- check_tools ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": None},
    ],
    ids=["implied-auto", "explicit-auto", "null-choice"],
)
def test_auto_tool_choice_without_a_parser_is_refused_naming_the_setting(fields: Any) -> None:
    error = refusal(lambda: check_tools(chat(**fields), tool_parser=None))
    assert (error.param, error.code) == ("tool_choice", "tool_parser_not_configured")
    assert "engine.tool_call_parser" in error.message


@pytest.mark.parametrize(
    "tool_choice",
    ["none", "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["none", "required", "named"],
)
def test_choices_vllm_serves_without_a_parser_pass(tool_choice: Any) -> None:
    """'required' and a named function use structured output in vLLM, not the parser."""
    check_tools(chat(tools=TOOLS, tool_choice=tool_choice), tool_parser=None)


@pytest.mark.parametrize("fields", [{}, {"tools": []}, {"tools": None}, {"tool_choice": "auto"}])
def test_requests_without_tools_pass_without_a_parser(fields: Any) -> None:
    check_tools(chat(**fields), tool_parser=None)


def test_a_configured_parser_lets_auto_through() -> None:
    check_tools(chat(tools=TOOLS), tool_parser="hermes")


# --- apply_thinking ---------------------------------------------------------------------


def apply(
    body: dict[str, Any], defaults: dict[str, Any] | None = None, disable: bool = False
) -> dict[str, Any]:
    apply_thinking(body, default_kwargs=defaults or {}, disable_with_tools=disable)
    return body


def test_defaults_are_merged_under_the_clients_own_kwargs() -> None:
    body = apply(
        chat(chat_template_kwargs={"enable_thinking": True, "custom": 1}),
        defaults={"enable_thinking": False, "reasoning_effort": "low"},
    )
    assert body["chat_template_kwargs"] == {
        "enable_thinking": True,
        "custom": 1,
        "reasoning_effort": "low",
    }


def test_defaults_alone_are_set_when_the_client_sent_none() -> None:
    assert apply(chat(), defaults={"enable_thinking": False})["chat_template_kwargs"] == {
        "enable_thinking": False
    }


def test_nothing_is_added_when_there_is_nothing_to_set() -> None:
    assert apply(chat()) == chat()


def test_the_configured_defaults_are_never_mutated() -> None:
    defaults = {"nested": {"a": 1}}
    body = apply(chat(), defaults=defaults)
    body["chat_template_kwargs"]["nested"]["a"] = 2
    assert defaults == {"nested": {"a": 1}}


@pytest.mark.parametrize(("kind", "flag"), [("enabled", True), ("disabled", False)])
def test_a_thinking_field_becomes_enable_thinking_and_is_removed(kind: str, flag: bool) -> None:
    body = apply(chat(thinking={"type": kind, "budget_tokens": 1024}), defaults={"enable_thinking": not flag})
    assert "thinking" not in body
    assert body["chat_template_kwargs"] == {"enable_thinking": flag}


def test_a_null_thinking_field_is_removed_and_changes_nothing() -> None:
    assert apply(chat(thinking=None)) == chat()


@pytest.mark.parametrize("thinking", ["enabled", True, {"type": "adaptive"}, {}, [{"type": "enabled"}]])
def test_a_bad_thinking_value_is_refused(thinking: Any) -> None:
    body = chat(thinking=thinking)
    error = refusal(lambda: apply(body))
    assert (error.param, error.code) == ("thinking", "invalid_value")


def test_thinking_that_contradicts_chat_template_kwargs_is_refused() -> None:
    body = chat(thinking={"type": "enabled"}, chat_template_kwargs={"enable_thinking": False})
    assert refusal(lambda: apply(body)).code == "conflicting_thinking"


def test_thinking_that_agrees_with_chat_template_kwargs_passes() -> None:
    body = apply(chat(thinking={"type": "enabled"}, chat_template_kwargs={"enable_thinking": True}))
    assert body["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("kwargs", [[1], "enable_thinking", 3])
def test_chat_template_kwargs_that_are_not_an_object_are_refused(kwargs: Any) -> None:
    assert refusal(lambda: apply(chat(chat_template_kwargs=kwargs))).param == "chat_template_kwargs"


def test_tools_switch_thinking_off_when_configured_even_over_a_default() -> None:
    body = apply(chat(tools=TOOLS), defaults={"enable_thinking": True}, disable=True)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(
    "fields",
    [{"chat_template_kwargs": {"enable_thinking": True}}, {"thinking": {"type": "enabled"}}],
    ids=["kwargs", "thinking"],
)
def test_a_clients_own_thinking_choice_wins_over_disable_with_tools(fields: Any) -> None:
    body = apply(chat(tools=TOOLS, **fields), disable=True)
    assert body["chat_template_kwargs"]["enable_thinking"] is True


@pytest.mark.parametrize(
    ("fields", "disable"),
    [
        ({"tools": TOOLS}, False),
        ({"tools": TOOLS, "tool_choice": "none"}, True),
        ({"tools": []}, True),
        ({}, True),
    ],
    ids=["setting-off", "tool-choice-none", "empty-tools", "no-tools"],
)
def test_thinking_is_left_alone_when_tools_are_not_active_or_the_setting_is_off(
    fields: Any, disable: bool
) -> None:
    body = apply(chat(**fields), disable=disable)
    assert "chat_template_kwargs" not in body


def test_apply_thinking_touches_nothing_but_its_two_keys() -> None:
    body = chat(tools=TOOLS, top_k=5, thinking={"type": "disabled"})
    expected = copy.deepcopy(body)
    del expected["thinking"]
    apply(body)
    del body["chat_template_kwargs"]
    assert body == expected
