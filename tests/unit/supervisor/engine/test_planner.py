"""The reservation planner: each model's reservation (on the CPU its KV cache and weights on
disk; on a GPU gpu_budget's sized share of the card's total, from a fake NVML reading) against
a capacity, and the start-up refusal of a model that can never be loaded."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.core.catalog import Catalog, ResidencySettings
from appliance.core.sections import GpuSettings, default_model
from appliance.core.settings import Settings
from supervisor.engine.gpu_budget import CONTEXT_HEADROOM_BYTES, GIB, GpuMemory
from supervisor.engine.planner import MemoryPlan, PlanError, plan_memory
from supervisor.engine.worker import CPU_KV_CACHE_BYTES
from supervisor.serve import size_gpu_reservation
from tests.support.stack import ROOT

MIB = 1024**2
H100 = GpuMemory(total_bytes=80 * GIB, free_bytes=79 * GIB)


def model_dir(root: Path, name: str, weights: int) -> Path:
    """A model directory whose safetensors files hold `weights` bytes (sparse files)."""
    path = root / name
    path.mkdir()
    with (path / "model-00001-of-00002.safetensors").open("wb") as part:
        part.truncate(weights // 2)
    with (path / "model-00002-of-00002.safetensors").open("wb") as part:
        part.truncate(weights - weights // 2)
    return path


def cpu_catalog(tmp_path: Path, **residency: int) -> tuple[Catalog, ResidencySettings]:
    settings = Settings(engine={"device": "cpu"}, residency=residency, models={
        "a": {"path": str(model_dir(tmp_path, "a", 300 * MIB))},
        "b": {"path": str(model_dir(tmp_path, "b", 100 * MIB)), "kv_cache_memory_bytes": 64 * MIB,
              "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}},
        "c": {"path": str(model_dir(tmp_path, "c", 100 * MIB)), "kv_cache_memory_bytes": 64 * MIB},
    })
    return Catalog.from_settings(settings), settings.residency


def no_nvml(_: GpuSettings) -> GpuMemory:
    raise AssertionError("NVML is not asked on the CPU")


def test_on_the_cpu_a_reservation_is_the_kv_cache_and_the_weights_on_disk(tmp_path: Path) -> None:
    catalog, residency = cpu_catalog(tmp_path)
    plan = plan_memory(catalog, residency, GpuSettings(), {}, read_memory=no_nvml,
                       host_available=lambda: 6 * GIB)
    assert plan is not None
    assert plan.reservations == {
        "a": CPU_KV_CACHE_BYTES + 300 * MIB,  # [engine]'s default KV cache on the CPU
        "b": 2 * GIB + 100 * MIB,  # VLLM_CPU_KVCACHE_SPACE is over the flag in vLLM's CPU platform
        "c": 64 * MIB + 100 * MIB,
    }
    assert (plan.capacity_bytes, plan.capacity_from) == (6 * GIB, "the host memory available "
                                                                   "at start")


def test_residency_memory_bytes_is_the_capacity_when_set(tmp_path: Path) -> None:
    catalog, residency = cpu_catalog(tmp_path, memory_bytes=3 * GIB)
    plan = plan_memory(catalog, residency, GpuSettings(), {}, host_available=lambda: 64 * GIB)
    assert plan is not None and plan.capacity_bytes == 3 * GIB
    assert plan.fits(["a", "b"]) and not plan.fits(["a", "b", "c"])


def gpu_plan(memory: GpuMemory | None, **models: dict[str, object]) -> MemoryPlan | None:
    settings = Settings(engine={"device": "cuda"}, models={
        name: {"path": default_model(), **table} for name, table in models.items()})
    catalog = Catalog.from_settings(settings)

    def nvml(_: GpuSettings) -> GpuMemory | None:
        return memory

    sized = {entry.name: size_gpu_reservation(entry.settings(settings), nvml)
             for entry in catalog}
    return plan_memory(catalog, settings.residency, settings.gpu, sized, read_memory=nvml)


def test_on_a_gpu_a_reservation_is_the_sized_share_of_the_cards_total() -> None:
    plan = gpu_plan(H100, a={"gpu_memory_max_share": 0.5, "kv_budget_sequences": 10_000},
                    b={"gpu_memory_utilization": 0.3}, c={})
    assert plan is not None and plan.capacity_bytes == 80 * GIB
    assert plan.reservations["a"] == math.floor(0.5 * 80 * GIB) + CONTEXT_HEADROOM_BYTES
    assert plan.reservations["b"] == math.floor(0.3 * 80 * GIB) + CONTEXT_HEADROOM_BYTES
    # c: what the small model needs (about 14.8 GB for 64 windows), not the 0.9 max share.
    assert 14 * GIB < plan.reservations["c"] < 16 * GIB
    assert plan.fits(["a", "b"]) and not plan.fits(["a", "b", "c"])


def test_on_a_gpu_nvml_without_a_reading_leaves_no_plan() -> None:
    assert gpu_plan(None, a={}, b={}) is None


def test_a_gpu_model_that_cannot_be_sized_is_planned_to_load_alone(tmp_path: Path) -> None:
    settings = Settings(engine={"device": "cuda"}, models={
        "a": {"path": default_model()}, "b": {"path": str(tmp_path)}})  # b: no config.json
    catalog = Catalog.from_settings(settings)
    sized = {entry.name: size_gpu_reservation(entry.settings(settings), lambda _: H100)
             for entry in catalog}
    assert sized["b"] is None
    plan = plan_memory(catalog, settings.residency, settings.gpu, sized,
                       read_memory=lambda _: H100)
    assert plan is not None and plan.reservations["b"] == plan.capacity_bytes


def test_a_model_over_the_capacity_alone_is_refused_naming_it(tmp_path: Path) -> None:
    catalog, residency = cpu_catalog(tmp_path, memory_bytes=GIB)
    plan = plan_memory(catalog, residency, GpuSettings(), {})
    assert plan is not None
    with pytest.raises(PlanError, match=r"models\.b reserves 2\.10 GiB.*residency\.memory_bytes"):
        plan.check(catalog)


def test_a_model_that_cannot_fit_beside_the_pinned_ones_is_refused(tmp_path: Path) -> None:
    catalog, residency = cpu_catalog(tmp_path, memory_bytes=2 * GIB + 400 * MIB)
    plan = plan_memory(catalog, residency, GpuSettings(), {})
    assert plan is not None and plan.fits(["b"]) and plan.fits(["a", "c"])
    with pytest.raises(PlanError, match=r"models a, b reserve .* pinned = false"):
        plan.check(catalog)  # a, the default, is pinned
    unpinned = [entry for entry in catalog if entry.name != "a"]
    plan.check(unpinned)


def test_serve_refuses_a_model_that_can_never_be_loaded_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"""
[engine]
device = "cpu"
command = ["true"]
[residency]
memory_bytes = {600 * MIB}
[models.small]
path = "{model_dir(tmp_path, "small", 10 * MIB)}"
kv_cache_memory_bytes = {64 * MIB}
[models.big]
path = "{model_dir(tmp_path, "big", 700 * MIB)}"
kv_cache_memory_bytes = {64 * MIB}
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")}
    env["CHAT_APPLIANCE_CONFIG"] = str(config)
    result = subprocess.run([sys.executable, "-m", "supervisor.main", "serve"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "models.big reserves 0.75 GiB" in result.stdout + result.stderr
