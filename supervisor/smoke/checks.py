"""The GPU smoke check's checks and their run; `supervisor/smoke/check.py` is its command and
says what each check shows. Imported only once the command has made sure logging works on the
box it runs on (supervisor/smoke/bare_box.py): it needs nothing but torch, nvidia-ml-py and psutil.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from supervisor.gpu.nvml import GpuMonitor
from supervisor.gpu.readings import GpuReading
from supervisor.gpu.release import ReleaseWait, in_host_pid_namespace
from supervisor.template.process import TemplateError, TemplateProcess

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
HERE = Path(__file__).resolve().parent
TORCH_SIDE = HERE / "torch_side.py"
DRAIN_LIMIT_S = 1.0  # a drain is non-blocking: NVML's event wait with a timeout of 0
REQUIRED_READINGS = ("memory_used_bytes", "memory_total_bytes")  # every GPU answers these


@dataclass(frozen=True)
class Watched:
    """What the monitor reads of its settings (the appliance's gpu section), for one GPU."""

    device: str
    enabled: bool = True


def resolve_python(name: str) -> dict[str, Any]:
    """The interpreter as the template will know it: an operator types `python3`, a name on
    PATH, and the template accepts only its own sys.executable, which Python makes absolute by
    the same PATH search. Not realpath: a venv's python3 is a link to the base interpreter,
    which run by its real path would not see the venv's torch."""
    found = shutil.which(name)
    if found is None:
        return {"ok": False, "given": name, "error": f"no executable {name!r} (PATH or path)"}
    return {"ok": True, "given": name, "path": os.path.abspath(found)}


def check_nvml(device: str, nvml: Any = None) -> tuple[dict[str, Any], GpuMonitor | None]:
    """The monitor by index, then by the UUID it found; None as the monitor where NVML finds no
    GPU (the report then says why)."""
    by_index = GpuMonitor(Watched(device), nvml)
    by_index.open()
    if by_index.status != "ok" or by_index.uuid is None:
        by_index.close()
        return {"ok": False, "gpu": "none", "status": by_index.status}, None
    by_uuid = GpuMonitor(Watched(by_index.uuid), nvml)
    by_uuid.open()
    readings = {"by_index": by_index.poll(), "by_uuid": by_uuid.poll()}
    same = by_uuid.uuid == by_index.uuid and by_uuid.status == "ok"
    by_uuid.close()
    missing = [f"{way}.{name}" for way, reading in readings.items()
               for name in REQUIRED_READINGS if not isinstance(getattr(reading, name), int)]
    report = {"ok": same and not missing, "uuid": by_index.uuid, "same_device_by_uuid": same,
              "missing": missing, "reading": _reading(readings["by_index"]),
              "types": {k: type(v).__name__ for k, v in _reading(readings["by_index"]).items()},
              "name": by_index.summary().get("name")}
    return report, by_index


def check_xid_drain(monitor: GpuMonitor, clock: Any = time.monotonic) -> dict[str, Any]:
    began = clock()
    verdict = monitor.settle()
    took = clock() - began
    return {"ok": monitor.events_supported and took < DRAIN_LIMIT_S,
            "registered": monitor.events_supported, "drain_s": round(took, 4),
            "verdict": asdict(verdict)}


async def check_release(monitor: GpuMonitor, python: str, mib: int, timeout_s: float,
                        slack_mib: int) -> dict[str, Any]:
    """A real tree that holds memory, killed; the appliance's own wait, timed."""
    wait = ReleaseWait(monitor, slack_mib)
    await wait.note_idle(timeout_s)
    try:
        tree = await asyncio.create_subprocess_exec(python, str(TORCH_SIDE), "hold", str(mib),
                                                    stdout=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        return {"ok": False, "error": f"cannot run {python}: {exc}"}
    assert tree.stdout is not None
    try:
        line = await asyncio.wait_for(tree.stdout.readline(), timeout_s)
        pids = set(json.loads(line)["pids"])
    except (TimeoutError, ValueError, KeyError) as exc:
        _kill_group(tree.pid)
        await tree.wait()
        return {"ok": False, "error": f"the torch tree never held memory: {exc!r}"}
    seen = await asyncio.to_thread(monitor.pids_using_memory)
    _kill_group(tree.pid)
    began = time.monotonic()
    released = await wait.wait(pids, timeout_s)
    took = time.monotonic() - began
    await tree.wait()
    return {"ok": released, "pids": sorted(pids), "nvml_listed": None if seen is None else sorted(seen),
            "host_pid_namespace": in_host_pid_namespace(), "released": released,
            "release_s": round(took, 3)}


async def check_template(python: str, mib: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(HERE)}  # smoke_preload, imported by name
    try:
        template = await TemplateProcess.launch(Path(python), (["torch", "smoke_preload"], []),
                                                False, env, timeout_s, timeout_s)
    except TemplateError as exc:
        failed = {"ok": False, "error": str(exc)}
        return {"template": failed, "worker": {"ok": False, "error": "no template"}}
    facts = template.facts
    report = {"template": {"ok": not facts.get("cuda_initialized"), "cuda": facts.get("cuda"),
                           "nvml_files": facts.get("nvml_files"), "threads": facts.get("threads"),
                           "import_s": facts.get("import_s")}}
    try:
        report["worker"] = await _forked_worker(template, python, mib, timeout_s)
    finally:
        await template.close()
    return report


async def _forked_worker(template: TemplateProcess, python: str, mib: int,
                         timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "worker.json"
        argv = [python, str(TORCH_SIDE), "worker", str(result), str(mib)]
        try:
            worker = await template.fork(argv, os.getcwd(), timeout_s)
        except TemplateError as exc:
            return {"ok": False, "error": str(exc)}
        try:
            returncode: int | None = await asyncio.wait_for(worker.wait(), timeout_s)
        except TimeoutError:
            returncode = None
        await worker.stop(1.0)
        if returncode != 0 or not result.exists():
            return {"ok": False, "returncode": returncode}
        seen: dict[str, Any] = json.loads(result.read_text())
    child = seen.get("child", {})
    wanted = mib * 1024 * 1024
    ok = (not seen["cuda_initialized_at_fork"] and seen.get("child_exitcode") == 0
          and child.get("allocated_bytes") == wanted and seen.get("worker_allocated_bytes") == wanted)
    return {"ok": ok, **seen}


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole tree has already ended
        os.killpg(pgid, signal.SIGKILL)


def _reading(reading: GpuReading) -> dict[str, Any]:
    return {key: value for key, value in asdict(reading).items() if key != "verdict"}


async def run(args: argparse.Namespace, nvml_module: Any = None) -> tuple[int, dict[str, Any]]:
    """Every check, in order; nvml_module: the seam for a fake NVML (default: pynvml)."""
    python = resolve_python(args.python)
    nvml, monitor = await asyncio.to_thread(check_nvml, args.device, nvml_module)
    if monitor is None:
        return EXIT_NO_GPU, {"result": "no GPU: NVML finds no NVIDIA GPU here", "nvml": nvml,
                             "python": python}
    report: dict[str, Any] = {"nvml": nvml, "python": python}
    try:
        report["xid_events"] = await asyncio.to_thread(check_xid_drain, monitor)
        if python["ok"]:
            report["release"] = await check_release(monitor, python["path"], args.mib,
                                                    args.release_timeout_s, args.release_slack_mib)
            report.update(await check_template(python["path"], args.mib, args.release_timeout_s))
    finally:
        monitor.close()
    failed = sorted(name for name, check in report.items() if not check.get("ok"))
    report["result"] = "failed: " + ", ".join(failed) if failed else "ok"
    return (EXIT_FAILED if failed else EXIT_OK), report
