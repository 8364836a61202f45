"""The endpoint plugin, on a miniature vLLM-shaped test tree and a recording fake endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.compat.run import plugin_env, pytest_argv

SERVED = "served-model"

FAKE_UTILS = '''
import openai

class RemoteOpenAIServer:
    def __init__(self, model, args):
        raise RuntimeError("would launch vllm serve")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def url_for(self, *parts):
        return self.url_root + "/" + "/".join(p.strip("/") for p in parts if p)
'''

FAKE_TESTS = '''
from pathlib import Path
from typing import Any

import pytest
from tests.utils import RemoteOpenAIServer

MODEL_NAME = "org/hub-model"


@pytest.fixture(scope="module")
def zephyr_lora_files():
    raise RuntimeError("would download from the hub")


@pytest.fixture(scope="module")
def server(zephyr_lora_files):
    with RemoteOpenAIServer(MODEL_NAME, ["--enable-lora"]) as remote_server:
        yield remote_server


@pytest.mark.parametrize("model_name", [MODEL_NAME])
def test_chat(server, model_name):
    reply = server.get_client().chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "hello"


def test_inline_model():
    other = RemoteOpenAIServer("org/other-model", [])
    other.get_client().completions.create(model="org/other-model", prompt="hi")


def test_model_dir_by_name(server):
    assert (Path(MODEL_NAME) / "config.json").is_file()


def test_excluded(server):
    raise AssertionError("an excluded test must not run")


def test_fails(server):
    raise AssertionError("boom")


def test_in_process_only():
    pass
'''


class Recorder(BaseHTTPRequestHandler):
    """A fake endpoint: lists one model and answers every POST, keeping the model it was asked for."""

    seen: list[str] = []

    def do_GET(self) -> None:
        self._reply({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body["model"])
        self._reply({"id": "x", "object": "chat.completion", "created": 0, "model": SERVED,
                     "choices": [{"index": 0, "finish_reason": "stop", "text": "hello",
                                  "message": {"role": "assistant", "content": "hello"}}]})

    def _reply(self, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory: pytest.TempPathFactory, endpoint: str) -> dict[str, Any]:
    """Run the miniature tree's tests through the plugin, once; the plugin's report file."""
    tmp_path = tmp_path_factory.mktemp("plugin")
    tree, scratch, model = tmp_path / "tree", tmp_path / "scratch", tmp_path / "model"
    for path, text in {tree / "tests" / "__init__.py": "", tree / "tests" / "utils.py": FAKE_UTILS,
                       tree / "tests" / "test_fake.py": FAKE_TESTS, model / "config.json": "{}",
                       tree / "pyproject.toml": "[tool.pytest.ini_options]\n"}.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    scratch.mkdir()
    exclude = tmp_path / "exclude.json"
    exclude.write_text(json.dumps({"tests/test_fake.py::test_excluded": "needs a flag",
                                   "tests/test_fake.py::test_renamed_since": "stale"}))
    env = plugin_env(tree, endpoint, model, "", exclude, tmp_path / "report.json")
    run = subprocess.run(pytest_argv(Path(sys.executable), tree, ["tests"]), cwd=scratch, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert (tmp_path / "report.json").is_file(), run.stdout + run.stderr
    return dict(json.loads((tmp_path / "report.json").read_text()))


@pytest.fixture(scope="module")
def report(plugin_run: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Outcome and message by node id."""
    return dict(plugin_run["tests"])


def outcome(report: dict[str, dict[str, str]], name: str) -> str:
    matches = [entry["outcome"] for nodeid, entry in report.items() if f"::{name}" in nodeid]
    assert len(matches) == 1, (name, report)
    return matches[0]


def test_server_fixtures_reach_the_endpoint_with_the_served_model(
        report: dict[str, dict[str, str]]) -> None:
    """RemoteOpenAIServer starts nothing; MODEL_NAME, its parameters and its requests are renamed."""
    assert outcome(report, "test_chat[org/hub-model]") == "passed"
    assert outcome(report, "test_inline_model") == "passed"
    assert Recorder.seen == [SERVED, SERVED]


def test_the_served_model_loads_by_name_from_the_working_directory(
        report: dict[str, dict[str, str]]) -> None:
    assert outcome(report, "test_model_dir_by_name") == "passed"


def test_exclusions_skip_with_their_reason_and_failures_keep_theirs(
        report: dict[str, dict[str, str]]) -> None:
    excluded = next(e for n, e in report.items() if n.endswith("::test_excluded"))
    failed = next(e for n, e in report.items() if n.endswith("::test_fails"))
    assert excluded == {"outcome": "skipped", "message": "needs a flag"}
    assert failed["outcome"] == "failed" and "boom" in failed["message"]


def test_the_report_names_the_served_model_and_exclusions_that_matched_nothing(
        plugin_run: dict[str, Any]) -> None:
    assert plugin_run["served_model"] == SERVED
    assert plugin_run["unused_exclusions"] == ["tests/test_fake.py::test_renamed_since"]


def test_tests_that_reach_no_server_are_deselected(report: dict[str, dict[str, str]]) -> None:
    assert not [nodeid for nodeid in report if "test_in_process_only" in nodeid]
