"""The worker runs vLLM's priority scheduler exactly when clients have priorities."""

from __future__ import annotations

import os

from appliance.core.settings import Settings
from supervisor.engine.stack import worker_settings
from supervisor.engine.worker import build_command, build_env

FLAG = ["--scheduling-policy", "priority"]


def argv(**admission: object) -> list[str]:
    settings = Settings(engine={"extra_args": ["--seed", "3"]}, admission=admission)
    return build_command(worker_settings(settings))


def contains(args: list[str], part: list[str]) -> bool:
    return any(args[i:i + len(part)] == part for i in range(len(args)))


def test_no_priority_anywhere_keeps_vllms_first_come_first_served() -> None:
    assert not contains(argv(clients=[{"name": "a", "key": "k"}]), FLAG)


def test_a_client_with_a_priority_turns_the_priority_scheduler_on() -> None:
    args = argv(clients=[{"name": "a", "key": "k", "priority": 3}])
    assert contains(args, FLAG)
    assert args.index("--scheduling-policy") < args.index("--seed")  # the operator's come last


def test_the_setting_decides_over_auto() -> None:
    assert contains(argv(priority_scheduling="on"), FLAG)
    assert not contains(argv(priority_scheduling="off", default_priority=4), FLAG)


def test_on_a_gpu_the_worker_gets_the_watched_gpu_by_uuid_in_nvmls_order() -> None:
    """NVML numbers GPUs by PCI bus, CUDA fastest first: an index alone could differ."""
    settings = Settings(engine={"device": "cuda"}, gpu={"device": "1"})
    env = build_env(worker_settings(settings, gpu_uuid="GPU-abc"))
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    unwatched = build_env(worker_settings(settings, gpu_uuid=None))  # the monitor found no GPU
    assert unwatched["CUDA_VISIBLE_DEVICES"] == "1"
    mine = Settings(engine={"device": "cuda", "env": {"CUDA_VISIBLE_DEVICES": "0,1"}})
    assert build_env(worker_settings(mine, gpu_uuid="GPU-abc"))["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_on_the_cpu_no_cuda_device_is_chosen() -> None:
    env = build_env(worker_settings(Settings(engine={"device": "cpu"}), gpu_uuid=None))
    assert env.get("CUDA_DEVICE_ORDER") == os.environ.get("CUDA_DEVICE_ORDER")  # untouched
