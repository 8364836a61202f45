"""The manager's GPU view over the real monitor and a fake NVML: whose Xid is whose."""

from __future__ import annotations

import asyncio

from appliance.core.sections import GpuSettings
from supervisor.gpu.nvml import GpuMonitor
from supervisor.gpu.release import ReleaseWait
from supervisor.gpu.watch import GpuWatch
from supervisor.monitors.gpu import GpuHealthMonitor
from tests.unit.supervisor.gpu.fake_nvml import FakeClock, FakeGpu


def watch(gpu: FakeGpu, clock: FakeClock) -> GpuWatch:
    settings = GpuSettings(poll_interval_s=5.0)
    monitor = GpuMonitor(settings, gpu.module())
    monitor.open()
    return GpuWatch(monitor, settings, ReleaseWait(monitor, 256, host_pids=True), clock=clock)


def test_a_faulted_workers_xid_does_not_restart_its_successor() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    view = watch(gpu, clock)

    async def lives() -> list[str]:
        await view.check()  # worker A's first look
        clock.now += 5
        gpu.xid(13)
        seen = [(await view.check())[0]]  # A faulted: restart it
        seen.append(str(await view.settle()))  # A stopped
        view.new_worker()  # B spawned, within the same poll interval
        seen.append((await view.check())[0])
        clock.now += 5
        seen.append((await view.check())[0])
        return seen

    assert asyncio.run(lives()) == ["restart_worker", "None", "none", "none"]


def test_an_xid_that_arrives_between_workers_is_the_ended_ones() -> None:
    """Late from the dead worker (after its stop, before the new one's first look)."""
    gpu, clock = FakeGpu(), FakeClock()
    view = watch(gpu, clock)
    monitor = GpuHealthMonitor(view)

    async def lives() -> list[str]:
        await view.check()
        gpu.xid(31)  # queued while A's tree was being killed
        seen = [str(await view.settle())]
        gpu.xid(43)  # queued after the settle, just as B is spawned
        monitor.reset()
        seen.append((await view.check())[0])
        return seen

    assert asyncio.run(lives()) == ["None", "none"]


def test_an_ended_workers_xid_that_needs_a_reset_stops_the_next_start() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    view = watch(gpu, clock)
    gpu.xid(48)
    cause = asyncio.run(view.settle())
    assert cause is not None and "xid 48" in cause and "nvidia-smi -r" in cause
