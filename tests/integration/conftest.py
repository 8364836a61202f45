"""Integration tests share one real appliance per module; each boot of vLLM costs ~35 s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Appliance, running_appliance


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_appliance(Path(tmp_path_factory.mktemp("appliance"))) as running:
        running.wait_ready()
        yield running
