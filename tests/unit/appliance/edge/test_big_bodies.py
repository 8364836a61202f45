"""Big bodies (issue 9 #9): parsing four bodies just under the 16 MiB limit at once does not
stall the loop: /livez, polled meanwhile, answers every poll, none after LIVEZ_WORST_S."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from load.hostile.attacks import big_chat_body
from load.hostile.honest import poll_livez_during
from tests.support.stack import Stack
from tests.unit.appliance.edge.conftest import boot
from tests.unit.appliance.edge.limits import LIVEZ_WORST_S

CONCURRENT = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The default body timeout: four 15.5 MiB uploads at once take longer than the suite's 2 s
    # on a busy machine, and a 408 is not what this test is about.
    with boot(tmp_path_factory, server__body_timeout_s=30) as running:
        yield running



def test_four_big_bodies_at_once_keep_livez_answering(stack: Stack) -> None:
    """#9: four ~15.5 MiB JSON bodies at once; no /livez poll fails or waits LIVEZ_WORST_S, and
    no big body gets a 5xx."""
    body = big_chat_body()  # ~15.5 MiB, under server.max_body_bytes (16 MiB)
    statuses: list[int] = []

    def send() -> None:
        response = httpx.post(f"{stack.url}/v1/chat/completions", content=body, timeout=120,
                              headers={"content-type": "application/json"})
        statuses.append(response.status_code)

    livez = poll_livez_during(stack.url, [send] * CONCURRENT)
    summary = f"statuses {statuses}; /livez {livez}"
    assert len(statuses) == CONCURRENT and all(status < 500 for status in statuses), summary
    assert livez.failures == 0 and livez.worst < LIVEZ_WORST_S, summary
