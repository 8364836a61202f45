"""The template's "no CUDA context" rule against what an H200 (driver 580) showed, each row a
fresh process that then forked and allocated in the child:

| the parent did                        | /dev/nvidia-uvm | cuDeviceGet | child uses CUDA |
| `import torch`                        | closed          | 3           | yes             |
| torch's NVML device count             | open            | 3           | yes             |
| `torch.cuda.is_available()`           | open            | 0           | no              |
| `cuInit(0)`                           | open            | 0           | no              |

The rule asks libcuda and torch, never the open files: fakes shaped as ctypes' CDLL stand in."""

from __future__ import annotations

import ctypes
import types
from typing import Any

import pytest

from supervisor.template.cuda_state import CudaState, cuda_state, driver_state


class FakeLibCuda:
    """libcuda as ctypes exposes it: cuDeviceGet(CUdevice*, int) -> CUresult."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[int] = []

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:  # libcuda's own name
        assert isinstance(device, type(ctypes.byref(ctypes.c_int()))), "a pointer, as ctypes passes"
        self.calls.append(ordinal)
        return self.code


def torch_module(initialised: bool) -> dict[str, Any]:
    return {"torch": types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: initialised))}


@pytest.mark.parametrize(("row", "modules", "code", "child_can_use_cuda"), [
    ("import torch", torch_module(False), 3, True),
    ("torch's NVML device count", torch_module(False), 3, True),
    ("torch.cuda.is_available()", torch_module(False), 0, False),
    ("cuInit(0), no torch", {}, 0, False),
])
def test_the_h200_table(row: str, modules: dict[str, Any], code: int, child_can_use_cuda: bool) -> None:
    """The template forks (not initialised) exactly where the H200's child could use CUDA."""
    libcuda = FakeLibCuda(code)
    state = cuda_state(lambda: libcuda, modules)
    assert state.initialised is not child_can_use_cuda, row
    assert libcuda.calls == [0]


def test_torchs_own_flag_is_enough_to_refuse() -> None:
    libcuda = FakeLibCuda(3)
    state = cuda_state(lambda: libcuda, torch_module(True))
    assert state == CudaState(True, "torch.cuda.is_initialized() is true")


def test_no_libcuda_means_no_cuda() -> None:
    assert cuda_state(lambda: None, {}) == CudaState(False, "libcuda.so.1 absent: no CUDA driver")


def test_an_answer_other_than_not_initialised_is_no_proof_a_child_could_use_cuda() -> None:
    """CUDA_ERROR_NO_DEVICE (100) after a failed cuInit: not a state a fork is known safe in."""
    state = driver_state(FakeLibCuda(100))
    assert state.initialised and "100" in state.reason


def test_this_cpu_process_holds_no_cuda_context() -> None:
    """The real library where this box has one, else its absence: either way, no context."""
    assert not cuda_state().initialised
