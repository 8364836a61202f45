"""Shared pytest set-up: settings from the tests alone; anyio runs the async tests on asyncio."""

from __future__ import annotations

import os

import pytest

from tests.support.isolation import isolate


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: a module that builds Settings() at import must not see /etc either.
    isolate(os.environ)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
