"""The correctness canary: recorded once per key, compared after, a mismatch told twice over."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from appliance.core.engine import EngineState
from appliance.core.sections import CanarySettings, EngineSettings
from supervisor.observe.collector import ObservedModel, SupervisorCollector
from supervisor.selftest.canary import (
    PROMPTS,
    Answers,
    CanaryKey,
    CanaryStore,
    CanaryWatch,
    Verdict,
    differing,
    judge,
)
from tests.metrics_text import value
from tests.unit.supervisor.test_collector import FakeManager, FakeProgress

pytestmark = pytest.mark.anyio

GOOD: Answers = [[578, 3, 17], [216, 28, 19], [261, 284, 33]]


class FakeWorker:
    """Answers /version and greedy /v1/completions as vLLM 0.32 does (return_token_ids)."""

    def __init__(self, answers: Answers, version: str = "0.32.0") -> None:
        self.answers = [list(a) for a in answers]
        self.version = version
        self.asked: list[dict[str, object]] = []
        self.up = True

    async def __call__(self, method: str, path: str, body: bytes | None,
                       timeout_s: float) -> tuple[int, bytes] | None:
        if not self.up:
            return None
        if path == "/version":
            return 200, json.dumps({"version": self.version}).encode()
        request = json.loads(body or b"{}")
        self.asked.append(request)
        ids = self.answers[PROMPTS.index(request["prompt"])]
        choice = {"index": 0, "text": "x" * len(ids), "logprobs": None, "finish_reason": "length",
                  "stop_reason": None, "token_ids": ids, "prompt_logprobs": None,
                  "prompt_token_ids": [1, 2, 3]}
        return 200, json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                                "model": request["model"], "choices": [choice]}).encode()


def engine(model: str = "/models/m") -> EngineSettings:
    return EngineSettings(model=model, device="cpu")


async def test_first_start_records_then_the_same_answers_pass(tmp_path: Path) -> None:
    store = CanaryStore(tmp_path / "state" / "canary.json")
    worker = FakeWorker(GOOD)
    first = await judge(worker, engine(), CanarySettings(), store)
    assert first.verdict is Verdict.RECORDED and first.ok
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    second = await judge(worker, engine(), CanarySettings(), store)
    assert second.verdict is Verdict.PASS and second.ok
    request = worker.asked[0]
    assert request["temperature"] == 0 and request["return_token_ids"] is True
    assert request["max_tokens"] == 8 and request["model"] == "m"


async def test_a_changed_answer_is_a_mismatch_naming_the_prompt(tmp_path: Path) -> None:
    store = CanaryStore(tmp_path / "canary.json")
    await judge(FakeWorker(GOOD), engine(), CanarySettings(), store)
    broken = FakeWorker(GOOD)
    broken.answers[1] = [216, 28, 20]
    result = await judge(broken, engine(), CanarySettings(), store)
    assert result.verdict is Verdict.MISMATCH and result.ok is False
    assert result.differing == (1,)
    assert "prompt 1 gave [216, 28, 20], recorded [216, 28, 19]" in result.detail
    assert len(broken.asked) == 2 * len(PROMPTS)  # asked again before it is called one


async def test_a_changed_record_is_a_mismatch(tmp_path: Path) -> None:
    store = CanaryStore(tmp_path / "canary.json")
    await judge(FakeWorker(GOOD), engine(), CanarySettings(), store)
    data = json.loads(store.path.read_text())
    [record] = data["records"].values()
    record["token_ids"][0][0] += 1
    store.path.write_text(json.dumps(data))
    result = await judge(FakeWorker(GOOD), engine(), CanarySettings(), store)
    assert result.verdict is Verdict.MISMATCH and result.differing == (0,)


async def test_another_engine_version_or_dtype_is_a_new_record_not_a_mismatch(
        tmp_path: Path) -> None:
    store = CanaryStore(tmp_path / "canary.json")
    await judge(FakeWorker(GOOD), engine(), CanarySettings(), store)
    other = [[9, 9, 9]] * 3
    upgraded = await judge(FakeWorker(other, version="0.33.0"), engine(), CanarySettings(), store)
    assert upgraded.verdict is Verdict.RECORDED
    half = engine().model_copy(update={"dtype": "bfloat16"})
    assert (await judge(FakeWorker(other), half, CanarySettings(), store)).verdict \
        is Verdict.RECORDED
    assert (await judge(FakeWorker(GOOD), engine(), CanarySettings(), store)).verdict \
        is Verdict.PASS  # the first key's record is kept beside the others


async def test_a_worker_that_does_not_answer_is_not_judged(tmp_path: Path) -> None:
    worker = FakeWorker(GOOD)
    worker.up = False
    result = await judge(worker, engine(), CanarySettings(), CanaryStore(tmp_path / "c.json"))
    assert result.verdict is Verdict.ERROR and result.ok is None
    assert not (tmp_path / "c.json").exists()  # nothing recorded from no answer


def test_forget_drops_one_models_records_only(tmp_path: Path) -> None:
    store = CanaryStore(tmp_path / "canary.json")
    store.put(CanaryKey("/a", "float32", "cpu", "0.32.0"), GOOD)
    store.put(CanaryKey("/b", "float32", "cpu", "0.32.0"), GOOD)
    assert store.forget("/a") == 1
    assert store.get(CanaryKey("/a", "float32", "cpu", "0.32.0")) is None
    assert store.get(CanaryKey("/b", "float32", "cpu", "0.32.0")) == GOOD


def test_a_record_of_other_prompts_is_no_record(tmp_path: Path) -> None:
    store = CanaryStore(tmp_path / "canary.json")
    key = CanaryKey("/a", "float32", "cpu", "0.32.0")
    store.put(key, GOOD)
    data = json.loads(store.path.read_text())
    data["records"][key.text()]["prompts"][0] = "another prompt"
    store.path.write_text(json.dumps(data))
    assert store.get(key) is None


def test_differing_counts_every_prompt_when_the_lengths_differ() -> None:
    assert differing(GOOD, GOOD) == ()
    assert differing(GOOD, GOOD[:2]) == (0, 1, 2)


async def test_watch_judges_each_ready_worker_and_exports_the_verdict(tmp_path: Path) -> None:
    pids = iter([101, 102])
    worker = FakeWorker(GOOD)
    watch = CanaryWatch(engine(), CanarySettings(file=tmp_path / "c.json"), worker,
                        lambda: next(pids))
    assert watch.summary() is None
    registry = CollectorRegistry()
    registry.register(SupervisorCollector(
        [ObservedModel("smol", FakeManager(), FakeProgress(), watch)], None))  # type: ignore[arg-type]
    assert "appliance_canary_ok" not in generate_latest(registry).decode()  # not judged yet
    watch.on_state(EngineState.STARTING, EngineState.READY, "serving")
    await asyncio.sleep(0.05)
    assert watch.summary() is not None and watch.summary()["worker"] == 101  # type: ignore[index]
    assert value(generate_latest(registry).decode(), "appliance_canary_ok") == 1
    worker.answers[2] = [0, 0, 0]
    watch.on_state(EngineState.STARTING, EngineState.READY, "serving")
    await asyncio.sleep(0.05)
    summary = watch.summary()
    assert summary is not None and summary["verdict"] == "mismatch" and summary["worker"] == 102
    assert value(generate_latest(registry).decode(), "appliance_canary_ok") == 0
    await watch.aclose()


async def test_watch_drops_a_check_when_its_worker_is_lost(tmp_path: Path) -> None:
    worker = FakeWorker(GOOD)
    never = asyncio.Event()

    async def slow(method: str, path: str, body: bytes | None,
                   timeout_s: float) -> tuple[int, bytes] | None:
        await never.wait()
        return await worker(method, path, body, timeout_s)

    watch = CanaryWatch(engine(), CanarySettings(file=tmp_path / "c.json"), slow, lambda: 7)
    watch.on_state(EngineState.STARTING, EngineState.READY, "serving")
    watch.on_state(EngineState.READY, EngineState.STOPPING, "exited")
    never.set()
    await asyncio.sleep(0.05)
    assert watch.summary() is None


async def test_the_managers_health_detail_carries_the_ready_workers_verdict(
        tmp_path: Path) -> None:
    """Wired as serve wires it: a listener of the states, a detail of /health."""
    from tests.unit.supervisor.engine.test_manager import FakeClock, FakeLauncher, make_manager, until

    manager = make_manager(FakeLauncher(), FakeClock())
    watch = CanaryWatch(engine(), CanarySettings(file=tmp_path / "c.json"), FakeWorker(GOOD),
                        lambda: manager.pid)
    manager.listeners.append(watch.on_state)
    manager.details["canary"] = watch.summary
    task = asyncio.create_task(manager.run())
    await until(lambda: manager.snapshot().get("canary") is not None)
    canary = manager.snapshot()["canary"]
    assert canary["verdict"] == "recorded" and canary["worker"] == manager.pid
    manager.request_stop()
    await task
    await watch.aclose()
