"""What one NVML poll found, and the verdict the manager acts on (Xids: supervisor/gpu/xids.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Action = Literal["none", "restart_worker", "fail"]
Status = Literal["disabled", "unavailable", "ok", "unhealthy", "lost"]

# Clock-event reason bits (NVML ABI, the same under the older "ClocksThrottleReason" names).
_SLOWDOWN_NAMES = {
    0x04: "sw_power_cap", 0x08: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
    0x80: "hw_power_brake",
}  # fmt: skip
_THERMAL_BITS = 0x20 | 0x40
_POWER_BITS = 0x04 | 0x80


@dataclass(frozen=True)
class GpuVerdict:
    """What the engine manager should do about the GPU, and why."""

    action: Action = "none"
    cause: str = ""


@dataclass(frozen=True)
class GpuReading:
    """One poll. None: NVML does not support that query on this GPU (or it failed)."""

    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    clock_event_reasons: int | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    xids: tuple[int, ...] = ()
    verdict: GpuVerdict = field(default_factory=GpuVerdict)

    @property
    def thermal_slowdown(self) -> bool:
        return bool((self.clock_event_reasons or 0) & _THERMAL_BITS)

    @property
    def power_slowdown(self) -> bool:
        return bool((self.clock_event_reasons or 0) & _POWER_BITS)

    @property
    def slowdown_reasons(self) -> tuple[str, ...]:
        mask = self.clock_event_reasons or 0
        return tuple(name for bit, name in _SLOWDOWN_NAMES.items() if mask & bit)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Conditions worth an operator's look that call for no action by the appliance."""
        found = (
            ("thermal_slowdown", self.thermal_slowdown),
            ("retired_pages_pending", bool(self.retired_pages_pending)),
            ("row_remap_pending", bool(self.row_remap_pending)),
        )
        return tuple(name for name, present in found if present)
