"""A resumed stream keeps its request's terms, through the relay over fake workers: the
continuation carries what is left of the budget the request resolved to (vLLM's completions
route, where every continuation goes, would otherwise stop 16 tokens after the seam), and what
the lost worker generated before the seam is charged to the client even when the next worker
refuses the continuation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.admission.clients import Client
from appliance.apis.anthropic.api import MESSAGES
from appliance.apis.openai.api import CHAT
from appliance.apis.responses.api import RESPONSES_CREATE
from appliance.core.errors import TooManyRequests
from appliance.core.settings import Settings
from appliance.gate.gate import Vetted
from tests.unit.appliance.apis import test_anthropic_resume as anthropic
from tests.unit.appliance.apis import test_responses_resume as responses
from tests.unit.appliance.apis.test_openai_resume import ROLE_IDS, content
from tests.unit.appliance.fakes import FakeEngine
from tests.unit.appliance.recovery.test_text import GREEDY, PROMPT, Worker
from tests.unit.appliance.test_relay import Broken, Preparing, Reply, Setup

pytestmark = pytest.mark.anyio

# One token a minute: the Retry-After of the client's next request is 60 s per token charged.
METERED = Client("metered", tokens_per_minute=1)
# vLLM's refusal of the continuation the finding saw (its completions route's default budget).
REFUSED = (b'{"error":{"message":"min_tokens must be less than or equal to max_tokens=16.",'
           b'"type":"BadRequestError","param":null,"code":400}}')
CHAT_BODY = {"messages": [{"role": "user", "content": "Write a story."}], "min_tokens": 120,
             "temperature": 0, "stream": True}
CHAT_SENT = [ROLE_IDS, content("Once", b"7454"), content(" upon", b"2402")]


def vetted(api: Any, body: dict[str, Any]) -> Vetted:
    out = Vetted(api, dict(body), json.dumps(body).encode(), client=METERED)
    out.record = api.stream_record(out.payload, Settings())
    return out


async def charged(setup: Setup) -> int:
    """The tokens the client was charged, read from its next request's refusal."""
    with pytest.raises(TooManyRequests) as refused:
        async with setup.admission.slot(METERED):
            pass
    assert refused.value.code == "client_tokens_per_minute"
    assert refused.value.retry_after_s is not None
    return refused.value.retry_after_s // 60


async def test_a_chat_stream_without_a_budget_continues_with_the_rest_of_the_one_it_had() -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    asked = Worker([1, 9690, 198], GREEDY | {"max_tokens": 300}, tokens=[])
    rest = Reply(200, [content("", b"2", finish="stop"), b"data: [DONE]\n\n"])
    setup = Setup(Preparing(engine, asked, Broken(CHAT_SENT, good=3), rest), resume=True,
                  engine=engine)
    await setup.run(vetted(CHAT, CHAT_BODY))
    assert [path for path, _ in asked.asked] == ["/v1/chat/completions/render"]
    (_, path, body) = setup.worker.sent[1]
    continued = json.loads(body or b"")
    assert path == "/v1/completions" and continued["prompt"] == [1, 9690, 198, 7454, 2402]
    assert (continued["max_tokens"], continued["min_tokens"]) == (298, 118)


async def test_a_chat_stream_whose_continuation_is_refused_is_charged_what_came_before() -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    asked = Worker([1, 9690, 198], GREEDY | {"max_tokens": 300}, tokens=[])
    setup = Setup(Preparing(engine, asked, Broken(CHAT_SENT, good=3), Reply(400, [REFUSED])),
                  resume=True, engine=engine)
    request = vetted(CHAT, CHAT_BODY)
    await setup.run(request)
    assert b'"error"' in setup.client.body and setup.client.body.endswith(b"data: [DONE]\n\n")
    # The prompt (estimated from the body's bytes: the fake gate counted none) and the three
    # events the lost worker generated.
    assert await charged(setup) == len(request.raw) // 4 + 3


async def test_a_responses_stream_whose_continuation_is_refused_is_charged_what_came_before(
) -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    asked = Worker(PROMPT, GREEDY, tokens=[7] * 10)
    setup = Setup(Preparing(engine, asked, Broken(responses.STREAM[:14], good=14),
                            Reply(400, [REFUSED])), resume=True, engine=engine)
    request = vetted(RESPONSES_CREATE, responses.BODY)
    await setup.run(request)
    assert b"event: response.failed" in setup.client.body
    assert await charged(setup) == len(request.raw) // 4 + 14  # 4 head events, 10 deltas


async def test_an_anthropic_stream_whose_continuation_is_refused_is_charged_what_came_before(
) -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    asked = Worker(anthropic.PROMPT, GREEDY, tokens=[7] * 10)
    setup = Setup(Preparing(engine, asked, Broken(anthropic.STREAM[:12], good=12),
                            Reply(400, [REFUSED])), resume=True, engine=engine)
    await setup.run(vetted(MESSAGES, anthropic.BODY))
    assert b"event: error" in setup.client.body
    # message_start reported the prompt's 41 tokens; 12 events came before the seam.
    assert await charged(setup) == 41 + 12
