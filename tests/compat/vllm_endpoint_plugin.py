"""pytest plugin loaded into vLLM's own test tree: its server fixtures talk to one running endpoint.

It runs in the compatibility environment (the engine's packages and pytest), never in the
appliance's, and imports nothing from this repository (vLLM's tree owns the name `tests` there):
its settings come from the environment (see `Config`). What it changes in vLLM's tests:

- `tests.utils.RemoteOpenAIServer` becomes a subclass that starts nothing and points at the
  endpoint (its `url_for` kept; its clients the same OpenAI SDK clients with vLLM's key, no
  retries and timeout, renaming the model as below);
- the model: a test module's `MODEL_NAME` (a hub id), the parameters that carried it and the
  `model` its requests send through vLLM's clients become the endpoint's served model (its
  /v1/models says which); `./<served model>` in the working directory (a scratch directory
  the runner gives) links to the local model, so tokenizers and configs load offline;
- fixtures that download LoRA adapters from the hub yield a placeholder path: the tests that
  use an adapter are excluded by the runner, the rest of their module still runs;
- tests that reach no server (in-process unit tests) are deselected: they cannot tell two
  endpoints apart;
- the runner's exclusions (node id, or node id without its parameters -> reason) are skips
  with that reason;
- every test's outcome is written as JSON to the report file, for the runner to compare.
"""

from __future__ import annotations

import json
import os
import types
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

ENDPOINT_ENV = "COMPAT_ENDPOINT"
MODEL_DIR_ENV = "COMPAT_MODEL_DIR"
EXCLUDE_ENV = "COMPAT_EXCLUDE_FILE"
REPORT_ENV = "COMPAT_REPORT_FILE"
API_KEY_ENV = "COMPAT_API_KEY"
DEFAULT_API_KEY = "token-abc123"  # what vLLM's tests send; a server without keys ignores it
# Fixtures through which a vLLM test reaches its server; a test using none of them is a unit test.
SERVER_FIXTURES = frozenset({"server", "client", "server_fixture"})
SERVER_CLASS = "RemoteOpenAIServer"
HUB_FIXTURE_SUFFIX = "_lora_files"
LORA_PLACEHOLDER = "/nonexistent/lora-adapter"
MESSAGE_CHARS = 300
CLIENT_TIMEOUT_S = 600  # vLLM's tests' own client timeout


@dataclass
class Config:
    endpoint: str
    model_dir: str
    api_key: str
    report: str | None
    exclude: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Config:
        exclude: dict[str, str] = {}
        path = os.environ.get(EXCLUDE_ENV)
        if path:
            with open(path, encoding="utf-8") as handle:
                exclude = dict(json.load(handle))
        return cls(endpoint=os.environ[ENDPOINT_ENV].rstrip("/"), model_dir=os.environ[MODEL_DIR_ENV],
                   api_key=os.environ.get(API_KEY_ENV) or DEFAULT_API_KEY,
                   report=os.environ.get(REPORT_ENV), exclude=exclude)


def served_model(endpoint: str, api_key: str) -> str:
    """The first model the endpoint lists on /v1/models."""
    request = urllib.request.Request(f"{endpoint}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def link_model(served: str, model_dir: Path) -> None:
    """`./<served>` -> the local model: vLLM's tests load tokenizers and configs by model name."""
    link = Path.cwd() / served
    if link.is_symlink() and link.resolve() == model_dir.resolve():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(model_dir, target_is_directory=True)


def renaming_clients(served: str, names: set[str]) -> tuple[type, type]:
    """OpenAI SDK clients that send the served model wherever a test names one of `names`."""
    import openai

    def renamed(options: Any) -> Any:
        body = options.json_data
        if isinstance(body, dict) and body.get("model") in names:
            options.json_data = {**body, "model": served}
        return options

    class Client(openai.OpenAI):
        def _prepare_options(self, options: Any) -> Any:
            return renamed(super()._prepare_options(options))

    class AsyncClient(openai.AsyncOpenAI):
        async def _prepare_options(self, options: Any) -> Any:
            return renamed(await super()._prepare_options(options))

    return Client, AsyncClient


def endpoint_server_class(base: type, config: Config, served: str, hub_ids: set[str]) -> type:
    """A subclass of vLLM's RemoteOpenAIServer that starts nothing and points at the endpoint."""
    parts = urlsplit(config.endpoint)
    client_class, async_client_class = renaming_clients(served, hub_ids)

    class EndpointServer(base):  # type: ignore[misc,valid-type]
        DUMMY_API_KEY = config.api_key

        def __init__(self, model: str, vllm_serve_args: list[str], **_: Any) -> None:
            # The model and arguments vLLM's test would have started its server with.
            self.requested_model, self.requested_args = model, list(vllm_serve_args)
            if model != served:
                hub_ids.add(model)
            self.uds = None
            self.host, self.port = parts.hostname, parts.port or 80
            self.show_hidden_metrics = False

        @property
        def url_root(self) -> str:
            return config.endpoint

        def __exit__(self, *exc: object) -> None:
            return None

        def _shutdown(self) -> None:
            return None

        def get_client(self, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", CLIENT_TIMEOUT_S)
            return client_class(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                                max_retries=0, **kwargs)

        def get_async_client(self, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", CLIENT_TIMEOUT_S)
            return async_client_class(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                                      max_retries=0, **kwargs)

    return EndpointServer


def reaches_server(item: pytest.Item) -> bool:
    """Through a server fixture, or a RemoteOpenAIServer the test starts itself."""
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    code = getattr(getattr(item, "function", None), "__code__", None)
    return SERVER_CLASS in getattr(code, "co_names", ())


def outcome_of(report: pytest.TestReport, previous: str | None) -> str:
    """One outcome per test from its setup, call and teardown reports: failed wins, then skipped."""
    if report.failed:
        return "failed"
    if previous in ("failed", "skipped"):
        return previous
    return "skipped" if report.skipped else "passed"


class EndpointPlugin:
    """The hooks; one instance per pytest run."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.served = ""
        self.hub_ids: set[str] = set()
        self.results: dict[str, dict[str, str]] = {}
        self.used_exclusions: set[str] = set()

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        import tests.utils

        self.served = served_model(self.config.endpoint, self.config.api_key)
        tests.utils.RemoteOpenAIServer = endpoint_server_class(  # type: ignore[misc]
            tests.utils.RemoteOpenAIServer, self.config, self.served, self.hub_ids)
        link_model(self.served, Path(self.config.model_dir))

    def pytest_collectstart(self, collector: pytest.Collector) -> None:
        # Between the import of a test module and the reading of its fixtures (collect()).
        if not isinstance(collector, pytest.Module):
            return
        try:
            module = collector.obj
        except (Exception, pytest.skip.Exception):
            return  # pytest reports the import error or the module's skip when it collects
        self.adapt_module(module)

    def adapt_module(self, module: types.ModuleType) -> None:
        hub_id = getattr(module, "MODEL_NAME", None)
        if isinstance(hub_id, str) and hub_id != self.served:
            self.hub_ids.add(hub_id)
            module.MODEL_NAME = self.served  # type: ignore[attr-defined]
        for name, value in list(vars(module).items()):
            if name.endswith(HUB_FIXTURE_SUFFIX) and callable(value):
                setattr(module, name, pytest.fixture(scope="session", name=name)(
                    lambda: LORA_PLACEHOLDER))

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        kept, dropped = [], []
        for item in items:
            (kept if reaches_server(item) else dropped).append(item)
            self.map_params(item)
            key = self.exclusion(item.nodeid)
            if key is not None:
                self.used_exclusions.add(key)
                item.add_marker(pytest.mark.skip(reason=self.config.exclude[key]))
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept

    def map_params(self, item: pytest.Item) -> None:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            return
        for key, value in callspec.params.items():
            if isinstance(value, str) and value in self.hub_ids:
                callspec.params[key] = self.served

    def exclusion(self, nodeid: str) -> str | None:
        """The exclusion naming this test, by its id or its id without parameters."""
        for key in (nodeid, nodeid.split("[", 1)[0]):
            if key in self.config.exclude:
                return key
        return None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.results.setdefault(report.nodeid, {})
        entry["outcome"] = outcome_of(report, entry.get("outcome"))
        if report.failed or report.skipped:
            entry.setdefault("message", message_of(report))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.config.report:
            with open(self.config.report, "w", encoding="utf-8") as handle:
                unused = sorted(set(self.config.exclude) - self.used_exclusions)
                json.dump({"served_model": self.served, "tests": self.results,
                           "unused_exclusions": unused}, handle, indent=1)


def message_of(report: pytest.TestReport) -> str:
    """A skip's reason, or the exception a failure ended with: enough to tell causes apart."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return " ".join(str(text).split())[:MESSAGE_CHARS]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(EndpointPlugin(Config.from_env()), "compat-endpoint")
