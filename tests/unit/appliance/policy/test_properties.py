"""Properties over generated bodies: the gate answers a client error or passes, never crashes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.apis.openai.api import CHAT, OPENAI
from appliance.core.errors import ApiError
from appliance.policy import parse_json, validate_chat, validate_completion
from appliance.policy.max_tokens import CHAT_BUDGET, effective_prompt_tokens
from tests.unit.appliance.gate.counting import counting_gate, through

KNOWN_KEYS = [
    "model",
    "messages",
    "prompt",
    "n",
    "best_of",
    "beam_width",
    "use_beam_search",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stream",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "thinking",
    "truncate_prompt_tokens",
    "echo",
    "prompt_embeds",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**40)
    | st.floats(allow_nan=False)
    | st.sampled_from(["", "auto", "none", "required", "enabled", "data:,", "http://h/x"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["type", "url", "data", "function", "x"]), inner, max_size=3)
    ),
    max_leaves=8,
)
urls = st.sampled_from(
    [
        "http://img.example/a.png",
        "http://10.0.0.1/",
        "file:///etc/passwd",
        "data:image/png;base64,",
        "data:image/png;base64,iVBORw0KGgo=",
        "data:,x",
        "HTTP://IMG.EXAMPLE:99999/",
        "http://a@b/",
    ]
) | st.text(max_size=12)
typed_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "file", "video_url", "x"])},
    optional={
        "text": st.text(max_size=4),
        "image_url": urls | st.fixed_dictionaries({"url": urls | json_values}),
        "input_audio": json_values | st.fixed_dictionaries({"data": st.text(max_size=8)}),
        "uuid": st.text(max_size=3),
        "video_url": urls,
    },
)
parts = typed_parts | json_values
messages = (
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system", "robot"])},
        optional={"content": st.text(max_size=4) | st.lists(parts, max_size=3) | json_values},
    )
    | json_values
)
field_values = json_values | st.integers(-2, 100) | st.sampled_from([{"type": "enabled"}, [{}]])
bodies = st.fixed_dictionaries(
    {"messages": st.lists(messages, min_size=1, max_size=3) | json_values},
    optional={key: field_values for key in KNOWN_KEYS if key != "messages"},
)


def assert_client_error(call: Callable[[], object]) -> None:
    try:
        call()
    except ApiError as exc:
        assert exc.status < 500
        assert exc.code
        json.dumps(OPENAI.body(exc, None))


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_parse_json_never_fails_with_anything_but_a_client_error(raw: bytes) -> None:
    assert_client_error(lambda: validate_chat(parse_json(raw)))


@settings(max_examples=200, deadline=None)
@given(body=bodies)
def test_validate_chat_and_completion_never_fail_with_anything_but_a_client_error(
    body: dict[str, Any],
) -> None:
    raw = json.dumps(body).encode()
    assert_client_error(lambda: validate_chat(parse_json(raw)))
    assert_client_error(lambda: validate_completion(parse_json(raw)))


valid_chat_bodies = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant"]),
                    "content": st.text(max_size=4) | st.lists(typed_parts, max_size=3),
                }
            ),
            min_size=1,
            max_size=3,
        )
    },
    optional={
        "n": st.integers(1, 4),
        "best_of": st.integers(1, 4),
        "beam_width": st.integers(1, 4),
        "max_tokens": st.integers(1, 10**7) | st.none(),
        "max_completion_tokens": st.integers(1, 10**7),
        "truncate_prompt_tokens": st.sampled_from([-1, 1, 5, 64, 65]),
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}), max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function"}]),
        "thinking": st.sampled_from([None, {"type": "enabled"}, {"type": "disabled"}, "on", {}]),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "x"]), scalars, max_size=2
        ),
    },
)


# A window of 64 tokens and every prompt 10 tokens long: a room of 54, which the default
# budget (100) does not fit, so the order of "default, then fit" decides what is forwarded.
PROMPT, WINDOW = 10, 64
GATE = counting_gate(PROMPT, WINDOW, max_n=2, default_max_tokens=100, multimodal="on",
                     max_images=2, max_image_bytes=64, allowed_media_hosts=["img.example"])


@settings(max_examples=200, deadline=None)
@given(body=valid_chat_bodies)
def test_the_gate_on_a_valid_body_gives_only_client_errors_and_a_budget_that_fits(
        body: dict[str, Any]) -> None:
    """The real gate, every rule in its own order: a client error, or a body whose budget
    fits the room the prompt leaves."""
    validate_chat(body)  # the strategy makes valid bodies, so every later rule is reached
    forwarded: list[dict[str, Any]] = []
    assert_client_error(lambda: forwarded.append(through(GATE, body, CHAT).payload))
    for payload in forwarded:
        room = WINDOW - effective_prompt_tokens(payload, PROMPT, WINDOW)
        budgets = [payload[name] for name in CHAT_BUDGET if payload.get(name) is not None]
        assert budgets and all(1 <= budget <= room for budget in budgets), payload
