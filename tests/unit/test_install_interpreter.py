"""install.sh and the interpreter: one the service user cannot run is refused before anything is
built; a venv made from another interpreter is rebuilt, not called installed; the free-space
check is the one for the engine that will be built; doctor runs before the engine venv and at
the end; a GPU system install has nvidia-uvm loaded at boot."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bash(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` after sourcing install.sh (which then only defines its functions)."""
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", "-c", f"source ./install.sh\nset -euo pipefail\n{script}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def _venv(tmp_path: Path, made_from: str) -> Path:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text(f"home = /x\nexecutable = {made_from}\nversion = 3.11.2\n")
    return venv


def test_a_venv_made_from_the_same_interpreter_is_current(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "/usr/bin/python3.11")
    result = bash(f"MODE=development PYTHON_REAL=/usr/bin/python3.11\n"
                  f"venv_interpreter_current {venv} && echo current", tmp_path)
    assert result.stdout.strip() == "current", result.stderr


def test_a_venv_made_from_another_interpreter_is_not_current(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "/root/.pyenv/versions/3.11.7/bin/python3.11")
    result = bash(f"MODE=development PYTHON_REAL=/usr/bin/python3.11\n"
                  f"rc=0; venv_interpreter_current {venv} || rc=$?; echo status $rc", tmp_path)
    assert result.stdout.strip() == "status 1", result.stderr


def test_an_interpreter_the_service_user_cannot_run_stops_before_any_build(tmp_path: Path) -> None:
    script = ("MODE=system PREFIX= PYTHON_REAL=/root/.pyenv/versions/3.11.7/bin/python3.11\n"
              "runuser() { return 1; }\ncheck_python_for_service\necho built")
    result = bash(script, tmp_path)
    assert result.returncode == 1 and "built" not in result.stdout
    assert "cannot run /root/.pyenv/versions/3.11.7/bin/python3.11" in result.stderr
    assert "CHAT_APPLIANCE_PYTHON=/usr/bin/python3" in result.stderr


def test_an_interpreter_the_service_user_can_run_passes(tmp_path: Path) -> None:
    script = ("MODE=system PREFIX= PYTHON_REAL=/usr/bin/python3.11\n"
              "runuser() { return 0; }\ncheck_python_for_service")
    result = bash(script, tmp_path)
    assert result.returncode == 0 and "usable by chat-appliance: yes" in result.stdout


def _space_asked(device: str, tmp_path: Path) -> str:
    script = (f"DEVICE={device} ENGINE_PACKAGE=vllm ENGINE_VENV={tmp_path}/e ENGINE_LINK={tmp_path}/e\n"
              "engine_venv_valid() { return 1; }\nbuild_engine_venv() { :; }\n"
              "require_space() { echo \"need $2\"; }\nensure_engine_venv")
    return next(line for line in bash(script, tmp_path).stdout.splitlines() if line.startswith("need"))


def test_the_free_space_check_is_sized_for_the_engine_that_will_be_built(tmp_path: Path) -> None:
    assert _space_asked("cpu", tmp_path) == "need 6000"
    assert _space_asked("cuda", tmp_path) == "need 20000"


def test_a_gpu_system_install_loads_nvidia_uvm_at_boot(tmp_path: Path) -> None:
    result = bash(f"PREFIX={tmp_path} DEVICE=cuda\nensure_uvm_at_boot", tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "etc/modules-load.d/chat-appliance.conf").read_text() == "nvidia-uvm\n"


def test_a_cpu_install_writes_no_modules_load_file(tmp_path: Path) -> None:
    assert bash(f"PREFIX={tmp_path} DEVICE=cpu\nensure_uvm_at_boot", tmp_path).returncode == 0
    assert not (tmp_path / "etc").exists()


def test_doctor_runs_before_the_engine_venv_is_built_and_again_at_the_end(tmp_path: Path) -> None:
    steps = ["set_layout", "find_python", "choose_engine", "ensure_appliance_venv",
             "ensure_engine_venv", "ensure_py_spy", "ensure_default_model", "print_next"]
    stubs = "".join(f'{name}() {{ echo {name}; }}\n' for name in steps)
    result = bash(f'{stubs}run_doctor() {{ echo "doctor $*"; }}\nmain', tmp_path)
    assert result.stdout.splitlines() == [
        "set_layout", "==> chat-appliance install (development mode)", "find_python",
        "choose_engine", "ensure_appliance_venv",
        "doctor before the engine venv --before-install", "ensure_engine_venv", "ensure_py_spy",
        "ensure_default_model", "doctor installed", "print_next"]


def test_a_doctor_blocker_stops_the_install_with_what_to_do(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "bin").mkdir(parents=True)
    doctor = app / "bin" / "chat-appliance"
    doctor.write_text("#!/bin/sh\necho 'blocker  driver  driver 570, CUDA 13.0'\nexit 1\n")
    doctor.chmod(0o755)
    result = bash(f"MODE=development PREFIX= APP_VENV={app}\nrun_doctor early --before-install",
                  tmp_path)
    assert result.returncode == 1
    assert "    blocker  driver  driver 570, CUDA 13.0" in result.stdout
    assert "doctor found a blocker (early)" in result.stderr
