"""The worker's address as one string: a Unix socket's path survives the URL, TCP stays TCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.core.sections import EngineSettings
from appliance.core.worker_address import WorkerAddress


def test_the_settings_socket_path_comes_back_whole_from_the_url(tmp_path: Path) -> None:
    engine = EngineSettings(socket_dir=tmp_path / "a dir:with%odd")
    address = WorkerAddress.parse(engine.base_url)
    assert address.path == str(engine.socket_path)
    assert address.host_header == b"localhost" and str(address) == f"unix:{engine.socket_path}"


def test_the_tcp_fallback_is_host_and_port() -> None:
    address = WorkerAddress.parse(EngineSettings(listen="tcp", port=8123).base_url)
    assert (address.path, address.host, address.port) == (None, "127.0.0.1", 8123)
    assert address.host_header == b"127.0.0.1:8123"


@pytest.mark.parametrize("url", ["https://127.0.0.1:8100", "unix:/run/x.sock", "ftp://x"])
def test_any_other_scheme_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="http or http\\+unix"):
        WorkerAddress.parse(url)
