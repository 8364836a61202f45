"""What the engine will take from this box: GPU memory (the sized reservation), disk, ports."""

from __future__ import annotations

from pathlib import Path

from appliance.settings import Settings
from supervisor.doctor.box import Box
from supervisor.doctor.driver import engine_is_gpu
from supervisor.doctor.report import Finding, blocker, ok, skip, warning
from supervisor.engine.gpu_budget import GIB, ModelShapeError, plan, read_model_shape

GPU_MEMORY = "gpu-memory"
DISK = "disk"
PORTS = "ports"
MIB = 1024**2


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def check_gpu_memory(box: Box, settings: Settings) -> Finding:
    """The reservation `serve` will choose, against the memory free now (transient: another
    process may free it)."""
    engine = settings.engine
    if not engine_is_gpu(box, engine):
        return skip(GPU_MEMORY, "no GPU: CPU engine")
    memory = box.gpu_memory(settings.gpu)
    if memory is None:
        return blocker(GPU_MEMORY, f"NVML cannot read GPU {settings.gpu.device}'s memory",
                       "nvidia-smi must work; check gpu.device and the driver", lasting=False)
    try:
        shape = read_model_shape(Path(engine.model), engine.dtype)
    except ModelShapeError as exc:
        return warning(GPU_MEMORY, f"cannot size the reservation: {exc}",
                       "set engine.gpu_memory_utilization yourself")
    chosen = plan(settings, shape, memory)
    shown = (f"reserve {_gib(chosen.reserved_bytes)} ({chosen.utilization:g} of "
             f"{_gib(memory.total_bytes)}, {_gib(memory.free_bytes)} free; limited by "
             f"{chosen.limited_by}): weights {_gib(chosen.weights_bytes)} + KV "
             f"{_gib(chosen.kv_budget_bytes)} for {chosen.sequences} x {chosen.window} tokens")
    detail = chosen.as_dict()
    if chosen.reserved_bytes > memory.free_bytes or not chosen.boots:
        return blocker(GPU_MEMORY, f"{shown}: not enough for one full window "
                       f"({_gib(chosen.minimum_bytes)})",
                       "free GPU memory (nvidia-smi shows who holds it) or lower "
                       "engine.max_model_len", lasting=False, **detail)
    if not chosen.fits:
        return warning(GPU_MEMORY, f"{shown}: KV cache smaller than the budget, fewer "
                       "sequences at once", "free GPU memory, or lower engine.kv_budget_sequences"
                       " / engine.max_model_len", **detail)
    return ok(GPU_MEMORY, shown, **detail)


def check_disk(box: Box, settings: Settings) -> Finding:
    where = settings.engine.resolved_cache_dir()
    free = box.disk_free_bytes(where)
    need = settings.doctor.min_free_disk_mib * MIB
    shown = f"{free // MIB} MiB free under {where}"
    if free < need:
        return warning(DISK, f"{shown}, less than doctor.min_free_disk_mib "
                       f"({settings.doctor.min_free_disk_mib})",
                       "free some space: compiled kernels and caches are written there")
    return ok(DISK, shown, free_bytes=free)


def check_ports(box: Box, settings: Settings) -> Finding:
    """Busy is a warning: the appliance itself may be the one holding them."""
    wanted = {"API": (settings.server.host, settings.server.port),
              "worker": (settings.engine.host, settings.engine.port)}
    busy = [f"{name} {host}:{port}" for name, (host, port) in wanted.items()
            if not box.port_free(host, port)]
    if busy:
        return warning(PORTS, f"in use: {', '.join(busy)}",
                       "stop what listens there (ss -ltnp), unless it is this appliance, "
                       "or change server.port / engine.port")
    return ok(PORTS, ", ".join(f"{name} {h}:{p}" for name, (h, p) in wanted.items()) + " free")
