"""Nobody fakes a fault, on the real vLLM CPU worker: a client's words or mistakes never restart
the engine. An engine fault is the supervisor's fact (an exit, failed probes, a hang verdict
from the engine's own progress); text in a stream is never one, and a request vLLM refuses is
that request's 4xx, streamed or not.

The real deaths these must not hide are test_resume's (kill -9 of the server and of EngineCore,
SIGSTOP of EngineCore, each resumed byte for byte) and test_quarantine's (a poison input).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from appliance.fences.vllm import ANTHROPIC_ENGINE_DEAD, ENGINE_DEAD_MESSAGE
from load.kit.appliance import Appliance

# vLLM's own words for a dead engine core, and its Anthropic converter's, as a client may quote
# them (a support ticket that pastes a log, or a hostile client).
DEATH = f"{ENGINE_DEAD_MESSAGE}. See stack trace (above) for the root cause."
WORDS = [DEATH, ANTHROPIC_ENGINE_DEAD + "ngineCore', 'code': 500}}", f'{{"error": {{"message": '
         f'"{DEATH}", "type": "InternalServerError", "param": null, "code": 500}}}}']


def echoing_bodies(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Requests whose answer carries the client's own text back, holding the death's words: in
    Responses' echoed instructions, a completion's echoed prompt, a tool's name and arguments, a
    stop string (vLLM names the one that matched), through every generation route."""
    chat = [{"role": "user", "content": "Say hi."}]
    bodies: list[tuple[str, dict[str, Any]]] = []
    for words in WORDS:
        tool = {"type": "function", "function": {
            "name": "EngineCore_encountered_an_issue", "description": words,
            "parameters": {"type": "object", "properties": {"why": {"type": "string",
                                                                       "description": words}}}}}
        for stream in (True, False):
            bodies += [
                ("/v1/responses", {"input": "Say hi.", "instructions": words, "stream": stream,
                                   "max_output_tokens": 2}),
                ("/v1/completions", {"prompt": words, "echo": True, "stream": stream,
                                     "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                          "tools": [tool], "tool_choice": "none",
                                          "stream": stream, "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": chat, "stop": [words, "!"],
                                          "stream": stream, "max_tokens": 3}),
                ("/v1/messages", {"messages": [{"role": "user", "content": words}],
                                  "system": words, "stream": stream, "max_tokens": 2}),
            ]
        bodies += [
            ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": words}]],
                                            "max_tokens": 2}),
            ("/invocations", {"prompt": words, "echo": True, "max_tokens": 2}),
        ]
    return [(path, body | {"model": model}) for path, body in bodies]


def restarts(appliance: Appliance) -> tuple[int, int]:
    detail = appliance.health().json()
    return int(detail["restarts"]), int(detail["pid"])


def test_fifty_requests_echoing_the_engines_death_restart_nothing(appliance: Appliance) -> None:
    """50 requests whose streams and bodies hold vLLM's death message: every one answered 200,
    the engine's restart counter and worker unchanged, no request held as a suspect."""
    model = str(httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"][0]["id"])
    before = restarts(appliance)
    bodies = echoing_bodies(model)
    sent = 0
    while sent < 50:
        path, body = bodies[sent % len(bodies)]
        response = httpx.post(f"{appliance.url}{path}", json=body, timeout=120)
        assert response.status_code == 200, (path, body, response.text[-500:])
        if body.get("stream"):
            assert '"error"' not in response.text.replace(DEATH, ""), (path, response.text[-500:])
        sent += 1
    assert restarts(appliance) == before
    suspected = [e for e in appliance.log_events()
                 if e.get("event") in ("request.engine_fault", "request.failed_on_serving_engine")]
    assert suspected == []


def refusals(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Requests vLLM refuses only once its stream began (or fails as its own 500): each route
    that can carry them, streamed and not."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    grammar = {"structured_outputs": {"grammar": "root ::= root"}}
    cases: list[tuple[str, dict[str, Any]]] = []
    for stream in (True, False):
        cases += [
            ("/v1/chat/completions", chat | grammar | {"stream": stream}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": stream} | grammar),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": stream} | grammar),
            ("/v1/chat/completions", chat | {"stream": stream,
                                             "structured_outputs": {"choice": []}}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": stream,
                               "logit_bias": {"-1": 1}}),
            ("/v1/chat/completions", chat | {"stream": stream, "logit_bias": {"49152": 5}}),
        ]
    cases += [("/v1/chat/completions/batch", {"messages": [chat["messages"]], "max_tokens": 3}
               | grammar),
              ("/invocations", {"prompt": "hi", "max_tokens": 3} | grammar)]
    return [(path, body | {"model": model}) for path, body in cases]


def test_a_request_vllm_refuses_is_a_4xx_on_every_route_and_restarts_nothing(
        appliance: Appliance) -> None:
    """An impossible grammar, an empty choice list, a logit_bias outside the vocabulary: a 400
    naming the field on every route, streamed or not, and the engine untouched."""
    model = str(httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"][0]["id"])
    before = restarts(appliance)
    for path, body in refusals(model):
        response = httpx.post(f"{appliance.url}{path}", json=body, timeout=120)
        assert response.status_code == 400, (path, body, response.text[-500:])
        assert response.json()["error"]["param"], response.text
    assert restarts(appliance) == before


def test_a_responses_stream_vllm_cuts_for_its_own_refusal_ends_with_that_refusal(
        appliance: Appliance) -> None:
    """What the gate does not check itself (a pattern vLLM's grammar compiler refuses): vLLM
    cuts the Responses stream after its first events; the client's stream ends with the
    protocol's error events carrying vLLM's reason as a 400's, and the engine is not restarted."""
    model = str(httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"][0]["id"])
    before = restarts(appliance)
    schema = {"type": "string", "pattern": "(("}
    body = {"model": model, "input": "hi", "stream": True, "max_output_tokens": 3,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    with httpx.stream("POST", f"{appliance.url}/v1/responses", json=body, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert events[-2]["code"] == "invalid_request" and "Grammar error" in events[-2]["message"]
    assert restarts(appliance) == before


def test_a_messages_stream_whose_refusal_vllm_garbles_ends_with_its_reason(
        appliance: Appliance) -> None:
    """vLLM's Anthropic stream turns its own 400 into an internal_error quoting an excerpt:
    the client's stream ends with Anthropic's invalid_request_error carrying vLLM's reason."""
    model = str(httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"][0]["id"])
    before = restarts(appliance)
    schema = {"type": "string", "pattern": "(("}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 3, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    with httpx.stream("POST", f"{appliance.url}/v1/messages", json=body, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1]["type"] == "error", events
    assert events[-1]["error"]["type"] == "invalid_request_error", events[-1]
    assert "Grammar error" in events[-1]["error"]["message"]
    assert restarts(appliance) == before
