"""How much GPU memory the worker reserves: sized to the model, not a fixed share of the card.

vLLM 0.32 takes `--gpu-memory-utilization` as a share of the card's *total* memory and refuses
to start unless that much is *free* when its worker starts (vllm/v1/worker/utils.py
`request_memory`; read from source). A fixed 0.9 therefore never boots on a desktop GPU that
also drives a screen, and reserves ~127 GB of an H200 for a 0.27 GB model. The reservation
here is what the model needs (weights from its safetensors files, a KV cache for
`kv_budget_sequences` full context windows, a fixed overhead), cut to the memory free now and
to `gpu_memory_max_share`. An operator's own `gpu_memory_utilization` is passed as it is.

What vLLM 0.32 requires of the KV cache is room for one request of max_model_len tokens
(vllm/v1/core/kv_cache_utils.py `check_enough_kv_cache_memory`); how many run at once is what
the cache holds beyond that ("Maximum concurrency for N tokens per request"). So the budget's
sequences are an aim, met where the card allows: a cut by the share is the configuration
working, a cut by memory another process holds, or below an explicit `kv_budget_sequences`,
is worth a warning (supervisor/doctor/resources.py).

Only `--gpu-memory-utilization` is passed, not `--kv-cache-memory-bytes`: vLLM compares
utilization x total with the free memory whether or not a KV size is given (so the share must
be sized anyway), and within that share the KV cache takes what the weights, activations and
CUDA graphs leave, which is the budget or more when the overhead estimate holds; a fixed KV
size would not give way when the overhead is larger than estimated (read from source, not
run on a GPU here).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.core.sections import GpuSettings
from appliance.core.settings import Settings
from supervisor.gpu.nvml import GpuMonitor

GIB = 1024**3
# The worker's own CUDA context is created before vLLM measures the free memory it compares
# the reservation with; leave it room (a few hundred MiB per CUDA's documentation; not measured).
CONTEXT_HEADROOM_BYTES = 1 * GIB
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


class ModelShapeError(Exception):
    """The model directory does not say enough to size its KV cache."""


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache's size depends on, from the model's config.json."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_window: int  # max_position_embeddings
    weights_bytes: int  # the safetensors files' sizes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Reservation:
    """The chosen numbers, as `serve` logs them and `doctor` shows them."""

    utilization: float  # what vLLM gets as --gpu-memory-utilization
    reserved_bytes: int  # utilization x total
    needed_bytes: int  # weights + kv_budget + overhead
    minimum_bytes: int  # weights + one window's KV + overhead: below this vLLM cannot serve
    weights_bytes: int
    kv_budget_bytes: int
    window: int
    sequences: int
    total_bytes: int
    free_bytes: int
    limited_by: str  # "model", "free memory", "max share" or "operator"
    overhead_bytes: int  # engine.gpu_memory_overhead_bytes
    kv_bytes_per_token: int
    budget_required: bool  # the operator set kv_budget_sequences: the budget is a requirement

    @property
    def fits(self) -> bool:
        """The whole KV budget fits."""
        return self.reserved_bytes >= self.needed_bytes

    @property
    def boots(self) -> bool:
        """At least one full window fits: vLLM starts (with fewer sequences at once)."""
        return self.reserved_bytes >= self.minimum_bytes

    @property
    def concurrency(self) -> float:
        """Full windows the reserved KV cache holds, as vLLM reports its maximum concurrency."""
        return max(self.reserved_bytes - self.weights_bytes - self.overhead_bytes, 0) / (
            self.window * self.kv_bytes_per_token)

    def window_within(self, reserved_bytes: int) -> int:
        """The longest window one request could have within reserved_bytes (0: none)."""
        left = reserved_bytes - self.weights_bytes - self.overhead_bytes
        return max(left // self.kv_bytes_per_token, 0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"fits": self.fits, "boots": self.boots,
                               "concurrency": round(self.concurrency, 2)}


def read_model_shape(model_dir: Path, dtype: str | None) -> ModelShape:
    """The shape from config.json (a multimodal model's text_config), the weights' size from
    its *.safetensors. dtype: the engine's --dtype; None or "auto" follows vLLM's rule on a
    GPU: the checkpoint's own dtype, a float32 checkpoint in bfloat16 (read from source)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelShapeError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    text = config.get("text_config") or config
    try:
        heads = int(text["num_attention_heads"])
        shape = ModelShape(
            layers=int(text["num_hidden_layers"]),
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
            dtype_bytes=_dtype_bytes(dtype, text.get("dtype") or text.get("torch_dtype")
                                     or config.get("torch_dtype")),
            max_window=int(text["max_position_embeddings"]),
            weights_bytes=weights_bytes(model_dir),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelShapeError(f"{model_dir / 'config.json'}: no {exc} to size the KV cache") from exc
    return shape


def weights_bytes(model_dir: Path) -> int:
    """The model's weights: its *.safetensors files' sizes on disk."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def _dtype_bytes(engine_dtype: str | None, checkpoint_dtype: object) -> int:
    name = engine_dtype if engine_dtype not in (None, "auto") else str(checkpoint_dtype or "bfloat16")
    name = name.removeprefix("torch.")
    if engine_dtype in (None, "auto") and name == "float32":
        name = "bfloat16"
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype {name!r}")
    return _DTYPE_BYTES[name]


def plan(settings: Settings, shape: ModelShape, memory: GpuMemory) -> Reservation:
    """The reservation for this model on this GPU now; see the module docstring."""
    engine = settings.engine
    window = min(engine.max_model_len or shape.max_window, shape.max_window)
    sequences = (engine.kv_budget_sequences or engine.max_num_seqs
                 or settings.policy.max_inflight)
    fixed = shape.weights_bytes + engine.gpu_memory_overhead_bytes
    kv_budget = window * sequences * shape.kv_bytes_per_token
    needed = fixed + kv_budget
    minimum = fixed + window * shape.kv_bytes_per_token
    ceilings = {
        "model": needed,
        "free memory": memory.free_bytes - CONTEXT_HEADROOM_BYTES,
        "max share": math.floor(memory.total_bytes * engine.gpu_memory_max_share),
    }
    if engine.gpu_memory_utilization is not None:
        utilization, limited_by = engine.gpu_memory_utilization, "operator"
    else:
        limited_by = min(ceilings, key=lambda name: ceilings[name])
        share = round(ceilings[limited_by] / memory.total_bytes * 1e4, 6)  # 0.5 stays 0.5
        # In steps of 1e-4: up for the model's need (all of it fits), down for a ceiling
        # (never above it); at least 1e-4, as vLLM wants more than 0.
        steps = math.ceil(share) if limited_by == "model" else math.floor(share)
        utilization = min(max(steps, 1), 10**4) / 1e4
    return Reservation(
        utilization=utilization, reserved_bytes=math.floor(utilization * memory.total_bytes),
        needed_bytes=needed, minimum_bytes=minimum, weights_bytes=shape.weights_bytes,
        kv_budget_bytes=kv_budget, window=window, sequences=sequences,
        total_bytes=memory.total_bytes, free_bytes=memory.free_bytes, limited_by=limited_by,
        overhead_bytes=engine.gpu_memory_overhead_bytes,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        budget_required=engine.kv_budget_sequences is not None,
    )


def read_gpu_memory(settings: GpuSettings, monitor: GpuMonitor | None = None) -> GpuMemory | None:
    """Total and free memory of the configured GPU through NVML; None where NVML cannot say."""
    monitor = monitor or GpuMonitor(settings)
    monitor.open()
    try:
        reading = monitor.poll()
    finally:
        monitor.close()
    if reading.memory_total_bytes is None or reading.memory_used_bytes is None:
        return None
    return GpuMemory(reading.memory_total_bytes,
                     reading.memory_total_bytes - reading.memory_used_bytes)
