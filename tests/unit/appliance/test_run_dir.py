"""Where the control socket lives: the service's fresh RuntimeDirectory under systemd, the
checkout's .run in development, this user's own elsewhere; never the system install's state,
which a root run once claimed so that the service could no longer make its socket."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from appliance.core import sections as settings_module
from appliance.core.sections import SYSTEM_RUNTIME, SYSTEM_STATE, ServerSettings, default_run_dir


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The code as install.sh --system copies it into /opt: not a checkout, no unit around it."""
    monkeypatch.setattr(settings_module, "_is_checkout", lambda: False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


def test_under_systemd_the_socket_is_in_the_units_runtime_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd lists every RuntimeDirectory= in $RUNTIME_DIRECTORY, colon-separated: the first."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/chat-appliance:/run/other")
    assert ServerSettings(port=8123).resolved_control_socket() == Path(
        "/run/chat-appliance/control-8123.sock")


def test_a_checkout_keeps_its_socket_in_its_own_run_folder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    assert settings_module._is_checkout()
    assert default_run_dir() == settings_module.CHECKOUT_ROOT / ".run"
    assert ServerSettings().control_socket_candidates() == [
        settings_module.CHECKOUT_ROOT / ".run" / "control-8000.sock"]


@pytest.mark.usefixtures("installed")
def test_a_root_run_of_the_installed_code_stays_out_of_the_system_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator debugging with `sudo chat-appliance serve`: a directory of root's own, in
    the temporary directory, not one under /var/lib/chat-appliance the service needs."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    run = default_run_dir()
    assert not run.is_relative_to(SYSTEM_STATE) and not run.is_relative_to(SYSTEM_RUNTIME)
    assert run == Path(tempfile.gettempdir()) / "chat-appliance-0"


@pytest.mark.usefixtures("installed")
def test_a_users_runtime_directory_is_preferred_to_the_temporary_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_run_dir() == Path("/run/user/1000/chat-appliance")


@pytest.mark.usefixtures("installed")
def test_an_operators_reload_also_asks_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell has no $RUNTIME_DIRECTORY: after its own place, reload asks the service's."""
    assert ServerSettings(port=8001).control_socket_candidates() == [
        default_run_dir() / "control-8001.sock", SYSTEM_RUNTIME / "control-8001.sock"]
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(SYSTEM_RUNTIME))
    assert ServerSettings(port=8001).control_socket_candidates() == [
        SYSTEM_RUNTIME / "control-8001.sock"]


@pytest.mark.usefixtures("installed")
def test_a_configured_socket_is_the_only_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(SYSTEM_RUNTIME))
    configured = ServerSettings(control_socket=SYSTEM_STATE / "run" / "control.sock")
    assert configured.resolved_control_socket() == SYSTEM_STATE / "run" / "control.sock"
    assert configured.control_socket_candidates() == [SYSTEM_STATE / "run" / "control.sock"]
