"""Shared pytest set-up: settings from the tests alone; anyio runs the async tests on asyncio;
the fast suites run first; Hypothesis draws the same examples on every CI run."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from load.kit.isolation import isolate

# The README's one test command runs every suite: the unit tests (seconds) first, so that a
# mistake they catch is reported before the real worker's boots (minutes) begin.
SUITE_ORDER = ("unit", "compat", "integration")

# A CI run that fails must fail again on a rerun and on a laptop: Hypothesis derives its
# examples from each test instead of a random seed there (a local run keeps exploring). Recent
# Hypothesis loads a "ci" profile of its own like this one; pyproject allows older ones too.
# No deadline and no too-slow check there: a loaded CI machine is no reason to fail.
CI_PROFILE = "appliance-ci"
settings.register_profile(CI_PROFILE, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("CI") == "true":
    settings.load_profile(CI_PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: a module that builds Settings() at import must not see /etc either.
    isolate(os.environ)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Suites in SUITE_ORDER (anything else last); within one, the collection's own order, so
    a module's tests stay together with their module-scoped appliance."""
    def suite(item: pytest.Item) -> int:
        parts = item.path.relative_to(config.rootpath).parts
        name = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        return SUITE_ORDER.index(name) if name in SUITE_ORDER else len(SUITE_ORDER)

    items.sort(key=suite)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
