"""Each edge module boots its own appliance over the synthetic worker (about a second or two)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.support.stack import Stack, known_settings, running_stack
from tests.unit.edge.limits import EDGE_LIMITS


@contextlib.contextmanager
def boot(factory: pytest.TempPathFactory, **overrides: object) -> Iterator[Stack]:
    """The appliance with the edge limits, `overrides` (dotted keys as `policy__max_inflight`)
    on top; only the settings this tree knows are passed."""
    wanted = EDGE_LIMITS | {key.replace("__", "."): value for key, value in overrides.items()}
    with running_stack(factory.mktemp("edge"), known_settings(wanted)) as stack:
        yield stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with boot(tmp_path_factory) as running:
        yield running
