"""Output constraints on the real vLLM worker: an ordinary one is compiled and obeyed, a costly
one (nested quantifiers, whichever field carries it) is refused before the engine sees it, and
a client refused constraints gets 400 for any. The slowdown itself is measured side by side
by load/hostile/constraint_cost.py."""

from __future__ import annotations

import re

import httpx
import pytest

from load.kit.appliance import Appliance, chat_as

HI = [{"role": "user", "content": "Give a phone number."}]


@pytest.fixture(scope="module")
def worker(clients_appliance: Appliance) -> Appliance:
    """The shared appliance with the named clients: `free` may send constraints, `plain` not."""
    return clients_appliance


def chat(appliance: Appliance, who: str, **body: object) -> httpx.Response:
    return chat_as(appliance, who, {"messages": HI, "max_tokens": 16} | body)


def engine_generated(appliance: Appliance) -> float:
    text = appliance.engine_get("/metrics", timeout_s=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_an_ordinary_regex_is_compiled_and_obeyed(worker: Appliance) -> None:
    answer = chat(worker, "free", structured_outputs={"regex": r"[0-9]{3}-[0-9]{4}"})
    assert answer.status_code == 200, answer.text
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", answer.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": r"(a+)+(b+)+$"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": r"(\w+\s?)*$"}}}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"grammar": 'root ::= (item ",")*\nitem ::= [a-z]+'}},
     "structured_outputs.grammar"),
])
def test_a_costly_constraint_is_refused_before_the_engine_works(
        worker: Appliance, body: dict[str, object], param: str) -> None:
    served = engine_generated(worker)
    refused = chat(worker, "free", **body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and error["code"] == "constraint_too_complex"
    assert engine_generated(worker) == served


def test_a_client_refused_constraints_gets_400_for_an_ordinary_one(worker: Appliance) -> None:
    refused = chat(worker, "plain", structured_outputs={"choice": ["yes", "no"]})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "constraints_not_allowed"
    assert chat(worker, "plain").status_code == 200
