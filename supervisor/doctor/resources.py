"""What the engine will take from this box: GPU memory (the sized reservation), disk, ports."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from appliance.core.catalog import Catalog
from appliance.core.sections import EngineSettings
from appliance.core.settings import Settings
from supervisor.doctor.box import Box
from supervisor.doctor.driver import engine_is_gpu
from supervisor.doctor.report import Finding, blocker, ok, skip, warning
from supervisor.engine.gpu_budget import (
    CONTEXT_HEADROOM_BYTES,
    GIB,
    ModelShapeError,
    Reservation,
    plan,
    read_model_shape,
)
from supervisor.engine.planner import MemoryPlan, PlanError

GPU_MEMORY = "gpu-memory"
DISK = "disk"
PORTS = "ports"
MIB = 1024**2
MIN_WINDOW = 16  # the least engine.max_model_len takes
HOLDERS = "nvidia-smi shows who holds it"


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
             f"{chosen.limited_by}): weights {_gib(chosen.weights_bytes)}, KV for "
             f"{chosen.concurrency:.2f} windows of {chosen.window} tokens at once "
             f"({chosen.sequences} aimed at)")
    detail = chosen.as_dict()
    if chosen.reserved_bytes > memory.free_bytes or not chosen.boots:
        return blocker(GPU_MEMORY, f"{shown}: not enough for one full window "
                       f"({_gib(chosen.minimum_bytes)})", _blocker_fix(chosen, engine),
                       lasting=_lasting(chosen), **detail)
    if chosen.fits or not (chosen.budget_required or chosen.limited_by == "free memory"):
        return ok(GPU_MEMORY, shown, **detail)  # vLLM's one window fits; the rest is concurrency
    if chosen.limited_by == "free memory":
        return warning(GPU_MEMORY, f"{shown}: other processes hold "
                       f"{_gib(memory.total_bytes - memory.free_bytes)}, so fewer sequences fit "
                       "at once", f"free GPU memory ({HOLDERS})", **detail)
    return warning(GPU_MEMORY, f"{shown}: fewer than engine.kv_budget_sequences",
                   f"lower engine.kv_budget_sequences to {math.floor(chosen.concurrency)} "
                   "or engine.max_model_len, or leave kv_budget_sequences unset", **detail)


def check_models_gpu_memory(box: Box, settings: Settings) -> list[Finding]:
    """check_gpu_memory for each model of the catalog, with its own settings (one model: that
    alone); with several, the reservation planner's judgement of the sized reservations: a
    model that can never be loaded (alone, or beside the pinned ones) is a blocker, as it stops
    `serve`; models that do not all fit are swapped by residency, which this says."""
    catalog = Catalog.from_settings(settings)
    if len(catalog) == 1:
        return [check_gpu_memory(box, settings)]
    findings = [_of_model(check_gpu_memory(box, entry.settings(settings)), entry.name)
                for entry in catalog]
    sized = {f.detail["model"]: f.detail["reserved_bytes"] + CONTEXT_HEADROOM_BYTES
             for f in findings if "reserved_bytes" in f.detail}
    if len(sized) < len(findings):
        return findings  # a model that cannot be sized (or no GPU): said in its own finding
    total, free = findings[0].detail["total_bytes"], findings[0].detail["free_bytes"]
    memory = settings.residency.memory_bytes
    capacity = MemoryPlan(memory or total, "residency.memory_bytes" if memory else
                          "the GPU's total memory", sized)
    try:
        capacity.check(catalog)
    except PlanError as error:
        return [*findings, blocker(GPU_MEMORY, str(error), "see the message")]
    largest = sorted(sized, key=sized.__getitem__, reverse=True)
    at_once = largest[:settings.residency.max_loaded or len(largest)]
    reserved = capacity.reserved(at_once)
    shown = (f"the {len(at_once)} largest models reserve {_gib(reserved)} "
             f"({reserved / total:.2f} of {_gib(total)}, {_gib(free)} free)")
    if not capacity.fits(at_once):
        return [*findings, ok(GPU_MEMORY, f"{shown}: more than the capacity, so residency "
                                          "swaps them (docs/models.md, Residency)")]
    if reserved > free:
        return [*findings, warning(GPU_MEMORY, f"{shown}: other processes hold the rest",
                                   f"free GPU memory ({HOLDERS}) or lower residency.max_loaded")]
    return [*findings, ok(GPU_MEMORY, f"{shown}: they fit together")]


def _of_model(finding: Finding, name: str) -> Finding:
    return dataclasses.replace(finding, message=f"model {name}: {finding.message}",
                               detail=finding.detail | {"model": name})


def _lasting(chosen: Reservation) -> bool:
    """A restart cannot cure it unless memory another process holds is the limit."""
    return chosen.reserved_bytes <= chosen.free_bytes and chosen.limited_by != "free memory"


def _blocker_fix(chosen: Reservation, engine: EngineSettings) -> str:
    """What would make one full window fit, each with its number."""
    if chosen.reserved_bytes > chosen.free_bytes:
        return f"free GPU memory ({HOLDERS}) or lower engine.gpu_memory_utilization"
    fixes = [f"free GPU memory ({HOLDERS})"] if chosen.limited_by == "free memory" else []
    window = chosen.window_within(chosen.reserved_bytes)
    if window >= MIN_WINDOW:
        fixes.append(f"lower engine.max_model_len to {window} or less")
    else:
        fixes.append(f"a quantized checkpoint: the weights and overhead alone "
                     f"({_gib(chosen.weights_bytes + chosen.overhead_bytes)}) exceed the "
                     f"{_gib(chosen.reserved_bytes)} reserved (FP8 halves bf16 weights, 4-bit "
                     "AWQ or GPTQ quarter them)")
    share = chosen.utilization if chosen.limited_by == "operator" else engine.gpu_memory_max_share
    fixes.append(f"a GPU with {_gib(math.ceil(chosen.minimum_bytes / share))} or more")
    return "; or ".join(fixes + _share_fix(chosen))


def _share_fix(chosen: Reservation) -> list[str]:
    """Where the share, not the card, is the limit: the share that would do, if the memory
    free now (less the worker's CUDA context) allows it."""
    names = {"max share": "engine.gpu_memory_max_share", "operator": "engine.gpu_memory_utilization"}
    if chosen.limited_by not in names:
        return []
    room = chosen.free_bytes - CONTEXT_HEADROOM_BYTES
    wanted = math.ceil(chosen.minimum_bytes / chosen.total_bytes * 100) / 100
    if wanted * chosen.total_bytes <= room:
        return [f"raise {names[chosen.limited_by]} to {wanted:g}"]
    most = math.floor(room / chosen.total_bytes * 100) / 100
    window = chosen.window_within(math.floor(most * chosen.total_bytes))
    if most <= chosen.utilization or window < MIN_WINDOW:
        return []
    return [f"raise {names[chosen.limited_by]} to {most:g} with engine.max_model_len "
            f"{window} or less"]


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
