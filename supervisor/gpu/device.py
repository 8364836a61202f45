"""Which GPU the worker uses: the one the NVML monitor watches, named so CUDA agrees.

NVML numbers GPUs in PCI bus order; CUDA, by default, fastest first, and after
CUDA_VISIBLE_DEVICES. A worker given `gpu.device` as an index could run on another GPU than
the one watched. The worker is therefore given the GPU by its UUID (which both agree on) where
the monitor found it, and CUDA's order is set to NVML's for an index that is passed as is.
"""

from __future__ import annotations

from appliance.core.sections import GpuSettings


def device_env(settings: GpuSettings, uuid: str | None) -> dict[str, str]:
    """The worker's CUDA device selection; engine.env, set by the operator, wins over it."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": uuid or settings.device.strip()}
