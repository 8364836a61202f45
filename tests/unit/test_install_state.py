"""install.sh --system gives the state directory back to the service user: what a run as root
left there (the 0700 run/ a `serve` as root made, which kept the service from making its control
socket) becomes the service's; the model stays root's."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A user that exists on any machine stands in for chat-appliance, which need not exist here.
STAND_IN = "nobody"


def give_back(state: Path) -> subprocess.CompletedProcess[str]:
    script = f'source ./install.sh\ngive_back_state "{state}" {STAND_IN}'
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False, env={"PATH": os.environ["PATH"]})


def test_what_a_root_run_left_becomes_the_service_users_and_the_model_stays_roots(
        tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving files to another user needs root")
    service = pwd.getpwnam(STAND_IN).pw_uid
    state = tmp_path / "var/lib/chat-appliance"
    (state / "models" / "SmolLM2").mkdir(parents=True)
    (state / "cache").mkdir()
    os.chown(state / "cache", service, -1)
    run = state / "run"
    run.mkdir(mode=0o700)  # as `serve` as root made it, socket and all
    (run / "control-8000.sock").touch()
    (state / "models.link").symlink_to(state / "models")

    result = give_back(state)
    assert result.returncode == 0, result.stderr
    assert str(run) in result.stdout
    for path in (run, run / "control-8000.sock", state / "cache"):
        assert path.stat().st_uid == service, path
    assert (state / "models.link").lstat().st_uid == service
    assert (state / "models").stat().st_uid == 0  # the link was not followed, nor models entered
    assert (state / "models" / "SmolLM2").stat().st_uid == 0
    assert give_back(state).stdout == ""  # nothing more to give: says nothing
