"""The GPU smoke check's logic with a fake NVML; on a box without a GPU, its real answer."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.core.sections import GpuSettings
from supervisor.smoke import check as smoke
from supervisor.smoke import checks as smoke_checks
from supervisor.template.process import TemplateProcess
from tests.unit.supervisor.gpu.fake_nvml import (
    UUID,
    FakeGpu,
    NVMLError_LibraryNotFound,
    NVMLError_Unknown,
)

REPO = Path(__file__).resolve().parents[4]


def test_the_monitor_is_opened_by_index_and_by_uuid_with_typed_readings() -> None:
    gpu = FakeGpu()
    report, monitor = smoke_checks.check_nvml("0", gpu.module())
    assert monitor is not None
    assert report["ok"] is True
    assert report["uuid"] == UUID and report["same_device_by_uuid"] is True
    assert report["missing"] == []
    assert report["types"]["temperature_c"] == "int"
    assert report["reading"]["memory_total_bytes"] == 141 * 1024**3
    monitor.close()


def test_a_gpu_that_cannot_say_its_memory_fails_the_check() -> None:
    gpu = FakeGpu()
    gpu.fail["nvmlDeviceGetMemoryInfo"] = NVMLError_Unknown
    report, monitor = smoke_checks.check_nvml("0", gpu.module())
    assert report["ok"] is False
    assert "by_index.memory_used_bytes" in report["missing"]
    assert monitor is not None
    monitor.close()


def test_no_gpu_is_said_as_such() -> None:
    gpu = FakeGpu()
    gpu.init_error = NVMLError_LibraryNotFound
    report, monitor = smoke_checks.check_nvml("0", gpu.module())
    assert monitor is None
    assert report == {"ok": False, "gpu": "none", "status": "unavailable"}


def test_the_xid_drain_must_be_registered_and_return_at_once() -> None:
    gpu = FakeGpu()
    _, monitor = smoke_checks.check_nvml("0", gpu.module())
    assert monitor is not None
    gpu.xid(13)
    times = iter([10.0, 10.01])
    report = smoke_checks.check_xid_drain(monitor, clock=lambda: next(times))
    assert report["ok"] is True and report["registered"] is True
    slow = iter([10.0, 12.0])
    assert smoke_checks.check_xid_drain(monitor, clock=lambda: next(slow))["ok"] is False
    monitor.close()


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this box has a GPU")
def test_on_a_box_without_a_gpu_it_says_no_gpu_with_its_own_exit_status() -> None:
    done = subprocess.run([sys.executable, "-m", "supervisor.smoke.check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == smoke_checks.EXIT_NO_GPU == 3
    assert json.loads(done.stdout)["result"].startswith("no GPU")
    assert "no GPU" in done.stderr


# Runs the check as on a bare GPU box: the appliance's own dependencies cannot be imported.
_BARE_BOX = """
import importlib.abc, runpy, sys
ABSENT = {"pydantic", "pydantic_core", "pydantic_settings", "msgspec", "structlog", "litestar",
          "httpx", "uvicorn", "vllm"}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
sys.argv = ["smoke"]
runpy.run_module("supervisor.smoke.check", run_name="__main__")
"""


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this box has a GPU")
def test_it_runs_with_torch_nvml_and_psutil_alone() -> None:
    """The check needs none of the appliance's other dependencies, and its log still reaches
    stderr with its fields, leaving stdout to the JSON."""
    done = subprocess.run([sys.executable, "-c", _BARE_BOX], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == smoke_checks.EXIT_NO_GPU, done.stderr
    assert json.loads(done.stdout)["nvml"]["status"] == "unavailable"
    assert "[info] gpu.unavailable reason=" in done.stderr


def test_its_release_slack_is_the_appliances_default() -> None:
    assert smoke.parse_args([]).release_slack_mib == GpuSettings().release_slack_mib


def test_an_interpreter_named_as_an_operator_types_it_is_found_on_path() -> None:
    """`--python python3`: the template accepts only its own sys.executable, an absolute path
    that Python found by the same PATH search."""
    found = smoke_checks.resolve_python("python3")
    which = shutil.which("python3")
    assert which is not None and found == {"ok": True, "given": "python3", "path": which}
    assert smoke_checks.resolve_python("no-such-python-here")["ok"] is False


def test_an_interpreter_that_cannot_be_found_is_a_failed_check_not_a_traceback() -> None:
    args = smoke.parse_args(["--python", "no-such-python-here"])
    status, report = asyncio.run(smoke_checks.run(args, FakeGpu().module()))
    assert status == smoke_checks.EXIT_FAILED
    assert report["python"]["ok"] is False and report["result"] == "failed: python"


@pytest.mark.anyio
async def test_a_start_the_template_refuses_is_a_failed_check_not_a_traceback() -> None:
    """A template that refuses the worker (here: argv[0] is not its interpreter) fails the
    worker check with the template's reason."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    template = await TemplateProcess.launch(Path(sys.executable), (["json"], []), False, env, 60, 10)
    try:
        report = await smoke_checks._forked_worker(template, "python3", 16, 10)
    finally:
        await template.close()
    assert report["ok"] is False and "is not this template's interpreter" in report["error"]


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this box has a GPU")
@pytest.mark.parametrize("python", ["python3", "no-such-python-here"])
def test_any_python_argument_ends_in_the_json_report(python: str) -> None:
    done = subprocess.run([sys.executable, "-m", "supervisor.smoke.check", "--python", python],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == smoke_checks.EXIT_NO_GPU, done.stderr
    assert "Traceback" not in done.stderr
    assert json.loads(done.stdout)["python"]["given"] == python
