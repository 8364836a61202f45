"""Each edge module boots its own appliance over the synthetic worker (about a second or two)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest

from tests.support.stack import Stack, known_settings, running_stack
from tests.unit.appliance.edge.limits import EDGE_LIMITS


@contextlib.contextmanager
def boot(factory: pytest.TempPathFactory, upstream_args: Sequence[str] = (),
         **overrides: object) -> Iterator[Stack]:
    """The appliance with the edge limits, `overrides` (dotted keys as `policy__max_inflight`)
    on top; only the settings this tree knows are passed. The synthetic worker behaves like
    vLLM (--faults), plus `upstream_args`."""
    wanted = EDGE_LIMITS | {key.replace("__", "."): value for key, value in overrides.items()}
    args = ("--faults", *upstream_args)
    with running_stack(factory.mktemp("edge"), known_settings(wanted), args) as stack:
        yield stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with boot(tmp_path_factory) as running:
        yield running
