"""Body parsing and shape checks: every bad input is a 400 naming the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from appliance.core.errors import BadRequest
from appliance.policy import parse_json, validate_chat, validate_completion


def error_of(call: Callable[[], object]) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call()
    assert caught.value.status == 400
    assert caught.value.kind == "invalid_request_error"
    return caught.value


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Once upon a time", **fields}


# --- parse_json -------------------------------------------------------------------------


def test_parse_json_returns_the_object() -> None:
    assert parse_json(b'{"model": "m", "n": 1}') == {"model": "m", "n": 1}


@pytest.mark.parametrize("raw", [b"", b"   \n\t"], ids=["empty", "whitespace"])
def test_parse_json_refuses_an_empty_body(raw: bytes) -> None:
    error = error_of(lambda: parse_json(raw))
    assert error.code == "invalid_json"
    assert "empty" in error.message


@pytest.mark.parametrize(
    "raw",
    [b"{", b'{"a": }', b"{'a': 1}", b'{"a": 1,}', b'{"a": "\xff"}', b"\xff\xfe\x00"],
    ids=["unclosed", "missing-value", "single-quotes", "trailing-comma", "bad-utf8", "binary"],
)
def test_parse_json_refuses_malformed_json(raw: bytes) -> None:
    error = error_of(lambda: parse_json(raw))
    assert error.code == "invalid_json"
    assert error.message.startswith("The request body is not valid JSON")


@pytest.mark.parametrize("raw", [b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}'])
def test_parse_json_refuses_non_standard_numbers(raw: bytes) -> None:
    assert error_of(lambda: parse_json(raw)).code == "invalid_json"


def test_parse_json_refuses_pathological_nesting() -> None:
    error = error_of(lambda: parse_json(b"[" * 200_000 + b"]" * 200_000))
    assert error.code == "invalid_json"


def test_parse_json_refuses_an_integer_too_long_to_convert() -> None:
    error = error_of(lambda: parse_json(b'{"n": ' + b"9" * 5000 + b"}"))
    assert error.code == "invalid_json"
    assert "set_int_max_str_digits" not in error.message


def test_parse_json_says_where_the_syntax_error_is() -> None:
    error = error_of(lambda: parse_json(b'{"model": "m",\n "n": }'))
    assert error.message.endswith("invalid character at line 2 column 7.")


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"[1]", "an array"),
        (b'"s"', "a string"),
        (b"3", "a number"),
        (b"null", "null"),
        (b"true", "a boolean"),
    ],
)
def test_parse_json_refuses_a_non_object(raw: bytes, kind: str) -> None:
    error = error_of(lambda: parse_json(raw))
    assert error.code == "invalid_json"
    assert error.message == f"The request body must be a JSON object, not {kind}."


# --- validate_chat ----------------------------------------------------------------------


def test_validate_chat_accepts_a_minimal_request() -> None:
    validate_chat(chat())


def test_validate_chat_leaves_unknown_and_known_fields_untouched() -> None:
    body = chat(
        model="m",
        top_k=20,
        chat_template_kwargs={"enable_thinking": False},
        stream=True,
        stream_options={"include_usage": True},
        guided_json={"type": "object"},
        extra_body={"anything": [1, 2]},
        n=2,
        temperature=0,
        top_p=1,
        max_tokens=None,
        tool_choice="auto",
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    before = copy.deepcopy(body)
    validate_chat(body)
    assert body == before


@pytest.mark.parametrize(
    "messages", [None, [], "hi", {"role": "user"}], ids=["missing", "empty", "string", "object"]
)
def test_validate_chat_requires_a_non_empty_messages_list(messages: Any) -> None:
    body = {} if messages is None else {"messages": messages}
    assert error_of(lambda: validate_chat(body)).param == "messages"


def test_validate_chat_names_a_message_that_is_not_an_object() -> None:
    body = {"messages": [{"role": "user", "content": "a"}, "b"]}
    assert error_of(lambda: validate_chat(body)).param == "messages[1]"


@pytest.mark.parametrize("role", [None, "robot", "", 3, ["user"], {"r": 1}])
def test_validate_chat_names_a_bad_role(role: Any) -> None:
    body = {"messages": [{"role": "user", "content": "a"}] * 2 + [{"role": role, "content": "x"}]}
    if role is None:
        del body["messages"][2]["role"]
    error = error_of(lambda: validate_chat(body))
    assert (error.param, error.code) == ("messages[2].role", "invalid_value")


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer", "function"])
def test_validate_chat_accepts_every_openai_role(role: str) -> None:
    validate_chat({"messages": [{"role": role, "content": "x"}]})


@pytest.mark.parametrize("role", ["assistant", "function"])
def test_validate_chat_allows_null_content_where_openai_does(role: str) -> None:
    validate_chat({"messages": [{"role": role, "content": None, "tool_calls": []}]})
    validate_chat({"messages": [{"role": role}]})


@pytest.mark.parametrize("role", ["system", "user", "tool", "developer"])
def test_validate_chat_requires_content_for_other_roles(role: str) -> None:
    error = error_of(lambda: validate_chat({"messages": [{"role": role, "content": None}]}))
    assert error.param == "messages[0].content"


@pytest.mark.parametrize("content", [3, True, {"type": "text", "text": "x"}])
def test_validate_chat_refuses_content_that_is_neither_string_nor_list(content: Any) -> None:
    error = error_of(lambda: validate_chat({"messages": [{"role": "user", "content": content}]}))
    assert (error.param, error.code) == ("messages[0].content", "invalid_type")


def test_validate_chat_accepts_content_parts_and_plain_string_parts() -> None:
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://img.example/x.png"}},
        "a plain string part, which vLLM reads as text",
    ]
    validate_chat({"messages": [{"role": "user", "content": parts}]})


@pytest.mark.parametrize(
    ("part", "param"),
    [
        (3, "messages[0].content[1]"),
        (None, "messages[0].content[1]"),
        ({"text": "x"}, "messages[0].content[1].type"),
        ({"type": 1}, "messages[0].content[1].type"),
    ],
    ids=["number", "null", "no-type", "type-not-string"],
)
def test_validate_chat_names_a_bad_content_part(part: Any, param: str) -> None:
    content = [{"type": "text", "text": "x"}, part]
    error = error_of(lambda: validate_chat({"messages": [{"role": "user", "content": content}]}))
    assert error.param == param


@pytest.mark.parametrize("field", ["n", "best_of", "max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize(
    ("value", "code"),
    [
        (0, "invalid_value"),
        (-3, "invalid_value"),
        (True, "invalid_type"),
        (False, "invalid_type"),
        (2.0, "invalid_type"),
        ("2", "invalid_type"),
        ([2], "invalid_type"),
    ],
)
def test_validate_chat_refuses_bad_counts(field: str, value: Any, code: str) -> None:
    error = error_of(lambda: validate_chat(chat(**{field: value})))
    assert (error.param, error.code) == (field, code)


@pytest.mark.parametrize("field", ["n", "best_of", "max_tokens", "max_completion_tokens"])
def test_validate_chat_treats_null_as_absent(field: str) -> None:
    validate_chat(chat(**{field: None}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", -1),
        ("top_p", "1"),
        ("top_p", False),
        ("top_p", 10**400),  # JSON allows any length; past every float, not an overflow (500)
        ("temperature", -(10**400)),
    ],
)
def test_validate_chat_refuses_sampling_numbers_out_of_range(field: str, value: Any) -> None:
    assert error_of(lambda: validate_chat(chat(**{field: value}))).param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 0), ("temperature", 1.7), ("temperature", 3), ("top_p", 1), ("top_p", 0.01)],
)
def test_validate_chat_accepts_sampling_numbers_vllm_accepts(field: str, value: Any) -> None:
    validate_chat(chat(**{field: value}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"),
        ("stream", 1),
        ("model", 5),
        ("logprobs", 1),
        ("top_logprobs", -2),
        ("top_logprobs", True),
        ("tools", {"type": "function"}),
        ("tools", ["f"]),
        ("tool_choice", "sometimes"),
        ("tool_choice", 1),
        ("chat_template_kwargs", [1]),
    ],
)
def test_validate_chat_refuses_other_known_fields_of_the_wrong_type(field: str, value: Any) -> None:
    param = error_of(lambda: validate_chat(chat(**{field: value}))).param
    assert param is not None and param.startswith(field)


@pytest.mark.parametrize("value", [-1, 0, 5])
def test_validate_chat_accepts_top_logprobs_counts_vllm_accepts(value: int) -> None:
    validate_chat(chat(logprobs=True, top_logprobs=value))


@pytest.mark.parametrize("value", [0, -2, "5", True, 1.5])
def test_validate_refuses_a_bad_truncate_prompt_tokens(value: Any) -> None:
    error = error_of(lambda: validate_chat(chat(truncate_prompt_tokens=value)))
    assert error.param == "truncate_prompt_tokens"
    error = error_of(lambda: validate_completion(completion(truncate_prompt_tokens=value)))
    assert error.param == "truncate_prompt_tokens"


@pytest.mark.parametrize("value", [-1, 1, 4096])
def test_validate_accepts_truncate_prompt_tokens_of_minus_one_or_positive(value: int) -> None:
    validate_chat(chat(truncate_prompt_tokens=value))
    validate_completion(completion(truncate_prompt_tokens=value))


# --- validate_completion ----------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    ["text", "", ["a", "b"], [1, 2, 3], [[1, 2], [3]]],
    ids=["string", "empty-string", "strings", "tokens", "token-lists"],
)
def test_validate_completion_accepts_every_prompt_form(prompt: Any) -> None:
    validate_completion({"prompt": prompt})


def test_validate_completion_accepts_prompt_embeds_instead_of_a_prompt() -> None:
    validate_completion({"prompt_embeds": "base64-tensor"})


@pytest.mark.parametrize(
    "prompt",
    [None, 3, [], ["a", 1], [1, -1], [True], [[1], []], [[1], "a"], [[1.5]], {"text": "x"}],
    ids=[
        "missing",
        "number",
        "empty",
        "mixed",
        "negative-token",
        "bool-token",
        "empty-inner",
        "mixed-inner",
        "float-token",
        "object",
    ],
)
def test_validate_completion_refuses_a_bad_prompt(prompt: Any) -> None:
    body = {} if prompt is None else {"prompt": prompt}
    assert error_of(lambda: validate_completion(body)).param == "prompt"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("best_of", True),
        ("max_tokens", "16"),
        ("temperature", -1),
        ("top_p", 2),
        ("stream", "true"),
        ("logprobs", True),
        ("logprobs", -5),
        ("echo", "no"),
        ("model", ["m"]),
    ],
)
def test_validate_completion_names_the_bad_field(field: str, value: Any) -> None:
    assert error_of(lambda: validate_completion(completion(**{field: value}))).param == field


@pytest.mark.parametrize("logprobs", [-1, 0, 5])
def test_validate_completion_takes_logprobs_as_a_count(logprobs: int) -> None:
    validate_completion(completion(logprobs=logprobs))


def test_messages_name_the_value_without_echoing_large_payloads() -> None:
    error = error_of(lambda: validate_chat(chat(temperature="x" * 10_000)))
    assert len(error.message) < 120
