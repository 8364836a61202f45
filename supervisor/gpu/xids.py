"""What an Xid asks for: NVIDIA's Xid catalog, by its resolution classes, in one table.

The classes are the catalog's "Resolution Bucket (Immediate Action)" for Ampere and newer
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): RESTART_APP, RESET_GPU,
RESTART_BM (reboot the machine), IGNORE (informational: recorded, no action). The appliance's
own actions follow from the class: restart the worker, or go `failed` with the operator's action
named, or log it. An Xid the table does not know restarts the worker: if the GPU itself is sick,
the restarted workers fail too and the crash-loop guard ends in `failed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Resolution = Literal["restart_app", "reset_gpu", "reboot", "informational"]

# Xid → (what it is, the catalog's immediate action).
# fmt: off
XIDS: dict[int, tuple[str, Resolution]] = {
    8: ("GPU stopped processing (idle timeout)", "restart_app"),
    11: ("invalid or corrupted push buffer stream", "restart_app"),
    13: ("graphics engine exception", "restart_app"),
    31: ("GPU memory page fault", "restart_app"),
    43: ("GPU stopped processing", "restart_app"),
    45: ("preemptive cleanup after previous errors", "informational"),
    48: ("double-bit ECC error", "reset_gpu"),
    61: ("internal micro-controller breakpoint", "reset_gpu"),
    62: ("internal micro-controller halt", "reset_gpu"),
    63: ("row remapping or page retirement recorded", "informational"),
    64: ("row remapping or page retirement failure", "reset_gpu"),
    68: ("video processor exception", "restart_app"),
    69: ("graphics engine class error", "restart_app"),
    74: ("NVLink error", "reset_gpu"),
    79: ("GPU has fallen off the bus", "reboot"),
    92: ("high single-bit ECC error rate", "informational"),
    94: ("contained ECC error", "restart_app"),
    95: ("uncontained ECC error", "reset_gpu"),
    109: ("context switch timeout", "restart_app"),
    119: ("GSP RPC timeout", "reset_gpu"),
    120: ("GSP error", "reset_gpu"),
}
# fmt: on

# What the operator must do for a class the appliance cannot cure by itself. Stopping the
# service first also closes the supervisor's NVML handle, which would keep `nvidia-smi -r` out.
OPERATOR_ACTIONS: dict[Resolution, str] = {
    "reset_gpu": "stop chat-appliance, reset the GPU (nvidia-smi -r -i {uuid}), start it again",
    "reboot": "reboot the machine",
}


@dataclass(frozen=True)
class XidClass:
    """One Xid, as the catalog classes it."""

    xid: int
    name: str
    resolution: Resolution

    @property
    def description(self) -> str:
        return f"xid {self.xid} ({self.name})"

    def operator_action(self, uuid: str | None) -> str | None:
        """What an operator must do, or None where the appliance handles it alone."""
        action = OPERATOR_ACTIONS.get(self.resolution)
        return None if action is None else action.format(uuid=uuid or "<gpu>")


def classify_xid(xid: int) -> XidClass:
    """The catalog's class of `xid`; an unknown Xid restarts the application (see above)."""
    name, resolution = XIDS.get(xid, ("not in the catalog table", "restart_app"))
    return XidClass(xid, name, resolution)
