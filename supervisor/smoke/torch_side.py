"""The GPU smoke check's torch side: run BY PATH with an interpreter that has CUDA torch.

It imports only the standard library and torch (no vLLM, nothing of this repository), so any
venv with a CUDA build of torch runs it. Two roles:
  hold MIB                  a process tree that holds GPU memory: this process and one child
                            each allocate MIB, then it prints {"pids": [...]} and sleeps until
                            killed (what the release wait is timed against)
  worker RESULT MIB         what a worker forked from the template does: it is checked to hold
                            no CUDA context, forks a child that initialises CUDA and allocates
                            MIB (as vLLM's EngineCore would be forked), then initialises CUDA
                            itself; RESULT gets the JSON of what each saw
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from typing import Any

import torch

MIB = 1024 * 1024


def allocate(mib: int) -> Any:
    """MIB of GPU memory, touched so the driver really backs it."""
    block = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    return block


def hold(mib: int) -> None:
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "hold-child", str(mib)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    block = allocate(mib)
    if child.stdout.readline().strip() != "ready":
        raise SystemExit("the child could not allocate")
    print(json.dumps({"pids": [os.getpid(), child.pid], "bytes_each": block.numel()}), flush=True)
    while True:
        time.sleep(3600)


def hold_child(mib: int) -> None:
    block = allocate(mib)
    print("ready", flush=True)
    while block is not None:
        time.sleep(3600)


def engine_core(mib: int, results: Any) -> None:
    began = time.monotonic()
    try:
        block = allocate(mib)
        free, total = torch.cuda.mem_get_info()
    except Exception as exc:  # reported, so the worker does not wait for a result in vain
        results.put({"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"})
        raise
    results.put({"pid": os.getpid(), "allocated_bytes": block.numel(), "free_bytes": free,
                 "total_bytes": total, "init_and_allocate_s": round(time.monotonic() - began, 3)})


def worker(result_path: str, mib: int) -> None:
    seen: dict[str, Any] = {"pid": os.getpid(), "cuda_initialized_at_fork": torch.cuda.is_initialized(),
                            "device_count": torch.cuda.device_count()}
    context = multiprocessing.get_context("fork")  # before this process touches CUDA
    results = context.Queue()
    child = context.Process(target=engine_core, args=(mib, results))
    child.start()
    seen["child"] = results.get(timeout=300)
    child.join(60)
    seen["child_exitcode"] = child.exitcode
    began = time.monotonic()
    try:
        block = allocate(mib)
    except Exception as exc:  # the report says so; the smoke check fails on it
        seen["worker_error"] = f"{type(exc).__name__}: {exc}"
    else:
        seen["worker_cuda_init_and_allocate_s"] = round(time.monotonic() - began, 3)
        seen["worker_allocated_bytes"] = block.numel()
        seen["device_name"] = torch.cuda.get_device_name(0)
    with open(result_path, "w") as out:
        json.dump(seen, out)


def main(argv: list[str]) -> int:
    role, args = argv[0], argv[1:]
    if role == "hold":
        hold(int(args[0]))
    elif role == "hold-child":
        hold_child(int(args[0]))
    elif role == "worker":
        worker(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown role {role}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
