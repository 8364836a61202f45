"""GPU memory against the sized reservation, disk space, ports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.core.sections import default_model
from appliance.core.settings import Settings
from supervisor.doctor.report import Level
from supervisor.doctor.resources import check_disk, check_gpu_memory, check_ports
from supervisor.engine.gpu_budget import GIB, GpuMemory
from tests.unit.supervisor.doctor.fakes import FakeBox, engine_venv, gpu_box


def _gpu_settings(tmp_path: Path) -> Settings:
    engine = engine_venv(tmp_path, "13.0").model_copy(update={"model": default_model()})
    return Settings(engine=engine)


def test_a_desktop_gpu_with_a_screen_on_it_boots_the_bundled_model(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=24 * GIB, free_bytes=int(21.6 * GIB))
    finding = check_gpu_memory(box, _gpu_settings(tmp_path))
    assert finding.level is Level.OK, finding.message
    assert finding.detail["limited_by"] == "model" and finding.detail["utilization"] < 0.9


def test_too_little_free_for_one_window_is_a_blocker_a_restart_may_cure(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=8 * GIB, free_bytes=2 * GIB)
    finding = check_gpu_memory(box, _gpu_settings(tmp_path))
    assert finding.level is Level.BLOCKER and not finding.refuses_start


def test_less_free_than_the_kv_budget_is_a_warning(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=8 * GIB, free_bytes=6 * GIB)
    finding = check_gpu_memory(box, _gpu_settings(tmp_path))
    assert finding.level is Level.WARNING and finding.detail["limited_by"] == "free memory"


def test_nvml_without_a_reading_is_a_blocker(tmp_path: Path) -> None:
    finding = check_gpu_memory(gpu_box(tmp_path / "root"), _gpu_settings(tmp_path))
    assert finding.level is Level.BLOCKER


def test_gpu_memory_on_a_cpu_box_is_skipped(tmp_path: Path) -> None:
    assert check_gpu_memory(FakeBox(root=tmp_path), Settings()).level is Level.SKIP


@pytest.mark.parametrize(("free_mib", "level"), [(4096, Level.OK), (100, Level.WARNING)])
def test_disk_space_under_the_cache_directory(free_mib: int, level: Level, tmp_path: Path) -> None:
    box = FakeBox(root=tmp_path, free_disk=free_mib * 1024**2)
    assert check_disk(box, Settings()).level is level


def test_a_busy_port_is_a_warning_naming_it(tmp_path: Path) -> None:
    box = FakeBox(root=tmp_path, busy_ports={8100})
    finding = check_ports(box, Settings())
    assert finding.level is Level.WARNING and "worker 127.0.0.1:8100" in finding.message
    assert check_ports(FakeBox(root=tmp_path), Settings()).level is Level.OK


# Model shapes as their config.json say, with sparse weights files of their real size.
LLAMA_8B = ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
            16_060_522_240)
LLAMA_70B = ({"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "hidden_size": 8192, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
             141_107_412_992)
H200 = GpuMemory(total_bytes=int(139.8 * GIB), free_bytes=int(139.2 * GIB))


def _model(tmp_path: Path, shape: tuple[dict[str, object], int], **engine: object) -> Settings:
    config, weights = shape
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    with (model / "model.safetensors").open("wb") as sparse:
        sparse.truncate(weights)
    settings = engine_venv(tmp_path, "13.0").model_copy(update={"model": str(model), **engine})
    return Settings(engine=settings)


def _on(tmp_path: Path, memory: GpuMemory) -> FakeBox:
    box = gpu_box(tmp_path / "root")
    box.memory = memory
    return box


def test_the_bundled_small_model_on_an_h200_is_ok_with_its_whole_budget(tmp_path: Path) -> None:
    finding = check_gpu_memory(_on(tmp_path, H200), _gpu_settings(tmp_path))
    assert finding.level is Level.OK, finding.message
    assert finding.detail["fits"] and finding.detail["limited_by"] == "model"


def test_an_8b_model_with_its_128k_window_on_an_h200_is_ok(tmp_path: Path) -> None:
    """64 full windows would be 1 TiB of KV; vLLM needs one: the share holds 6.8 of them."""
    finding = check_gpu_memory(_on(tmp_path, H200), _model(tmp_path, LLAMA_8B))
    assert finding.level is Level.OK, finding.message
    assert finding.detail["limited_by"] == "max share" and not finding.detail["fits"]
    assert 6.5 < finding.detail["concurrency"] < 7
    assert "6.8" in finding.message and "131072 tokens" in finding.message


def test_an_8b_model_beside_another_processs_memory_is_a_warning(tmp_path: Path) -> None:
    busy = GpuMemory(total_bytes=H200.total_bytes, free_bytes=60 * GIB)
    finding = check_gpu_memory(_on(tmp_path, busy), _model(tmp_path, LLAMA_8B))
    assert finding.level is Level.WARNING and finding.detail["limited_by"] == "free memory"
    assert "other processes hold 79.80 GiB" in finding.message
    assert finding.fix.startswith("free GPU memory")


def test_an_explicit_kv_budget_that_does_not_fit_is_a_warning(tmp_path: Path) -> None:
    settings = _model(tmp_path, LLAMA_8B, kv_budget_sequences=16)
    finding = check_gpu_memory(_on(tmp_path, H200), settings)
    assert finding.level is Level.WARNING
    assert "lower engine.kv_budget_sequences to 6" in finding.fix


def test_a_70b_model_larger_than_the_share_names_what_helps(tmp_path: Path) -> None:
    """Its 131 GiB of bf16 weights exceed 0.9 of an H200: a shorter window cannot help."""
    finding = check_gpu_memory(_on(tmp_path, H200), _model(tmp_path, LLAMA_70B))
    assert finding.level is Level.BLOCKER and finding.lasting
    assert "a quantized checkpoint: the weights and overhead alone (133.42 GiB) exceed the " \
        "125.82 GiB reserved" in finding.fix
    assert "a GPU with 192.69 GiB or more" in finding.fix
    assert "raise engine.gpu_memory_max_share to 0.98 with engine.max_model_len 11755 " in finding.fix
    assert "or lower engine.max_model_len" not in finding.fix


def test_a_window_too_long_for_the_card_names_the_window_that_fits(tmp_path: Path) -> None:
    desktop = GpuMemory(total_bytes=24 * GIB, free_bytes=int(23.5 * GIB))
    finding = check_gpu_memory(_on(tmp_path, desktop), _model(tmp_path, LLAMA_8B))
    assert finding.level is Level.BLOCKER
    assert "lower engine.max_model_len to 38031 or less" in finding.fix  # 4.6 GiB of 128 KiB
    assert "quantized" not in finding.fix
