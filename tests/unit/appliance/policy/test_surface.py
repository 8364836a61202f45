"""The rules of the routes beyond chat and completions, as pure functions: shape checks, where
their media parts are, their own rules, how their errors are written, the response-id map."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.answers.shape import StreamSoFar
from appliance.apis.anthropic.api import ANTHROPIC, MESSAGES, anthropic_type
from appliance.apis.responses.api import RESPONSES, RESPONSES_CREATE
from appliance.apis.responses.response_ids import ResponseIds
from appliance.apis.tokenizer.api import TOKENIZE
from appliance.core.errors import BadRequest, EngineUnavailable, NotFound, UpstreamError
from appliance.core.settings import Settings
from appliance.policy import check_media, surface
from appliance.policy.media import find_anthropic_media, find_batch_media_parts, find_responses_media
from tests.unit.appliance.fakes import FakeEngine

HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"name": "now", "input_schema": {"type": "object"}}]


def refused(call: Any, *args: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call(*args)
    return caught.value


def test_messages_require_max_tokens_as_anthropic_does() -> None:
    assert refused(surface.validate_messages, {"messages": HI}).param == "max_tokens"
    assert refused(surface.validate_messages, {"messages": HI, "max_tokens": 0}).param == \
        "max_tokens"
    surface.validate_messages({"messages": HI, "max_tokens": 1})


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"text": "x"}]}], "messages[0].content[0]"),
])
def test_anthropic_messages_are_checked_naming_the_field(messages: list[Any], param: str) -> None:
    assert refused(surface.validate_count_tokens, {"messages": messages}).param == param


def test_responses_need_an_input_and_a_counted_budget() -> None:
    assert refused(surface.validate_responses, {"model": "m"}).param == "input"
    assert refused(surface.validate_responses, {"input": "x", "max_output_tokens": -1}).param \
        == "max_output_tokens"
    surface.validate_responses({"input": [{"role": "user", "content": "x"}]})


def test_a_batch_names_the_conversation_of_a_bad_message() -> None:
    error = refused(surface.validate_batch_chat, {"messages": [HI, [{"role": "x"}]]})
    assert error.param == "messages[1][0].role" and "'messages[1][0].role'" in error.message
    assert refused(surface.validate_batch_chat, {"messages": []}).param == "messages"


def test_tokenize_takes_a_prompt_or_messages_and_detokenize_token_ids() -> None:
    surface.validate_tokenize({"prompt": "x"})
    surface.validate_tokenize({"messages": HI})
    assert refused(surface.validate_tokenize, {}).param == "prompt"
    for tokens in (None, [-1], [True], ["1"]):
        assert refused(surface.validate_detokenize, {"tokens": tokens}).param == "tokens"


def test_media_is_found_where_each_protocol_puts_it() -> None:
    responses = {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "x"},
                                     {"type": "input_image", "image_url": "https://h/x.png"},
                                     {"type": "input_file", "file_data": "abc"}]},
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_image", "file_id": "f"}]}]}
    assert [(p.param, p.kind, p.source) for p in find_responses_media(responses)] == [
        ("input[0].content[1]", "image", "https://h/x.png"),
        ("input[0].content[2]", "file", None), ("input[0].content[2]", "file", None),
        ("input[1].output[0]", "image", None)]
    given_whole = {"input": "x", "previous_input_messages": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://10.0.0.1/a"},
                                     {"type": "prompt_embeds", "data": "tensor"}]}]}
    assert [(p.param, p.kind) for p in find_responses_media(given_whole)] == [
        ("previous_input_messages[0].content[0]", "image"),
        ("previous_input_messages[0].content[1]", "embeds")]
    anthropic = {"system": [{"type": "text", "text": "s"}], "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
        {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/a.png"}},
        {"type": "document", "source": {"type": "text", "data": "x"}},
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}]}
    assert [(p.param, p.kind, p.source) for p in find_anthropic_media(anthropic)] == [
        ("messages[0].content[0]", "image", "data:image/png;base64,AA=="),
        ("messages[0].content[1]", "image", "http://10.0.0.1/a.png"),
        ("messages[0].content[2]", "file", None),
        ("messages[0].content[3].content[0]", "image", None)]
    batch = {"messages": [HI, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]]}
    assert [p.param for p in find_batch_media_parts(batch)] == ["messages[1][0].content[0]"]


def test_an_anthropic_remote_image_gets_the_same_ssrf_rule() -> None:
    parts = find_anthropic_media({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://192.168.1.1/a.png"}}]}]})
    error = refused(lambda: check_media(parts, multimodal=True, max_images=4,
                                        max_image_bytes=1024, allowed_hosts=["images.example"]))
    assert error.code == "media_url_refused" and error.param == "messages[0].content[0]"


def test_anthropic_tools_need_a_parser_unless_the_choice_needs_none() -> None:
    settings = Settings()
    assert refused(MESSAGES.adjust, {"messages": HI, "tools": TOOLS}, settings).param == \
        "tool_choice"
    for choice in ("any", "none", "tool"):
        MESSAGES.adjust({"messages": HI, "tools": TOOLS,
                         "tool_choice": {"type": choice, "name": "now"}}, settings)
    parsed = Settings(engine={"tool_call_parser": "hermes"})
    assert MESSAGES.adjust({"messages": HI, "tools": TOOLS}, parsed) is False


def test_template_defaults_reach_anthropic_and_responses_but_their_thinking_stays() -> None:
    settings = Settings(policy={"default_chat_template_kwargs": {"enable_thinking": False},
                                "disable_thinking_with_tools": True},
                        engine={"tool_call_parser": "hermes"})
    body: dict[str, Any] = {"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048},
                            "chat_template_kwargs": {"x": 1}}
    assert MESSAGES.adjust(body, settings) is True
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}  # vLLM's to read
    chosen: dict[str, Any] = {"input": "x", "tools": [{"type": "function", "name": "f"}],
                              "chat_template_kwargs": {"enable_thinking": True},
                              "reasoning": {"effort": "low"}}
    RESPONSES_CREATE.adjust(chosen, settings)
    assert chosen["chat_template_kwargs"] == {"enable_thinking": True}
    assert chosen["reasoning"] == {"effort": "low"}
    tokenize: dict[str, Any] = {"messages": HI}
    assert TOKENIZE.adjust(tokenize, settings) is True
    assert tokenize["chat_template_kwargs"] == {"enable_thinking": False}


def test_responses_get_an_id_unless_the_client_named_one() -> None:
    body: dict[str, Any] = {"input": "x"}
    assert RESPONSES_CREATE.adjust(body, Settings()) is True
    assert body["request_id"].startswith("resp_") and len(body["request_id"]) == 37
    named: dict[str, Any] = {"input": "x", "request_id": "mine"}
    assert RESPONSES_CREATE.adjust(named, Settings()) is False and named["request_id"] == "mine"


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
    (415, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
    (502, "api_error"), (503, "overloaded_error"),
])
def test_anthropic_error_types_follow_the_status(status: int, kind: str) -> None:
    assert anthropic_type(status) == kind
    error = UpstreamError(status, "no", param=None, code=None)
    assert ANTHROPIC.body(error, "rid") == {"type": "error", "error": {"type": kind,
                                                                       "message": "no"}} | (
        {"request_id": "rid"} if status == 500 else {})


def test_a_responses_stream_ends_after_the_last_sequence_number_the_client_saw() -> None:
    so_far = StreamSoFar({"request_id": "resp_1", "model": "m"},
                         last=b'event: x\ndata: {"type":"x","sequence_number":7}\n\nevent: x\ndata: {"typ',
                         before_last=b'event: response.created\ndata: {"sequence_number":0}\n\n')
    ending = RESPONSES.stream_end(EngineUnavailable("gone", code="engine_lost"), so_far)
    events = [block.split("\n") for block in ending.decode().strip().split("\n\n")]
    assert [lines[0] for lines in events] == ["event: error", "event: response.failed"]
    error, failed = (json.loads(lines[1].removeprefix("data: ")) for lines in events)
    assert error == {"type": "error", "code": "engine_lost", "message": "gone", "param": None,
                     "sequence_number": 8}
    assert failed["sequence_number"] == 9 and failed["response"]["id"] == "resp_1"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "gone"}


def test_an_anthropic_stream_ends_with_an_error_event() -> None:
    ending = ANTHROPIC.stream_end(EngineUnavailable("gone"), StreamSoFar({}))
    assert ending == (b'event: error\ndata: {"type":"error","error":'
                      b'{"type":"overloaded_error","message":"gone"}}\n\n')


def test_response_ids_say_which_worker_lost_them_and_forget_the_oldest() -> None:
    engine = FakeEngine("http://x", pid=1)
    ids = ResponseIds(engine, capacity=2)
    for response_id in ("a", "b", "c"):
        ids.created(response_id, "app", stored=True)
    assert len(ids) == 2
    worker_404 = UpstreamError(404, "Response with id 'b' not found.", param=None, code=None)
    same_worker = ids.explain(worker_404, "b", "response_id")
    assert isinstance(same_worker, NotFound) and same_worker.code == "response_not_found"
    engine.pid = 2
    lost = ids.explain(worker_404, "b", "response_id")
    assert lost.code == "response_lost_in_restart" and "pid 1" in lost.message
    assert ids.explain(worker_404, "a", "response_id").code == "response_not_found"  # forgotten
    other = UpstreamError(400, "no", param=None, code=None)
    assert ids.explain(other, "b", "response_id") is other
