"""Several models on one appliance: the catalog read from the configuration, each model's worker
settings, and the API routing by `model` in front of two synthetic workers (fakes that answer
as vLLM does), with each model's own window, state and error shapes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.app import create_app
from appliance.core.catalog import Catalog
from appliance.core.engine import EngineState
from appliance.core.errors import TooManyRequests
from appliance.core.settings import ConfigError, Settings, load_settings
from load.kit.net import free_port
from load.kit.synthetic_worker import SyntheticWorker
from supervisor.engine.worker import build_command
from tests.unit.appliance.fakes import FakeEngine, serving

pytestmark = pytest.mark.anyio

TWO = """
[engine]
extra_args = ["--seed", "1"]
env = {SHARED = "1", OVERRIDDEN = "engine"}
max_model_len = 4096

[models.smol]
path = "/models/smol"
aliases = ["SmolLM2-135M-Instruct"]

[models.gemma]
path = "/models/gemma"
aliases = ["gemma-3-270m", "g"]
default = true
max_model_len = 1024
dtype = "bfloat16"
chat_template = "/etc/chat-appliance/gemma-chat.jinja"
extra_args = ["--max-logprobs", "5"]
env = {OVERRIDDEN = "gemma"}
pinned = true
keep_alive_s = 300
"""


def settings_from(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    path = tmp_path / "config.toml"
    path.write_text(text)
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(path))
    return load_settings()


# --- the catalog --------------------------------------------------------------------------------


def test_the_catalog_puts_the_default_first_and_overrides_engine_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = Catalog.from_settings(settings_from(tmp_path, TWO, monkeypatch))
    gemma, smol = catalog.entries
    assert (gemma.name, gemma.default, smol.name, smol.default) == ("gemma", True, "smol", False)
    assert catalog.find("g") is gemma and catalog.find("SmolLM2-135M-Instruct") is smol
    assert catalog.find("smol-v2") is None
    assert (gemma.engine.model, gemma.engine.model_name) == ("/models/gemma", "gemma")
    assert (gemma.engine.max_model_len, smol.engine.max_model_len) == (1024, 4096)  # inherited
    assert (gemma.engine.dtype, smol.engine.dtype) == ("bfloat16", None)
    assert gemma.engine.extra_args == ["--seed", "1", "--max-logprobs", "5"]
    assert gemma.engine.env == {"SHARED": "1", "OVERRIDDEN": "gemma"}
    assert smol.engine.env == {"SHARED": "1", "OVERRIDDEN": "engine"}
    assert (gemma.pinned, gemma.keep_alive_s, smol.pinned) == (True, 300, False)


def test_each_model_has_its_own_private_socket_or_port(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from(tmp_path, TWO, monkeypatch)
    gemma, smol = Catalog.from_settings(settings).entries
    assert gemma.engine.socket_path == settings.engine.socket_path  # the default's: [engine]'s
    assert smol.engine.socket_path.parent == settings.engine.resolved_socket_dir() / "model-smol"
    monkeypatch.delenv("CHAT_APPLIANCE_CONFIG")
    tcp = Settings(engine={"listen": "tcp", "port": 9100},
                   models={"a": {"path": "/a"}, "b": {"path": "/b"}})
    assert [entry.engine.base_url for entry in Catalog.from_settings(tcp)] == [
        "http://127.0.0.1:9100", "http://127.0.0.1:9101"]


def test_a_worker_answers_to_its_aliases_and_gets_its_chat_template(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gemma = Catalog.from_settings(settings_from(tmp_path, TWO, monkeypatch)).default
    args = build_command(gemma.engine)
    names = args[args.index("--served-model-name") + 1:args.index("--served-model-name") + 4]
    assert names == ["gemma", "gemma-3-270m", "g"]
    assert args[args.index("--chat-template") + 1] == "/etc/chat-appliance/gemma-chat.jinja"
    assert args[args.index("--max-model-len") + 1] == "1024"


def test_without_a_catalog_the_engine_model_is_the_one_model() -> None:
    settings = Settings(engine={"model": "/models/SmolLM2", "served_model_aliases": ["smol"]})
    (entry,) = Catalog.from_settings(settings).entries
    assert (entry.name, entry.aliases, entry.default, entry.pinned) == (
        "SmolLM2", ("smol",), True, True)
    assert entry.engine == settings.engine  # unchanged: socket, window, everything


@pytest.mark.parametrize(("text", "named"), [
    ('[models.a]\npath = "/a"\naliases = ["x"]\n[models.b]\npath = "/b"\naliases = ["x"]\n',
     "both claim the name 'x'"),
    ('[models.a]\npath = "/a"\n[models.b]\npath = "/b"\naliases = ["a"]\n',
     "both claim the name 'a'"),
    ('[models.a]\npath = "/a"\ndefault = true\n[models.b]\npath = "/b"\ndefault = true\n',
     "only one model can be the default"),
    ('[models."a/b"]\npath = "/a"\n', "models.a/b: a model's name"),
    ('[models.a]\npath = "/a"\nwindow = 4\n', "models.a.window"),
    ('[models.a]\naliases = []\n', "models.a.path"),
])
def test_a_bad_catalog_stops_start_up_naming_what_is_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("'", ".")):
        settings_from(tmp_path, text, monkeypatch)


# --- routing ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def two_models(smol_state: EngineState = EngineState.READY, *, pinned: bool | None = None,
                     catalog: bool = True, residency: Any = None,
                     default_pinned: bool | None = None,
                     clients: list[dict[str, Any]] | None = None,
                     smol: dict[str, Any] | None = None,
                     more: dict[str, Any] | None = None) -> AsyncIterator[tuple[
                         httpx.AsyncClient, dict[str, SyntheticWorker], dict[str, FakeEngine]]]:
    """The app in front of two synthetic workers: gemma (default, window 1024) and smol
    (window 2048). `smol`: more of smol's table; `more`: more settings (groups replaced)."""
    workers = {"gemma": SyntheticWorker(4, 0.0, "gemma"), "smol": SyntheticWorker(4, 0.0, "smol")}
    workers["gemma"].max_model_len = 1024
    ports = {name: free_port() for name in workers}
    async with contextlib.AsyncExitStack() as stack:
        for name, worker in workers.items():
            await stack.enter_async_context(serving(worker, ports[name]))
        engines = {name: FakeEngine(f"http://127.0.0.1:{ports[name]}", model_name=name)
                   for name in workers}
        engines["smol"].state = smol_state
        models: dict[str, Any] = {
            "gemma": {"path": "/models/gemma", "aliases": ["g"], "default": True},
            "smol": {"path": "/models/smol", "aliases": ["SmolLM2-135M-Instruct"]}}
        if pinned is not None:
            models["smol"]["pinned"] = pinned
        if default_pinned is not None:
            models["gemma"]["pinned"] = default_pinned
        models["smol"] |= smol or {}
        settings = Settings(**{"models": models if catalog else {},
                               "admission": {"clients": clients or []}} | (more or {}))
        app = create_app(settings, engines["gemma"], models=engines if catalog else None,
                         residency=residency)
        port = free_port()
        await stack.enter_async_context(serving(app, port, settings))
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10))
        yield client, workers, engines


def chat(model: str | None, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **more}
    return body if model is None else body | {"model": model}


async def test_each_request_reaches_the_worker_of_the_model_it_names() -> None:
    async with two_models() as (client, workers, _):
        for model, expected in (("smol", "smol"), ("SmolLM2-135M-Instruct", "smol"),
                                ("g", "gemma"), (None, "gemma")):
            before = {name: len(worker.received) for name, worker in workers.items()}
            answer = await client.post("/v1/chat/completions", json=chat(model))
            assert answer.status_code == 200, answer.text
            grown = [name for name, worker in workers.items()
                     if len(worker.received) > before[name]]
            assert grown == [expected], model
        for path, body in (("/v1/completions", {"model": "smol", "prompt": "x"}),
                           ("/invocations", {"model": "smol", "prompt": "x"}),
                           ("/v1/chat/completions/batch", {"model": "smol",
                                                           "messages": [[{"role": "user",
                                                                          "content": "a"}]]}),
                           ("/v1/messages", {"model": "smol", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "a"}]}),
                           ("/v1/responses", {"model": "smol", "input": "a"})):
            before_smol, before_gemma = len(workers["smol"].received), len(
                workers["gemma"].received)
            answer = await client.post(path, json=body)
            assert answer.status_code == 200, (path, answer.text)
            assert len(workers["smol"].received) > before_smol, path
            assert len(workers["gemma"].received) == before_gemma, path


async def test_tokenize_counts_with_the_named_models_tokenizer() -> None:
    async with two_models() as (client, workers, _):
        before = workers["smol"].tokenized
        answer = await client.post("/tokenize", json={"model": "smol", "prompt": "a b c"})
        assert answer.status_code == 200 and workers["smol"].tokenized == before + 1


async def test_a_name_outside_the_catalog_is_a_404_in_the_routes_shape() -> None:
    async with two_models() as (client, workers, _):
        openai = await client.post("/v1/chat/completions", json=chat("gpt-4o"))
        assert openai.status_code == 404
        error = openai.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "gpt-4o" in error["message"]
        anthropic = await client.post("/v1/messages", json={
            "model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]})
        assert anthropic.status_code == 404
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "not_found_error"
        for path, body in (("/v1/completions", {"model": "nope", "prompt": "x"}),
                           ("/tokenize", {"model": "nope", "prompt": "x"}),
                           ("/invocations", {"model": "nope", "prompt": "x"}),
                           ("/v1/responses", {"model": "nope", "input": "x"})):
            answer = await client.post(path, json=body)
            assert answer.status_code == 404, path
        assert all(not worker.received for worker in workers.values())  # no work was done


async def test_a_model_whose_worker_is_down_is_a_503_for_its_requests_only() -> None:
    async with two_models(EngineState.BACKOFF) as (client, _, _):
        down = await client.post("/v1/chat/completions", json=chat("smol"))
        assert down.status_code == 503
        assert down.headers["retry-after"] == "7"
        assert "smol" in down.json()["error"]["message"]
        assert (await client.post("/v1/chat/completions", json=chat("gemma"))).status_code == 200


async def test_the_clamp_uses_the_window_of_the_model_named() -> None:
    async with two_models() as (client, _, _):
        applied = {}
        for model in ("gemma", "smol"):
            answer = await client.post("/v1/completions", json={
                "model": model, "prompt": "one two three", "max_tokens": 100_000})
            assert answer.status_code == 200, answer.text
            applied[model] = int(answer.headers["x-max-tokens-clamped"]
                                 .split("applied=")[1].split(";")[0])
        assert 1000 < applied["gemma"] < 1024
        assert 2000 < applied["smol"] < 2048


async def test_the_model_list_is_the_catalog_with_each_models_state() -> None:
    async with two_models(EngineState.STARTING) as (client, _, _):
        listed = (await client.get("/v1/models")).json()["data"]
        states = {entry["id"]: entry["state"] for entry in listed}
        # A ready worker's own entries (with its window); one not ready, its names.
        assert states == {"gemma": "ready", "smol": "starting",
                          "SmolLM2-135M-Instruct": "starting"}
        gemma = next(entry for entry in listed if entry["id"] == "gemma")
        assert gemma["max_model_len"] == 1024
        one = await client.get("/v1/models/SmolLM2-135M-Instruct")
        assert one.status_code == 200 and one.json()["root"] == "smol"
        assert (await client.get("/v1/models/nope")).status_code == 404


async def test_health_is_ready_while_the_default_and_every_pinned_model_are() -> None:
    async with two_models(EngineState.BACKOFF) as (client, _, engines):
        health = await client.get("/health")
        assert health.status_code == 200  # smol is neither the default nor pinned
        assert health.json()["models"]["smol"]["state"] == "backoff"
        assert health.json()["models"]["gemma"] | {"pid": 0} == {
            "state": "ready", "pid": 0, "ready": True, "default": True, "pinned": True,
            "aliases": ["g"], "restarts": 0}
        engines["gemma"].state = EngineState.STARTING
        assert (await client.get("/health")).status_code == 503
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503 and readyz.json()["state"] == "starting"
    async with two_models(EngineState.BACKOFF, pinned=True) as (client, _, _):
        health = await client.get("/health")
        assert health.status_code == 503 and "retry-after" in health.headers
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503 and readyz.json()["state"] == "backoff"


async def test_the_status_document_has_a_row_per_model() -> None:
    async with two_models(EngineState.BACKOFF) as (client, _, _):
        rows = (await client.get("/status.json")).json()["models"]
        assert [(row["name"], row["state"], row["default"]) for row in rows] == [
            ("gemma", "ready", True), ("smol", "backoff", False)]


async def test_without_a_catalog_the_worker_judges_the_name_as_before() -> None:
    async with two_models(catalog=False) as (client, workers, _):
        answer = await client.post("/v1/chat/completions", json=chat("any-name"))
        assert answer.status_code == 200  # passed on: the one worker answers to its names
        assert len(workers["gemma"].received) == 1


class FakeResidency:
    """Holds each request until its model is "loaded" (the test sets the event); refuses with
    the error it is given."""

    def __init__(self) -> None:
        self.loaded = asyncio.Event()
        self.leases: dict[str, int] = {}
        self.refusal: Exception | None = None

    async def acquire(self, model: str) -> Callable[[], None]:
        if self.refusal is not None:
            raise self.refusal
        await self.loaded.wait()
        self.leases[model] = self.leases.get(model, 0) + 1

        def release() -> None:
            self.leases[model] -= 1

        return release

    def snapshot(self, model: str) -> dict[str, object]:
        return {"in_use": self.leases.get(model, 0)}


async def test_with_residency_a_request_waits_for_its_models_load_and_holds_it_to_its_end(
) -> None:
    residency = FakeResidency()
    async with two_models(EngineState.UNLOADED, residency=residency) as (client, workers, eng):
        asked = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat("smol")))
        await asyncio.sleep(0.2)
        assert not asked.done() and not workers["smol"].received  # waiting, not refused
        eng["smol"].state = EngineState.READY
        residency.loaded.set()
        answer = await asyncio.wait_for(asked, 5)
        assert answer.status_code == 200 and len(workers["smol"].received) == 1
        assert residency.leases == {"smol": 0}  # released once answered
        health = (await client.get("/health")).json()
        assert health["models"]["smol"]["residency"] == {"in_use": 0}
        eng["smol"].state = eng["gemma"].state = EngineState.UNLOADED  # all unloaded: listed
        listed = (await client.get("/v1/models")).json()["data"]
        assert {entry["state"] for entry in listed} == {"unloaded"}
        residency.refusal = TooManyRequests("queue full", code="model_queue_full",
                                            retry_after_s=4)
        full = await client.post("/v1/messages", json={
            "model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]})
        assert full.status_code == 429 and full.headers["retry-after"] == "4"
        assert full.json()["error"]["type"] == "rate_limit_error"  # Anthropic's shape


async def test_a_request_waiting_for_its_models_load_counts_against_its_clients_limits() -> None:
    """A client at its max_inflight cannot fill a model's load queue: its next request is a
    429 at once naming its limit while the first waits; another client's request waits its turn,
    and once the wait ends the client may ask again."""
    residency = FakeResidency()
    clients = [{"name": "one", "key": "sk-one", "max_inflight": 1},
               {"name": "other", "key": "sk-other"}]
    async with two_models(EngineState.UNLOADED, residency=residency, clients=clients) as (
            client, workers, eng):
        def ask(key: str) -> Any:
            return client.post("/v1/chat/completions", json=chat("smol"),
                               headers={"Authorization": f"Bearer {key}"})

        first = asyncio.ensure_future(ask("sk-one"))
        await asyncio.sleep(0.2)
        assert not first.done()
        try:
            second = await asyncio.wait_for(ask("sk-one"), 5)  # not held in the queue
        except TimeoutError:
            residency.loaded.set()  # a failed check leaves no request waiting forever
            raise
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "client_max_inflight"
        assert int(second.headers["retry-after"]) >= 1
        other = asyncio.ensure_future(ask("sk-other"))
        await asyncio.sleep(0.2)
        assert not other.done()
        eng["smol"].state = EngineState.READY
        residency.loaded.set()
        assert (await asyncio.wait_for(first, 5)).status_code == 200
        assert (await asyncio.wait_for(other, 5)).status_code == 200
        assert (await ask("sk-one")).status_code == 200
        assert len(workers["smol"].received) == 3


@pytest.mark.parametrize(("default_pinned", "status"), [(None, 503), (True, 503), (False, 200)])
async def test_the_default_holds_readiness_unless_it_says_pinned_false(
        default_pinned: bool | None, status: int) -> None:
    async with two_models(default_pinned=default_pinned) as (client, _, engines):
        engines["gemma"].state = EngineState.UNLOADED  # residency gave its memory back
        assert (await client.get("/health")).status_code == status


def test_the_two_models_example_is_a_valid_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parents[3] / "config" / "examples" / "two-models.toml"
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(example))
    smol, gemma = Catalog.from_settings(load_settings()).entries
    assert (smol.name, smol.default, smol.pinned, gemma.name, gemma.pinned) == (
        "smollm2", True, True, "gemma", False)
    assert gemma.engine.chat_template is not None and gemma.keep_alive_s == 300
    assert (Path(__file__).resolve().parents[3] / "config" / "examples"
            / gemma.engine.chat_template.name).is_file()  # the template it names is shipped
