"""The BudgetFitter on its own, over a fake worker: a prompt is counted only when it might not
fit, with the worker route its API counts by, and the budget is clamped to the room left."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.apis.anthropic.api import MESSAGES
from appliance.apis.api import GenerationApi
from appliance.apis.batch.api import BATCH_CHAT
from appliance.apis.openai.api import CHAT, COMPLETION
from appliance.apis.responses.api import RESPONSES_CREATE
from appliance.core.errors import BadRequest
from appliance.core.sections import PolicySettings
from appliance.gate.budget import BudgetFitter
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.anyio
WINDOW = 100


class Worker:
    """The worker's counting routes: a message costs 2 tokens around its content's bytes, a
    conversation 4 more; a raw prompt 1 more than its bytes."""

    def __init__(self, counts: bool = True) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._counts = counts

    async def call(self, method: str, path: str, payload: Any = None,
                   timeout_s: float = 30.0) -> tuple[int, Any]:
        self.calls.append((path, payload))
        if path == "/v1/models":
            return 200, {"data": [{"id": "synthetic", "max_model_len": WINDOW}]}
        if not self._counts:
            return 500, None
        if path == "/tokenize" and "messages" in payload:
            return 200, {"count": 4 + sum(2 + len(m["content"]) for m in payload["messages"])}
        if path == "/tokenize":
            return 200, {"count": 1 + len(payload["prompt"])}
        if path == "/v1/messages/count_tokens":
            return 200, {"input_tokens": 70}
        if path == "/v1/responses/render":
            return 200, {"token_ids": [0] * 60}
        raise AssertionError(path)

    def counted(self) -> list[tuple[str, Any]]:
        """The calls made to count a request's prompt (the per-worker measurement aside)."""
        return self.calls[4:]


def fitter(worker: Worker, engine: FakeEngine | None = None, **policy: Any) -> BudgetFitter:
    return BudgetFitter(worker, engine or FakeEngine("http://127.0.0.1:9"),  # type: ignore[arg-type]
                        PolicySettings(**policy))


async def fit(budget: BudgetFitter, api: GenerationApi, body: dict[str, Any]) -> Any:
    return await budget.fit(api, body, len(json.dumps(body)), defaulted=False, multimodal=False)


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


async def test_a_prompt_that_surely_fits_is_never_counted() -> None:
    worker = Worker()
    fitted = await fit(fitter(worker), CHAT, chat("hi", 5))
    assert fitted.clamp is None and not fitted.counted
    assert worker.counted() == []


async def test_a_chat_that_might_not_fit_is_counted_with_the_template_and_clamped() -> None:
    worker, body = Worker(), chat("x" * 80, 50)
    fitted = await fit(fitter(worker), CHAT, body)
    assert fitted.counted and body["max_tokens"] == WINDOW - (4 + 2 + 80)
    assert worker.counted() == [("/tokenize", {"messages": body["messages"],
                                               "model": "synthetic"})]


async def test_each_api_counts_its_prompt_with_its_own_worker_route() -> None:
    worker = Worker()
    messages = {"model": "m", "messages": [{"role": "user", "content": "x" * 80}],
                "max_tokens": 50}
    await fit(fitter(worker), MESSAGES, messages)
    assert messages["max_tokens"] == WINDOW - 70
    assert worker.counted()[-1][0] == "/v1/messages/count_tokens"
    responses = {"input": "x" * 80, "max_output_tokens": 50}
    await fit(fitter(worker), RESPONSES_CREATE, responses)
    assert responses["max_output_tokens"] == WINDOW - 60
    path, rendered = worker.counted()[-1]
    assert path == "/v1/responses/render" and "max_output_tokens" not in rendered
    completion = {"prompt": ["short", "y" * 80], "max_tokens": 50}
    await fit(fitter(worker), COMPLETION, completion)
    assert completion["max_tokens"] == WINDOW - (1 + 80)
    assert worker.counted()[-1] == ("/tokenize", {"prompt": "y" * 80, "model": "synthetic"})


async def test_a_batch_counts_only_its_conversations_that_might_not_fit() -> None:
    worker = Worker()
    body = {"messages": [[{"role": "user", "content": "hi"}],
                         [{"role": "user", "content": "z" * 80}]], "max_tokens": 50}
    await fit(fitter(worker), BATCH_CHAT, body)
    assert [payload["messages"] for _, payload in worker.counted()] == [body["messages"][1]]
    assert body["max_tokens"] == WINDOW - (4 + 2 + 80)


async def test_a_batch_with_more_long_prompts_than_may_be_counted_is_refused() -> None:
    body = {"prompt": ["y" * 80] * 3, "max_tokens": 50}
    with pytest.raises(BadRequest) as caught:
        await fit(fitter(Worker(), max_counted_prompts=2), COMPLETION, body)
    assert caught.value.code == "too_many_long_prompts" and caught.value.param == "prompt"


async def test_a_worker_that_cannot_count_leaves_the_budget_to_the_engine() -> None:
    body = chat("x" * 80, 50)
    fitted = await fit(fitter(Worker(counts=False)), CHAT, body)
    assert fitted.clamp is None and body["max_tokens"] == 50


async def test_the_templates_cost_is_measured_once_per_worker_process() -> None:
    worker, engine = Worker(), FakeEngine("http://127.0.0.1:9")
    budget = fitter(worker, engine)
    first = await budget.limits()
    await budget.limits()
    assert [path for path, _ in worker.calls].count("/v1/models") == 1
    assert (first.window, first.chat_base, first.chat_per_message, first.prompt_base) == (
        WINDOW, 6, 2, 1)
    engine.pid = 4343  # a new worker: its template may differ
    await budget.limits()
    assert [path for path, _ in worker.calls].count("/v1/models") == 2
