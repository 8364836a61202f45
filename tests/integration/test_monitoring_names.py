"""Every metric the alert rules and the dashboard query exists in a running appliance's /metrics.

The worker here is the synthetic upstream: metric names do not depend on the engine, and it
boots in a second. GPU series (but appliance_gpu_up) cannot appear without a GPU;
tests/unit/test_monitoring.py checks them against the NVML monitor driven by a fake.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from load.kit.appliance import running_synthetic_appliance
from tests.monitoring_names import GPU_ONLY, exposed_names, names_used

pytestmark = pytest.mark.synthetic  # no vLLM: the synthetic worker


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """/metrics of an appliance that has answered a chat, a stream and a refusal."""
    with running_synthetic_appliance(tmp_path_factory.mktemp("names"), "--tokens", "4") as appliance:
        appliance.wait_ready(timeout_s=60)
        chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}
        with httpx.Client(base_url=appliance.url, timeout=10) as client:
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
            assert client.post("/v1/chat/completions", json=chat | {"stream": True}).status_code == 200
            assert client.post("/v1/chat/completions", content=b"{oops").status_code == 400
            yield client.get("/metrics").text


def missing(names: set[str], text: str) -> dict[str, list[str]]:
    """Each name absent from the exposition, with where monitoring/ uses it."""
    used, exposed = names_used(), exposed_names(text)
    return {name: sorted(used[name]) for name in sorted(names - exposed)}


def test_every_name_monitoring_queries_is_exported(metrics_text: str) -> None:
    wanted = {name for name in names_used() if not name.startswith(GPU_ONLY)}
    assert missing(wanted, metrics_text) == {}
