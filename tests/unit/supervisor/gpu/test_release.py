"""The release wait after a stop: which processes count, and NVML never on the event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from appliance.core.sections import GpuSettings
from supervisor.gpu.nvml import GpuMonitor
from supervisor.gpu.release import ReleaseWait, in_host_pid_namespace
from tests.unit.supervisor.gpu.fake_nvml import (
    BLOCK_LIMIT_S,
    GIB,
    FakeClock,
    FakeGpu,
    NVMLError_NoPermission,
)


def opened(gpu: FakeGpu) -> GpuMonitor:
    monitor = GpuMonitor(GpuSettings(), gpu.module())
    monitor.open()
    return monitor


def waiter(gpu: FakeGpu, clock: FakeClock, *, host_pids: bool = True,
           interval_s: float = 0.5) -> ReleaseWait:
    return ReleaseWait(opened(gpu), 256, host_pids=host_pids, sleep=clock.sleep, clock=clock,
                       interval_s=interval_s)


def test_returns_once_the_pids_are_gone() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    gpu.process_pids = [[4242, 999], [4242, 999], [4242, 999], [999]]
    assert asyncio.run(waiter(gpu, clock).wait({4242}, 30.0)) is True
    assert clock.sleeps == [0.5, 0.5, 0.5]  # released on the fourth look; pid 999 is not ours


def test_times_out_when_never_released() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    gpu.process_pids = [[4242]]
    with capture_logs() as logs:
        released = asyncio.run(waiter(gpu, clock, interval_s=0.75).wait({4242}, 2.0))
    assert released is False
    assert clock.sleeps == [0.75, 0.75, 0.5]  # the last sleep ends at the deadline
    assert logs[-1]["event"] == "gpu.memory_not_released"
    assert logs[-1]["holding"] == "pids [4242]"


def test_in_a_container_the_processes_new_since_idle_are_waited_for() -> None:
    """NVML says host PIDs; the supervisor's pid namespace numbers the worker 100 and 101."""
    gpu, clock = FakeGpu(), FakeClock()
    gpu.process_pids = [[7001], [7001, 913100, 913101], [7001, 913101], [7001]]

    async def scenario() -> bool:
        wait = waiter(gpu, clock, host_pids=False)
        await wait.note_idle(5.0)  # 7001: another job's, there before the worker
        return await wait.wait({100, 101}, 30.0)

    assert asyncio.run(scenario()) is True
    assert clock.sleeps == [0.5, 0.5]


def test_where_nvml_refuses_the_listing_the_used_memory_is_waited_for() -> None:
    """MIG as a user other than root: no process list, so the GPU's used memory must come
    back to within the slack of what it was before the worker."""
    gpu, clock = FakeGpu(), FakeClock()
    gpu.fail["nvmlDeviceGetComputeRunningProcesses"] = NVMLError_NoPermission
    gpu.fail["nvmlDeviceGetComputeRunningProcesses_v2"] = NVMLError_NoPermission
    gpu.memory_used = [2 * GIB, 60 * GIB, 30 * GIB, 2 * GIB + 100 * 1024**2]

    async def scenario() -> bool:
        wait = waiter(gpu, clock)
        await wait.note_idle(5.0)
        return await wait.wait({100}, 30.0)

    assert asyncio.run(scenario()) is True
    assert clock.sleeps == [0.5, 0.5]


def test_a_blocking_nvml_call_never_freezes_the_event_loop() -> None:
    """A sick GPU's NVML call blocks; the loop must keep turning (API, /livez, watchdog)."""
    gpu, clock = FakeGpu(), FakeClock()
    gpu.process_pids = [[]]
    wait = waiter(gpu, clock)
    gpu.block = threading.Event()

    async def scenario() -> bool:
        task = asyncio.create_task(wait.wait({4242}, 30.0))
        # This coroutine runs while the call blocks and only then lets it answer: with the
        # call on the loop, nothing would run until the fake gave up (`unblocked` False).
        assert await asyncio.to_thread(gpu.blocking.wait, BLOCK_LIMIT_S)
        assert gpu.block is not None
        gpu.block.set()
        return await task

    assert asyncio.run(scenario()) is True
    assert gpu.unblocked and all(gpu.unblocked)


def test_the_host_pid_namespace_is_recognised(tmp_path: Path) -> None:
    assert in_host_pid_namespace(str(tmp_path / "absent")) is True
    expected = os.stat("/proc/self/ns/pid").st_ino == 0xEFFFFFFC
    assert in_host_pid_namespace() is expected


@pytest.mark.parametrize("host_pids", [True, False])
def test_nothing_to_wait_for_on_an_idle_gpu(host_pids: bool) -> None:
    gpu, clock = FakeGpu(), FakeClock()
    assert asyncio.run(waiter(gpu, clock, host_pids=host_pids).wait({1}, 5.0)) is True
    assert clock.sleeps == []
