"""The GPU smoke check's stand-in for vLLM's preloads: imports torch and asks for the device
count, as `import vllm` can make torch do. torch answers from NVML (it opens /dev/nvidiactl and
never shuts NVML down) without creating a CUDA context: the template must accept that.
Imported by name by the template (supervisor/template/engine_side.py) in the smoke check."""

from __future__ import annotations

import torch

DEVICE_COUNT = torch.cuda.device_count()
