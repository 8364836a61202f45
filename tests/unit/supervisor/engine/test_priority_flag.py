"""The worker runs vLLM's priority scheduler exactly when clients have priorities."""

from __future__ import annotations

from appliance.settings import Settings
from supervisor.engine.worker import build_command
from supervisor.serve import worker_settings

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
