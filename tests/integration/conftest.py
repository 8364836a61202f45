"""Integration tests share one real appliance per module; each boot of vLLM costs ~35 s."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Appliance, running_appliance

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module that boots no vLLM says so (`synthetic`); every other one here boots the real
    # worker, and `-m "not integration"` leaves it out.
    for item in items:
        if "tests/integration" in str(item.fspath) and item.get_closest_marker("synthetic") is None:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_appliance(Path(tmp_path_factory.mktemp("appliance"))) as running:
        running.wait_ready()
        yield running
