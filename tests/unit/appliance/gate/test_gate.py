"""The gate's bounds on the work one body can cause."""

from __future__ import annotations

import json

import pytest

from appliance.apis.openai.api import CHAT
from appliance.core.errors import BadRequest
from appliance.core.settings import Settings
from appliance.gate.gate import Gate


def gate(**policy: object) -> Gate:
    return Gate(Settings(policy=policy), None)  # type: ignore[arg-type]  # no budget fitting here


def chat(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"messages": messages, "max_tokens": 4}).encode()


def test_a_conversation_over_max_messages_is_refused_naming_messages() -> None:
    body = chat([{"role": "user", "content": "x"}] * 11)
    with pytest.raises(BadRequest) as caught:
        gate(max_messages=10).vet_now(body, CHAT)
    assert (caught.value.param, caught.value.code) == ("messages", "too_many_messages")


def test_the_word_role_inside_a_message_is_not_counted_as_a_message() -> None:
    """The raw pre-count reads `"role"` keys; inside a JSON string the quotes are escaped."""
    text = 'say "role" and {"role": "user"} ' * 50
    vetted = gate(max_messages=2).vet_now(chat([{"role": "user", "content": text}]), CHAT)
    assert vetted.payload["messages"][0]["content"] == text


def test_at_max_messages_the_conversation_passes() -> None:
    body = chat([{"role": "user", "content": "x"}] * 10)
    assert len(gate(max_messages=10).vet_now(body, CHAT).payload["messages"]) == 10


NESTED = {"structured_outputs": {"regex": "(a+)+"}}


def test_an_output_constraint_is_vetted_at_the_gate_and_per_client() -> None:
    from appliance.admission.clients import Client

    body = json.dumps({"messages": [{"role": "user", "content": "x"}]} | NESTED).encode()
    with pytest.raises(BadRequest) as caught:
        gate().vet_now(body, CHAT)
    assert caught.value.param == "structured_outputs.regex"
    plain = json.dumps({"messages": [{"role": "user", "content": "x"}],
                        "structured_outputs": {"choice": ["a", "b"]}}).encode()
    vetted = gate().vet_now(plain, CHAT)
    assert vetted.payload["structured_outputs"]["choice"] == ["a", "b"]
    # The cost watch follows it by the parameter the gate found (no second search per request).
    assert vetted.constraint == "structured_outputs.choice"
    assert gate().vet_now(chat([{"role": "user", "content": "x"}]), CHAT).constraint is None
    with pytest.raises(BadRequest) as refused:
        gate().vet_now(plain, CHAT, Client("strict", output_constraints=False))
    assert refused.value.code == "constraints_not_allowed"


def test_a_resumable_stream_asks_for_its_token_ids_without_a_reencode() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}\n'
    vetted = gate().vet_now(raw, CHAT)
    assert vetted.record is not None and not vetted.changed
    sent = vetted.body()
    assert sent.startswith(raw.rstrip()[:-1])  # the client's bytes, as sent
    assert json.loads(sent) == json.loads(raw) | {"return_token_ids": True}
    plain = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert gate().vet_now(plain, CHAT).body() == plain  # not streamed: nothing to keep
    asked = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, ' \
            b'"return_token_ids": true}'
    visible = gate().vet_now(asked, CHAT)
    assert visible.body() == asked and visible.record is not None
    declined = asked.replace(b"true}", b"false}")
    vetted = gate().vet_now(declined, CHAT)  # the stream sends the ids on: one that says no
    assert vetted.body() == declined and vetted.record is None  # is not kept to be resumed
    off = Gate(Settings(resume={"enabled": False}), None)  # type: ignore[arg-type]
    assert off.vet_now(raw, CHAT).body() == raw
