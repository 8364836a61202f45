"""Every rule of the gate holds per model: two models whose windows, modalities, vocabularies and
parsers differ sit behind one appliance, and each request is vetted with the settings of the
model it names, refused in its route's error shape before any worker is asked."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.app import create_app
from appliance.core.catalog import Catalog
from appliance.core.settings import Settings, load_settings
from load.kit.net import free_port
from load.kit.synthetic_worker import SyntheticWorker
from tests.unit.appliance.fakes import FakeEngine, eventually, serving

pytestmark = pytest.mark.anyio

WIDE, NARROW = "wide", "narrow"
MODELS = (WIDE, NARROW)
# wide: the default, window 4096, images, 50,000 token ids, a tool-call and a reasoning parser.
# narrow: window 1024, text only, 1,000 token ids, no parser.
CATALOG = """
[engine]
max_model_len = 4096

[policy]
max_n = 2
max_images = 2
max_inflight = 8
{policy}

[models.wide]
path = "{root}/wide"
aliases = ["w"]
tool_call_parser = "hermes"
reasoning_parser = "deepseek_r1"
{wide}

[models.narrow]
path = "{root}/narrow"
max_model_len = 1024
{narrow}
"""
CONFIGS = {WIDE: {"vocab_size": 50_000, "vision_config": {"image_size": 224}},
           NARROW: {"vocab_size": 1_000}}
WINDOWS = {WIDE: 4096, NARROW: 1024}
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAE"
       "hQGAhKmMIQAAAABJRU5ErkJggg==")
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@dataclass
class Box:
    client: httpx.AsyncClient
    workers: dict[str, SyntheticWorker]

    async def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return await self.client.post(path, json=body, **kwargs)

    def asked(self) -> dict[str, int]:
        return {name: len(worker.received) for name, worker in self.workers.items()}

    def last(self, model: str) -> dict[str, Any]:
        return self.workers[model].received[-1][1]


@contextlib.asynccontextmanager
async def two_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str = "",
                     wide: str = "", narrow: str = "", *, tokens: int = 4,
                     delay: float = 0.0) -> AsyncIterator[Box]:
    """The app, configured by a TOML catalog, in front of one synthetic worker per model, each
    reporting its own window as vLLM's /v1/models does."""
    for name, config in CONFIGS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    path = tmp_path / "config.toml"
    path.write_text(CATALOG.format(root=tmp_path, policy=policy, wide=wide, narrow=narrow))
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(path))
    settings = load_settings()
    workers = {name: SyntheticWorker(tokens, delay, name) for name in MODELS}
    ports = {name: free_port() for name in MODELS}
    async with contextlib.AsyncExitStack() as stack:
        for name, worker in workers.items():
            worker.max_model_len = WINDOWS[name]
            await stack.enter_async_context(serving(worker, ports[name]))
        engines = {name: FakeEngine(f"http://127.0.0.1:{ports[name]}", model_name=name)
                   for name in MODELS}
        port = free_port()
        await stack.enter_async_context(
            serving(create_app(settings, engines[WIDE], models=engines), port, settings))
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10))
        yield Box(client, workers)


def refused(answer: httpx.Response, path: str, code: str, param: str | None = None) -> str:
    """The 400's message, after checking it is in the route's shape with the expected code
    (Anthropic's shape has no code: its message is returned for the caller to check)."""
    assert answer.status_code == 400, answer.text
    body = answer.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error", body
        return str(body["error"]["message"])
    error = body["error"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return str(error["message"])


# Each route's body with a budget, a prompt of about `words` tokens (the synthetic worker
# counts four characters a token) and the model named.
def with_budget(path: str, model: str, budget: int | None, words: int = 1) -> dict[str, Any]:
    text = "abc " * words
    bodies: dict[str, tuple[dict[str, Any], str]] = {
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": text}]},
                                 "max_completion_tokens"),
        "/v1/completions": ({"prompt": text}, "max_tokens"),
        "/v1/responses": ({"input": text}, "max_output_tokens"),
        "/v1/messages": ({"messages": [{"role": "user", "content": text}]}, "max_tokens"),
        "/v1/chat/completions/batch": ({"messages": [[{"role": "user", "content": text}]]},
                                       "max_completion_tokens"),
        "/invocations": ({"prompt": text}, "max_tokens"),
    }
    body, field = bodies[path]
    return body | {"model": model} | ({} if budget is None else {field: budget})


BUDGET_FIELD = {"/v1/chat/completions": "max_completion_tokens", "/v1/completions": "max_tokens",
                "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens",
                "/v1/chat/completions/batch": "max_completion_tokens", "/invocations": "max_tokens"}
ROUTES = list(BUDGET_FIELD)


# --- the window -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ROUTES)
async def test_the_same_budget_is_clamped_to_each_models_own_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """3000 tokens fit the wide model's 4096 as asked; on the narrow model's 1024 they are cut
    to what its window leaves after the prompt, and the answer says so."""
    field = BUDGET_FIELD[path]
    async with two_models(tmp_path, monkeypatch) as box:
        wide = await box.post(path, with_budget(path, WIDE, 3000, words=40))
        assert wide.status_code == 200, wide.text
        assert "x-max-tokens-clamped" not in wide.headers
        assert box.last(WIDE)[field] == 3000
        narrow = await box.post(path, with_budget(path, NARROW, 3000, words=40))
        assert narrow.status_code == 200, narrow.text
        applied = box.last(NARROW)[field]
        assert 900 < applied < 1024
        assert narrow.headers["x-max-tokens-clamped"].startswith(
            f"requested=3000; applied={applied}")


@pytest.mark.parametrize("path", ROUTES)
async def test_a_prompt_that_fits_one_window_is_a_400_on_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A prompt of about 2000 tokens: served by the wide model, refused by the narrow one as
    longer than its window, in the route's shape, its worker never asked to generate."""
    async with two_models(tmp_path, monkeypatch) as box:
        wide = await box.post(path, with_budget(path, WIDE, 100, words=2000))
        assert wide.status_code == 200, wide.text
        before = box.asked()
        narrow = await box.post(path, with_budget(path, NARROW, 100, words=2000))
        message = refused(narrow, path, "context_length_exceeded")
        assert "maximum context length is 1024 tokens" in message
        assert box.asked() == before


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_the_default_budget_is_fitted_to_each_models_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """policy.default_max_tokens = 2000 for a request with no budget: sent whole to the wide
    model, fitted to the narrow one's room (and reported as the default)."""
    field = BUDGET_FIELD[path]
    async with two_models(tmp_path, monkeypatch, "default_max_tokens = 2000") as box:
        wide = await box.post(path, with_budget(path, WIDE, None, words=40))
        assert wide.status_code == 200, wide.text
        assert box.last(WIDE)[field] == 2000
        narrow = await box.post(path, with_budget(path, NARROW, None, words=40))
        assert narrow.status_code == 200, narrow.text
        assert 900 < box.last(NARROW)[field] < 1024
        assert narrow.headers["x-max-tokens-clamped"].endswith("source=default")


async def test_truncate_prompt_tokens_is_judged_against_each_models_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """truncate_prompt_tokens = 2000 is within the wide model's window and above the narrow's."""
    async with two_models(tmp_path, monkeypatch) as box:
        for model, status in ((WIDE, 200), (NARROW, 400)):
            body = with_budget("/v1/completions", model, 3500, words=2500) | {
                "truncate_prompt_tokens": 2000}
            answer = await box.post("/v1/completions", body)
            assert answer.status_code == status, (model, answer.text)
        assert answer.json()["error"]["param"] == "truncate_prompt_tokens"
        assert "(1024)" in answer.json()["error"]["message"]


# --- what the model is: modalities, vocabulary, parsers -----------------------------------------


IMAGE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": PNG}}]}]},
    "/v1/responses": {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": PNG}]}]},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG.split(",", 1)[1]}}]}]},
}
IMAGE_BODIES["/v1/messages/count_tokens"] = {
    k: v for k, v in IMAGE_BODIES["/v1/messages"].items() if k != "max_tokens"}


@pytest.mark.parametrize("path", list(IMAGE_BODIES))
async def test_the_media_guard_uses_each_models_own_modalities(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """An image goes to the model with a vision tower; the text-only model refuses it."""
    async with two_models(tmp_path, monkeypatch) as box:
        wide = await box.post(path, IMAGE_BODIES[path] | {"model": WIDE})
        assert wide.status_code == 200, wide.text
        before = box.asked()
        narrow = await box.post(path, IMAGE_BODIES[path] | {"model": NARROW})
        assert "accepts text only" in refused(narrow, path, "multimodal_not_supported")
        assert box.asked() == before


@pytest.mark.parametrize(("policy", "wide", "narrow", "status"), [
    ('multimodal = "on"', "", "", {WIDE: 200, NARROW: 200}),  # [policy]'s: every model's
    ('multimodal = "on"', "", 'multimodal = "auto"', {WIDE: 200, NARROW: 400}),
    ("", 'multimodal = "off"', "", {WIDE: 400, NARROW: 400}),
    ('multimodal = "off"', 'multimodal = "on"', "", {WIDE: 200, NARROW: 400}),
])
async def test_a_models_own_multimodal_setting_is_its_media_guard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str, wide: str, narrow: str,
        status: dict[str, int]) -> None:
    """models.<name>.multimodal over policy.multimodal, for that model alone."""
    path = "/v1/chat/completions"
    async with two_models(tmp_path, monkeypatch, policy, wide, narrow) as box:
        for model in MODELS:
            answer = await box.post(path, IMAGE_BODIES[path] | {"model": model})
            assert answer.status_code == status[model], (model, answer.text)
            if status[model] == 400:
                refused(answer, path, "multimodal_not_supported")


async def test_the_media_limits_hold_on_the_model_that_takes_media(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """policy.max_images and the remote host list bound what the multimodal model is sent."""
    async with two_models(tmp_path, monkeypatch) as box:
        image = {"type": "image_url", "image_url": {"url": PNG}}
        three = {"model": WIDE, "messages": [{"role": "user", "content": [image] * 3}]}
        refused(await box.post("/v1/chat/completions", three), "", "too_many_media_parts")
        remote = {"model": WIDE, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://192.168.1.9/cat.png"}}]}]}
        answer = await box.post("/v1/chat/completions", remote)
        assert answer.status_code == 400 and "192.168.1.9" in answer.text
        assert box.asked() == {WIDE: 0, NARROW: 0}


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/chat/completions", "logit_bias"), ("/v1/completions", "logit_bias"),
    ("/v1/completions", "allowed_token_ids")])
async def test_token_ids_are_checked_against_each_models_own_vocabulary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, field: str) -> None:
    """Token id 5000 is in the wide model's 50,000 and outside the narrow model's 1,000."""
    ids: Any = {"5000": 1} if field == "logit_bias" else [5000]
    async with two_models(tmp_path, monkeypatch) as box:
        wide = await box.post(path, with_budget(path, WIDE, 4) | {field: ids})
        assert wide.status_code == 200, wide.text
        narrow = await box.post(path, with_budget(path, NARROW, 4) | {field: ids})
        assert "vocabulary of 1000" in refused(narrow, path, "invalid_token_id", field)
        assert len(box.workers[NARROW].received) == 0


TOOL_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HI, "tools": TOOLS, "tool_choice": "auto"},
    "/v1/responses": {"input": "hi", "tools": [{"type": "function", "name": "f",
                                                "parameters": {"type": "object"}}]},
    "/v1/messages": {"max_tokens": 4, "messages": HI, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}]},
}


@pytest.mark.parametrize("path", list(TOOL_BODIES))
async def test_automatic_tool_choice_needs_that_models_own_parser(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The wide model has a tool-call parser: tools with tool_choice auto go to it. The narrow
    one has none: refused, naming its own setting."""
    async with two_models(tmp_path, monkeypatch) as box:
        wide = await box.post(path, TOOL_BODIES[path] | {"model": WIDE})
        assert wide.status_code == 200, wide.text
        narrow = await box.post(path, TOOL_BODIES[path] | {"model": NARROW})
        message = refused(narrow, path, "tool_parser_not_configured")
        assert "models.narrow.tool_call_parser" in message
        assert len(box.workers[NARROW].received) == 0
        required = await box.post("/v1/chat/completions", {
            "model": NARROW, "messages": HI, "tools": TOOLS, "tool_choice": "required"})
        assert required.status_code == 200, required.text  # structured output: no parser


def test_a_refusal_names_the_setting_of_the_model_it_is_for() -> None:
    """One model: [engine]'s key, as before; a catalog: the model's own table's."""
    assert Settings().model_key("tool_call_parser") == "engine.tool_call_parser"
    catalog = Settings(models={"a": {"path": "/a"}, "b": {"path": "/b"}})
    assert [entry.settings(catalog).model_key("tool_call_parser")
            for entry in Catalog.from_settings(catalog)] == [
        "models.a.tool_call_parser", "models.b.tool_call_parser"]


async def test_a_stream_is_kept_for_resumption_by_its_own_models_reasoning_parser(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain stream asks its worker for token ids (so it can continue after a fault) unless
    its model parses reasoning apart (the parser's state is the worker's): the wide model does."""
    async with two_models(tmp_path, monkeypatch) as box:
        for model in MODELS:
            answer = await box.post("/v1/chat/completions",
                                    {"model": model, "messages": HI, "stream": True})
            assert answer.status_code == 200, answer.text
        assert "return_token_ids" not in box.last(WIDE)
        assert box.last(NARROW)["return_token_ids"] is True


# --- the appliance's own limits, the same on each model -----------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": HI, "n": 3}, "n"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 1, "beam_width": 5}, "beam_width"),
])
async def test_the_sequence_cap_holds_on_each_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, path: str,
        body: dict[str, Any], param: str) -> None:
    async with two_models(tmp_path, monkeypatch) as box:
        answer = await box.post(path, body | {"model": model})
        assert "policy.max_n" in refused(answer, path, "sequence_limit_exceeded", param)
        allowed = await box.post(path, body | {"model": model, param: 2})
        assert allowed.status_code == 200, allowed.text
        assert len(box.workers[model].received) == 1


@pytest.mark.parametrize("model", MODELS)
async def test_a_fanout_beyond_the_inflight_limit_is_refused_on_each_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    async with two_models(tmp_path, monkeypatch) as box:
        answer = await box.post("/v1/completions",
                                {"model": model, "prompt": ["x"] * 5, "n": 2, "max_tokens": 2})
        refused(answer, "", "too_many_sequences", "prompt")
        fits = await box.post("/v1/completions",
                              {"model": model, "prompt": ["x"] * 4, "n": 2, "max_tokens": 2})
        assert fits.status_code == 200, fits.text


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": HI, "structured_outputs": {"regex": "(a+)+$"}},
     "structured_outputs.regex"),
    ("/v1/messages", {"messages": HI, "max_tokens": 4, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object", "properties": {
            "s": {"type": "string", "pattern": "(a+)+$"}}}}}}, "output_config.format.schema"),
])
async def test_a_costly_output_constraint_is_refused_on_each_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, path: str,
        body: dict[str, Any], param: str) -> None:
    async with two_models(tmp_path, monkeypatch) as box:
        message = refused(await box.post(path, body | {"model": model}), path,
                          "constraint_too_complex", param)
        assert param in message or not path.startswith("/v1/messages")
        assert box.asked() == {WIDE: 0, NARROW: 0}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/chat/completions", {"messages": HI, "temperature": -1}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": -2},
     "top_logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "many"}, "logprobs", "invalid_type"),
])
async def test_field_checks_hold_on_each_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, path: str,
        body: dict[str, Any], param: str, code: str) -> None:
    async with two_models(tmp_path, monkeypatch) as box:
        refused(await box.post(path, body | {"model": model}), path, code, param)
        assert box.asked() == {WIDE: 0, NARROW: 0}


async def test_the_cost_watch_judges_each_models_engine_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A constrained stream far slower than the norm (every synthetic token takes 10 ms, the
    norm's floor is 1 ms) is cut while another request shares its model's engine; beside a
    request on the other model's engine it is alone at its own, and finishes."""
    costly = {"model": NARROW, "messages": HI, "max_tokens": 100, "stream": True,
              "structured_outputs": {"grammar": "root ::= [a-z]+"}}
    constraints = "[constraints]\nslow_norm_floor_s = 0.001\nslow_factor = 2.0\nslow_tokens = 30"
    async with two_models(tmp_path, monkeypatch, constraints, tokens=200, delay=0.01) as box:

        async def beside(peer_model: str) -> list[str]:
            """The costly stream's events while a long request runs on `peer_model`."""
            peer = asyncio.ensure_future(box.post("/v1/chat/completions", {
                "model": peer_model, "messages": HI, "max_tokens": 1000}))
            await eventually(lambda: box.workers[peer_model].running == 1)
            async with box.client.stream("POST", "/v1/chat/completions", json=costly) as answer:
                lines = [line async for line in answer.aiter_lines() if line.startswith("data:")]
            assert answer.status_code == 200 and lines[-1] == "data: [DONE]"
            assert (await peer).status_code == 200
            return lines

        alone = await beside(WIDE)
        assert len(alone) > 100 and "request_too_costly" not in alone[-2], alone[-2:]
        shared = await beside(NARROW)
        assert len(shared) < 60 and "request_too_costly" in shared[-2], shared[-2:]
