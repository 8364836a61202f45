"""Integration tests share real appliances: each boot of vLLM costs 15-35 s with its stop.

The modules that need nothing but the default settings share one appliance (`appliance`); those
that need named clients and nothing else share another (`clients_appliance`, CLIENTS below), and
those that need API keys a third (`keyed_appliance`, KEYS below).
Their modules run together, and each shared appliance stops after the last test that uses it, so
that no idle engine is left beside the boots of the modules that follow. A module with settings
of its own boots its own appliance under its own fixture."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from load.kit.appliance import Appliance, running_appliance

ARTEFACTS = pytest.StashKey[list[Path]]()
ARTEFACTS_ROOT = Path(os.environ.get("CHAT_APPLIANCE_TEST_ARTIFACTS",
                                     Path(__file__).resolve().parents[2] / "build" / "test-artifacts"))


@pytest.fixture(scope="module")
def artefacts(request: pytest.FixtureRequest) -> Path:
    """A folder for what a person should look at after the run (screenshots), emptied first
    and named at the end of the test session."""
    folder = ARTEFACTS_ROOT / request.module.__name__.rsplit(".", 1)[-1]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    request.config.stash.setdefault(ARTEFACTS, []).append(folder)
    return folder


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    for folder in config.stash.get(ARTEFACTS, []):
        terminalreporter.write_line(f"test artefacts: {folder}")


# The named clients of the modules that share `clients_appliance` (each module's own names).
CLIENTS: list[dict[str, object]] = [
    # test_isolation: stored responses kept apart; abandoned requests charged.
    {"name": "owner", "key": "sk-owner"},
    {"name": "other", "key": "sk-other"},
    {"name": "leaver-json", "key": "sk-leaver-json", "tokens_per_minute": 2500},
    {"name": "leaver-stream", "key": "sk-leaver-stream", "tokens_per_minute": 2500},
    # test_constraints: one client may send output constraints, one may not.
    {"name": "free", "key": "sk-free"},
    {"name": "plain", "key": "sk-plain", "output_constraints": False},
]

# The API keys of the modules that share `keyed_appliance` (each module's own key).
KEYS = ["sk-integration-test-key",  # test_policy, which also fills MAX_INFLIGHT slots
        "sk-surface-test-key"]  # test_surface
MAX_INFLIGHT = 4

# Each shared appliance by its fixture's name: its settings. Many kills over many modules: the
# crash-loop guard is tested on an appliance of its own (test_running_path).
SHARED: dict[str, dict[str, str]] = {
    "appliance": {"supervisor__crash_loop_restarts": "100"},
    "clients_appliance": {"admission__clients": json.dumps(CLIENTS)},
    "keyed_appliance": {"server__api_keys": json.dumps(KEYS),
                        "policy__max_inflight": str(MAX_INFLIGHT)},
}
_running: dict[str, tuple[Appliance, contextlib.ExitStack]] = {}
_last_user: dict[str, str] = {}  # each shared appliance's last test (its node id)
_cold_start_s: dict[str, float] = {}  # each shared appliance's first serve -> ready


def _shared(name: str, factory: pytest.TempPathFactory) -> Appliance:
    if name not in _running:
        stack = contextlib.ExitStack()
        began = time.monotonic()
        started = stack.enter_context(running_appliance(Path(factory.mktemp(name)),
                                                        **SHARED[name]))
        _running[name] = (started, stack)
        started.wait_ready()
        _cold_start_s[name] = time.monotonic() - began
    shared = _running[name][0]
    shared.wait_ready()  # whatever the module before left it doing
    return shared


def _uses(item: pytest.Item | None, name: str) -> bool:
    """Whether the item's test takes the shared appliance `name` (not its module's own fixture
    of that name)."""
    if item is None or name not in getattr(item, "fixturenames", ()):
        return False
    return not callable(getattr(getattr(item, "module", None), name, None))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module that boots no vLLM says so (`synthetic`); every other one here boots the real
    # worker, and `-m "not integration"` leaves it out.
    for item in items:
        if "tests/integration" in str(item.fspath) and item.get_closest_marker("synthetic") is None:
            item.add_marker(pytest.mark.integration)
    # Each shared appliance's modules together, in their places among the integration tests
    # (a stable sort by module keeps each module's tests together and in their order).
    places = [i for i, item in enumerate(items) if "tests/integration" in str(item.fspath)]
    part = [items[i] for i in places]
    shared_by: dict[str, list[str]] = {}
    for item in part:
        names = shared_by.setdefault(str(item.fspath), [])
        names += [n for n in SHARED if _uses(item, n) and n not in names]
    order = list(SHARED)

    def group(item: pytest.Item) -> int:
        names = shared_by[str(item.fspath)]
        return min(order.index(n) for n in names) if names else len(order)

    part.sort(key=group)
    for place, item in zip(places, part, strict=True):
        items[place] = item
        for name in SHARED:
            if _uses(item, name):
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are finalised
def pytest_runtest_teardown(item: pytest.Item) -> None:
    for name in list(_running):
        if _last_user.get(name) == item.nodeid:
            _running.pop(name)[1].close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for name in list(_running):  # a run cut short (-x, a keyboard interrupt)
        _running.pop(name)[1].close()


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Appliance:
    """The default appliance, ready, shared by every module that takes it."""
    return _shared("appliance", tmp_path_factory)


@pytest.fixture(scope="module")
def clients_appliance(tmp_path_factory: pytest.TempPathFactory) -> Appliance:
    """The appliance with CLIENTS, ready, shared by every module that takes it."""
    return _shared("clients_appliance", tmp_path_factory)


@pytest.fixture(scope="module")
def keyed_appliance(tmp_path_factory: pytest.TempPathFactory) -> Appliance:
    """The appliance with KEYS and MAX_INFLIGHT, ready, shared by every module that takes it."""
    return _shared("keyed_appliance", tmp_path_factory)


@pytest.fixture(scope="module")
def appliance_cold_start_s(appliance: Appliance) -> float:
    """The default appliance's cold start: serve -> ready, the template's imports then the
    first fork."""
    return _cold_start_s["appliance"]
