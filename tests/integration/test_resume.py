"""An engine fault costs a request a pause, not an error: on the real vLLM CPU worker (one boot;
each fault restarts it by fork in about 3 s), greedy streams killed mid-way read byte for byte
as uninterrupted ones, and requests the client had nothing of yet are sent again.

Faults: kill -9 of the worker's API server (its connection breaks), kill -9 of EngineCore (the
server answers with its own error event, then exits) and SIGSTOP of EngineCore (a hang: the
supervisor declares it and kills the worker).

Responses and Anthropic streams carry no token ids: they go on from their text, tokenized again
on the new worker (appliance/recovery/text.py), and read as the worker's own uninterrupted
stream but for the ids and times each run draws anew.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from load.kit.appliance import (
    Appliance,
    as_client,
    chat_as,
    running_with_clients,
)
from load.kit.stream_events import normalized

STORY = [{"role": "user", "content": "Write a story about a lighthouse keeper and a storm."}]
PROMPT = "The lighthouse keeper climbed the stairs and"
Event = dict[str, Any]


@pytest.fixture(scope="module")
def model(appliance: Appliance) -> str:
    return str(httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"][0]["id"])


def kill_server(appliance: Appliance) -> None:
    os.kill(appliance.worker_pid(), signal.SIGKILL)


def engine_core(appliance: Appliance) -> psutil.Process:
    children = psutil.Process(appliance.worker_pid()).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name())


def kill_engine_core(appliance: Appliance) -> None:
    engine_core(appliance).send_signal(signal.SIGKILL)


def freeze_engine_core(appliance: Appliance) -> None:
    engine_core(appliance).send_signal(signal.SIGSTOP)


def read_stream(appliance: Appliance, path: str, body: dict[str, Any], events: list[Event | str],
                fault: Callable[[], None] | None = None, after: int = 0,
                headers: dict[str, str] | None = None) -> int:
    """The stream's data lines, decoded, into `events`; `fault` strikes once `after` of them
    carried text. Returns the status."""
    struck = fault is None
    with httpx.stream("POST", f"{appliance.url}{path}", json=body, timeout=300,
                      headers=headers) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
            if not struck and sum(1 for e in events if text_of(e)) >= after:
                struck = True
                assert fault is not None
                fault()
        return response.status_code


def text_of(event: Event | str) -> str:
    """An event's text, in whichever protocol: chat, completions, Responses, Anthropic."""
    if not isinstance(event, dict):
        return ""
    if event.get("type") == "response.output_text.delta":
        return str(event["delta"])
    if event.get("type") == "content_block_delta":
        return str(event["delta"].get("text") or "")
    if not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def faulted_and_plain(appliance: Appliance, path: str, body: dict[str, Any],
                      fault: Callable[[], None], headers: dict[str, str] | None = None
                      ) -> tuple[list[Event | str], list[Event | str]]:
    """The same greedy stream twice: with a fault after 10 events with text, then without."""
    old = appliance.worker_pid()
    faulted: list[Event | str] = []
    assert read_stream(appliance, path, body, faulted, fault, after=10, headers=headers) == 200
    events = [(e.get("event"), e.get("cause") or e.get("how") or e.get("error"))
              for e in appliance.log_events()
              if str(e.get("event")).startswith(("engine.", "request.engine", "request.out"))]
    assert appliance.wait_ready()["pid"] != old, (faulted[-3:], events[-8:])
    plain: list[Event | str] = []
    assert read_stream(appliance, path, body, plain, headers=headers) == 200
    return faulted, plain


def assert_seamless(faulted: list[Event | str], plain: list[Event | str]) -> None:
    """One id, one `created`, the same text, ending and usage, every event shaped as vLLM
    shapes it: the client cannot tell that the engine died."""
    assert not [e for e in faulted if isinstance(e, dict) and "error" in e], faulted
    assert faulted[-1] == "[DONE]"
    bodies = [e for e in faulted if isinstance(e, dict)]
    assert len({e["id"] for e in bodies}) == 1 and len({e["created"] for e in bodies}) == 1
    assert "".join(map(text_of, faulted)) == "".join(map(text_of, plain))
    roles = [e for e in bodies if e["choices"] and "role" in e["choices"][0].get("delta", {})]
    assert len(roles) <= 1
    finish = [e["choices"][0]["finish_reason"] for e in bodies
              if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish == [e["choices"][0]["finish_reason"] for e in plain
                      if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]]
    usage = [e["usage"] for e in bodies if e.get("usage")]
    assert usage == [e["usage"] for e in plain if isinstance(e, dict) and e.get("usage")]
    assert token_ids(plain) and token_ids(faulted) == token_ids(plain)  # once each, as unbroken
    shapes = {tuple(e) for e in bodies} | {tuple(e["choices"][0]) for e in bodies if e["choices"]}
    assert shapes == ({tuple(e) for e in plain if isinstance(e, dict)}
                      | {tuple(e["choices"][0]) for e in plain
                         if isinstance(e, dict) and e["choices"]})


def token_ids(events: list[Event | str]) -> list[int]:
    """The generated token ids a chat or completions stream showed its client, in order."""
    return [i for e in events if isinstance(e, dict) and e.get("choices")
            for i in e["choices"][0].get("token_ids") or []]


def outlived(appliance: Appliance, how: str) -> int:
    return sum(1 for e in appliance.log_events()
               if e.get("event") == "request.outlived_engine_fault" and e.get("how") == how)


def test_a_greedy_chat_stream_killed_mid_way_reads_as_an_uninterrupted_one(
        appliance: Appliance) -> None:
    body = {"messages": STORY, "max_tokens": 60, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    before = outlived(appliance, "resumed")
    faulted, plain = faulted_and_plain(appliance, "/v1/chat/completions", body,
                                       lambda: kill_server(appliance))
    assert_seamless(faulted, plain)
    assert outlived(appliance, "resumed") == before + 1


def test_a_completions_stream_outlives_its_engine_core(appliance: Appliance) -> None:
    """EngineCore killed: vLLM's server ends the stream with its own error event, then exits;
    the client sees neither."""
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
    faulted, plain = faulted_and_plain(appliance, "/v1/completions", body,
                                       lambda: kill_engine_core(appliance))
    assert_seamless(faulted, plain)


def test_a_chat_stream_outlives_a_frozen_engine_core(appliance: Appliance) -> None:
    """A hang: the supervisor declares it, kills the worker, and the stream goes on."""
    body = {"messages": STORY, "max_tokens": 40, "temperature": 0, "stream": True}
    faulted, plain = faulted_and_plain(appliance, "/v1/chat/completions", body,
                                       lambda: freeze_engine_core(appliance))
    assert_seamless(faulted, plain)


def answer_with_a_kill(appliance: Appliance, path: str, body: dict[str, Any]) -> httpx.Response:
    """A non-streamed request whose worker is killed once the engine is generating for it."""
    old = appliance.worker_pid()
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{appliance.url}{path}", json=body, timeout=300)))
    sender.start()
    while appliance.engine_stats().running < 1:
        assert sender.is_alive(), f"answered before the kill: {answers and answers[0].text}"
        time.sleep(0.05)
    kill_server(appliance)
    sender.join(300)
    assert appliance.wait_ready()["pid"] != old
    return answers[0]


@pytest.mark.parametrize(("path", "body", "text"), [
    ("/v1/chat/completions", {"messages": STORY, "max_tokens": 64, "temperature": 0},
     lambda a: a["choices"][0]["message"]["content"]),
    ("/v1/responses", {"input": "Write a story about a storm.", "max_output_tokens": 64,
                       "temperature": 0}, lambda a: a["output"][-1]["content"][0]["text"]),
    ("/v1/messages", {"messages": STORY, "max_tokens": 64, "temperature": 0},
     lambda a: a["content"][0]["text"]),
])
def test_a_request_the_client_had_nothing_of_is_sent_again_on_every_route(
        appliance: Appliance, model: str, path: str, body: dict[str, Any],
        text: Callable[[dict[str, Any]], str]) -> None:
    before = outlived(appliance, "replayed")
    body = body | {"model": model}
    faulted = answer_with_a_kill(appliance, path, body)
    assert faulted.status_code == 200, faulted.text
    plain = httpx.post(f"{appliance.url}{path}", json=body, timeout=300)
    assert text(faulted.json()) == text(plain.json()) and text(plain.json())
    assert outlived(appliance, "replayed") == before + 1


def test_a_greedy_responses_stream_killed_mid_way_reads_as_an_uninterrupted_one(
        appliance: Appliance, model: str) -> None:
    """Every event as the worker would have written it: the same item, sequence numbers on
    from the last, the same text and end, status and usage of the whole answer."""
    body = {"model": model, "input": "Write a story about a storm.", "max_output_tokens": 60,
            "temperature": 0, "stream": True}
    before = outlived(appliance, "resumed")
    faulted, plain = faulted_and_plain(appliance, "/v1/responses", body,
                                       lambda: kill_server(appliance))
    assert [e["sequence_number"] for e in faulted if isinstance(e, dict)] == list(
        range(len(faulted)))
    assert "".join(map(text_of, faulted)) == "".join(map(text_of, plain))
    assert normalized(faulted, {}) == normalized(plain, {})
    assert outlived(appliance, "resumed") == before + 1
    # The response was stored by the worker that was lost: its id is gone with it.
    response_id = faulted[0]["response"]["id"] if isinstance(faulted[0], dict) else ""
    lost = httpx.get(f"{appliance.url}/v1/responses/{response_id}", timeout=30)
    assert lost.status_code == 404 and lost.json()["error"]["code"] == "response_lost_in_restart"


def test_a_messages_stream_outlives_its_engine_core(appliance: Appliance, model: str) -> None:
    """EngineCore killed: vLLM's Anthropic stream writes its own internal_error event, then its
    server exits; the client sees neither, and one message to its normal end."""
    body = {"model": model, "messages": STORY, "max_tokens": 60, "temperature": 0,
            "stream": True}
    faulted, plain = faulted_and_plain(appliance, "/v1/messages", body,
                                       lambda: kill_engine_core(appliance))
    assert not [e for e in faulted if isinstance(e, dict) and e.get("type") == "error"]
    assert "".join(map(text_of, faulted)) == "".join(map(text_of, plain))
    assert normalized(faulted, {}) == normalized(plain, {})


# --- a resumed stream keeps its request's terms ---------------------------------------------
# vLLM's completions route, where every continuation goes, takes 16 tokens when given no
# budget. A chat request sent without one (and no policy.default_max_tokens) has the room its
# prompt leaves in the window: a short window keeps that room, and these runs, short.
SHORT_WINDOW = 128
TERMS_CLIENTS: list[dict[str, object]] = [
    {"name": "plain", "key": "sk-plain"},
    # Above the prompt of STORY (41 tokens): a stream it is charged for past this used more.
    {"name": "metered", "key": "sk-metered", "tokens_per_minute": 50},
]


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_with_clients(Path(tmp_path_factory.mktemp("terms")), TERMS_CLIENTS,
                              supervisor__crash_loop_restarts="100",
                              engine__max_model_len=str(SHORT_WINDOW)) as running:
        yield running


def test_a_chat_stream_sent_without_a_budget_goes_on_to_the_end_of_its_room(
        short: Appliance) -> None:
    """The continuation carries what is left of the room, not the completions route's 16."""
    body = {"messages": STORY, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    faulted, plain = faulted_and_plain(short, "/v1/chat/completions", body,
                                       lambda: kill_server(short), headers=as_client("plain"))
    assert len(token_ids(plain)) > 10 + 16 + 30  # far past the seam and its 16
    assert_seamless(faulted, plain)


def test_a_metered_stream_killed_mid_way_is_charged_what_it_generated(short: Appliance) -> None:
    """min_tokens above 16 and no budget: a continuation sent with neither its budget nor its
    minimum less what came is refused by the worker, and the request used to go uncharged."""
    body = {"messages": STORY, "min_tokens": 72, "temperature": 0, "stream": True}
    old = short.worker_pid()
    events: list[Event | str] = []
    assert read_stream(short, "/v1/chat/completions", body, events, lambda: kill_server(short),
                       after=30, headers=as_client("metered")) == 200
    assert short.wait_ready()["pid"] != old
    # The prompt and at least the 30 tokens before the seam, past its 50 tokens a minute: its
    # next request waits for the refill (whether or not the continuation went through).
    after = chat_as(short, "metered", {"messages": STORY, "max_tokens": 1})
    assert after.status_code == 429, after.text
    assert after.json()["error"]["code"] == "client_tokens_per_minute"
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    assert len("".join(map(text_of, events))) > 0 and events[-1] == "[DONE]"
