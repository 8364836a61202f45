"""systemd/chat-appliance.service: systemd itself accepts it, and it agrees with the settings."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.core.sections import SupervisorSettings

UNIT = Path(__file__).resolve().parents[3] / "systemd" / "chat-appliance.service"
INSTALLED_EXEC = "/opt/chat-appliance/venv/bin/chat-appliance"


def directives(text: str) -> list[tuple[str, str]]:
    """(key, value) pairs in order; keys may repeat (DeviceAllow=)."""
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            pairs.append((key.strip(), value.strip()))
    return pairs


def values(key: str) -> list[str]:
    return [value for k, value in directives(UNIT.read_text()) if k == key]


def seconds(key: str) -> float:
    (value,) = values(key)
    return float(value.removesuffix("s"))


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """verify exits 0 on unknown keys and bad values, so any message at all fails the test.

    The installed ExecStart does not exist here, so a copy runs this interpreter instead.
    systemd-analyze missing is a failure, not a skip: CI installs it.
    """
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not found: install Debian's `systemd` package (apt-get "
                    "install systemd); .ci/run does")
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_EXEC} serve" in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(INSTALLED_EXEC, sys.executable))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""


def test_notify_service_with_watchdog_and_no_restart_on_bad_config() -> None:
    assert values("Type") == ["notify"]
    assert values("NotifyAccess") == ["main"]
    assert seconds("WatchdogSec") > 0
    assert values("Restart") == ["on-failure"]
    assert values("RestartPreventExitStatus") == ["2"]
    assert values("KillMode") == ["mixed"]


def test_stop_timeout_outlasts_the_drain_and_the_worker_stop() -> None:
    defaults = SupervisorSettings()
    assert seconds("TimeoutStopSec") > defaults.drain_timeout_s + defaults.stop_grace_s


def test_gpu_device_nodes_stay_reachable() -> None:
    assert values("PrivateDevices") == []  # it would hide /dev/nvidia*
    assert values("DevicePolicy") == ["closed"]
    allowed = {value.split()[0] for value in values("DeviceAllow")}
    for node in ("nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        assert f"/dev/{node}" in allowed
    assert values("ProcSubset") in ([], ["all"])  # "pid" would hide /proc/driver/nvidia


def test_jit_memory_is_not_denied() -> None:
    """CUDA PTX JIT, Triton and torch.compile need writable+executable memory."""
    assert values("MemoryDenyWriteExecute") == []


def test_the_worker_cache_root_is_inside_a_writable_path() -> None:
    """VLLM_CACHE_ROOT defaults to $XDG_CACHE_HOME/vllm: under ProtectSystem=strict and
    ProtectHome it must lie under a ReadWritePaths entry, or every restart compiles again."""
    env = dict(value.split("=", 1) for value in values("Environment"))
    cache = Path(env["XDG_CACHE_HOME"]) / "vllm"
    assert values("ProtectSystem") == ["strict"] and values("ProtectHome") == ["yes"]
    assert any(cache.is_relative_to(path) for path in values("ReadWritePaths")), cache


def test_systemctl_reload_runs_the_reload_command_so_a_bad_file_fails_it() -> None:
    """`chat-appliance reload` exits non-zero with the reason when the new file is wrong;
    a bare `kill -HUP` would report success whatever happened."""
    assert values("ExecReload") == [f"{INSTALLED_EXEC} reload"]


def test_reload_reaches_the_control_socket_in_the_runtime_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecStart and ExecReload both get $RUNTIME_DIRECTORY, the service user's own directory
    made afresh at every start (nothing a root run left can be in its way): the socket the
    service makes there is the one ExecReload, and an operator's shell, ask."""
    from appliance.core import sections as settings_module

    assert values("ExecReload") == [f"{INSTALLED_EXEC} reload"]
    assert values("User") == ["chat-appliance"]
    assert values("RuntimeDirectory") == [settings_module.SYSTEM_RUNTIME.name]
    assert values("RuntimeDirectoryMode") == ["0700"]
    assert "AF_UNIX" in values("RestrictAddressFamilies")[0].split()
    monkeypatch.setattr(settings_module, "_is_checkout", lambda: False)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(settings_module.SYSTEM_RUNTIME))
    service = settings_module.ServerSettings().resolved_control_socket()
    assert service.parent == settings_module.SYSTEM_RUNTIME
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert settings_module.ServerSettings().control_socket_candidates()[-1] == service
