"""The GPU reservation sized to the real bundled model (its config.json and safetensors) and
to the memory free, with fake GPU memory readings."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.core.sections import GpuSettings, default_model
from appliance.core.settings import Settings
from supervisor.engine.gpu_budget import (
    GIB,
    GpuMemory,
    ModelShape,
    ModelShapeError,
    plan,
    read_model_shape,
)
from supervisor.engine.stack import worker_settings
from supervisor.engine.worker import build_command
from supervisor.serve import size_gpu_reservation

H200 = GpuMemory(total_bytes=int(139.8 * GIB), free_bytes=int(139.2 * GIB))


@pytest.fixture
def shape() -> ModelShape:
    return read_model_shape(Path(default_model()), None)


def test_the_bundled_models_shape_from_its_config_and_weights(shape: ModelShape) -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, a float32 checkpoint run in bfloat16 on a GPU.
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes) == (30, 3, 64, 2)
    assert shape.max_window == 8192 and shape.kv_bytes_per_token == 23040
    assert shape.weights_bytes == (Path(default_model()) / "model.safetensors").stat().st_size


def test_an_explicit_dtype_sizes_the_kv_cache(shape: ModelShape) -> None:
    assert read_model_shape(Path(default_model()), "float32").kv_bytes_per_token == 46080


def test_an_h200_reserves_what_the_small_model_needs_not_nine_tenths(shape: ModelShape) -> None:
    chosen = plan(Settings(), shape, H200)
    assert chosen.limited_by == "model" and chosen.fits
    # weights + 64 windows of 8192 tokens + 2 GiB: about 14.8 GB, not 127 GB.
    assert chosen.needed_bytes == shape.weights_bytes + 2 * GIB + 64 * 8192 * 23040
    assert chosen.reserved_bytes >= chosen.needed_bytes
    assert chosen.utilization < 0.11


def test_a_desktop_gpu_with_2_4_gb_in_use_boots(shape: ModelShape) -> None:
    memory = GpuMemory(total_bytes=8 * GIB, free_bytes=int(5.6 * GIB))
    chosen = plan(Settings(), shape, memory)
    assert chosen.limited_by == "free memory" and chosen.boots and not chosen.fits
    assert chosen.reserved_bytes <= memory.free_bytes - GIB  # room for the worker's CUDA context


def test_never_more_than_the_stated_share(shape: ModelShape) -> None:
    settings = Settings(engine={"kv_budget_sequences": 1000, "gpu_memory_max_share": 0.5})
    chosen = plan(settings, shape, H200)
    assert chosen.limited_by == "max share" and chosen.utilization == 0.5


def test_the_window_and_concurrency_settings_size_the_kv_budget(shape: ModelShape) -> None:
    chosen = plan(Settings(engine={"max_model_len": 2048, "max_num_seqs": 8}), shape, H200)
    assert (chosen.window, chosen.sequences) == (2048, 8)
    assert chosen.kv_budget_bytes == 2048 * 8 * 23040


def test_an_operators_value_wins(shape: ModelShape) -> None:
    chosen = plan(Settings(engine={"gpu_memory_utilization": 0.7}), shape, H200)
    assert chosen.utilization == 0.7 and chosen.limited_by == "operator"


def test_a_model_without_a_config_cannot_be_sized(tmp_path: Path) -> None:
    with pytest.raises(ModelShapeError):
        read_model_shape(tmp_path, None)


def test_serve_passes_the_sized_share_to_vllm_on_a_gpu() -> None:
    settings = Settings(engine={"device": "cuda"})

    def memory(_: GpuSettings) -> GpuMemory:
        return H200

    reservation = size_gpu_reservation(settings, memory)
    assert reservation is not None
    args = build_command(worker_settings(settings, reservation))
    assert args[args.index("--gpu-memory-utilization") + 1] == str(reservation.utilization)


def test_serve_sizes_nothing_on_the_cpu() -> None:
    def memory(_: GpuSettings) -> GpuMemory:
        raise AssertionError("NVML is not asked on the CPU")

    assert size_gpu_reservation(Settings(engine={"device": "cpu"}), memory) is None


def test_concurrency_is_what_the_reservation_holds_beyond_weights_and_overhead(
        shape: ModelShape) -> None:
    """In vLLM's terms: full windows at once ("Maximum concurrency for N tokens per request")."""
    chosen = plan(Settings(engine={"kv_budget_sequences": 1000, "gpu_memory_max_share": 0.5}),
                  shape, H200)
    kv = chosen.reserved_bytes - chosen.weights_bytes - 2 * GIB
    assert chosen.concurrency == kv / (8192 * 23040) and chosen.budget_required
    assert chosen.window_within(chosen.minimum_bytes) == chosen.window == 8192
    assert chosen.window_within(chosen.weights_bytes) == 0
    assert not plan(Settings(), shape, H200).budget_required
