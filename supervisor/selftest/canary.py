"""The correctness canary: the greedy answers (token ids) of a few fixed prompts, recorded once
per model and compared at every worker start, so that "200 OK but garbage" (a driver, a GPU's
memory, a wrong dtype, an engine upgrade) is an alert, not a silent failure.

A record is keyed by what must give the same answers: the model's path, the dtype, the device
and the engine's version. A key with no record is a model change (or a first start): its
answers are recorded then. A record whose prompts are not today's is recorded again too.

A mismatch is asked again once before it is called one: a real corruption answers wrong twice.
It does not make the engine not-ready: the box still answers, a person decides (docs).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from appliance.core.engine import EngineState
from appliance.core.sections import CanarySettings, EngineSettings

log = structlog.get_logger("supervisor.selftest.canary")

# Short, varied, and each with one overwhelmingly likely continuation for a sane model.
PROMPTS = ("The capital of France is", "1, 2, 3, 4, 5,", "def add(a, b):\n    return")
FILE_VERSION = 1
Answers = list[list[int]]  # the generated token ids, one list per prompt
# POST `path` with a JSON body, within a timeout: (status, body), or None when nothing answered.
Asker = Callable[[str, str, bytes | None, float], Awaitable[tuple[int, bytes] | None]]


class CanaryError(Exception):
    """The worker did not give the canary's answers (not answering, not 200, not parsable)."""


class Verdict(enum.StrEnum):
    PASS = "pass"  # the answers are the recorded ones
    MISMATCH = "mismatch"  # they are not, twice: the engine computes something else now
    RECORDED = "recorded"  # this key had no record: today's answers are the record
    ERROR = "error"  # no answers to judge (the worker did not answer in time)


@dataclass(frozen=True)
class CanaryKey:
    model: str
    dtype: str
    device: str
    engine: str  # the worker's own /version

    @classmethod
    def of(cls, engine: EngineSettings, version: str) -> CanaryKey:
        device = engine.resolved_device()
        dtype = engine.dtype or ("float32" if device == "cpu" else "auto")  # as the worker gets
        return cls(engine.model, dtype, device, version)

    def text(self) -> str:
        return f"{self.model}|{self.dtype}|{self.device}|vllm {self.engine}"


@dataclass(frozen=True)
class CanaryResult:
    verdict: Verdict
    key: str
    detail: str
    worker: int | None = None  # the pid of the worker it judged (/health's pid)
    at: float = field(default_factory=time.time)
    differing: tuple[int, ...] = ()  # the prompts whose answers differ

    @property
    def ok(self) -> bool | None:
        """True: the answers are sound; False: they are not; None: not judged."""
        if self.verdict is Verdict.ERROR:
            return None
        return self.verdict is not Verdict.MISMATCH

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "ok": self.ok, "key": self.key,
                "detail": self.detail, "worker": self.worker, "at": round(self.at, 1),
                "differing": list(self.differing)}


def differing(recorded: Answers, observed: Answers) -> tuple[int, ...]:
    """The indices of the prompts whose answers differ (all of them if the counts differ)."""
    if len(recorded) != len(observed):
        return tuple(range(max(len(recorded), len(observed))))
    return tuple(i for i, (a, b) in enumerate(zip(recorded, observed, strict=True)) if a != b)


class CanaryStore:
    """The records, one JSON file (mode 0600: it names the model's path), replaced whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _records(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("canary.unreadable", path=str(self.path), error=str(exc))
            return {}
        records = data.get("records") if isinstance(data, dict) else None
        return records if isinstance(records, dict) else {}

    def get(self, key: CanaryKey) -> Answers | None:
        """The recorded answers of `key` for today's prompts, or None."""
        record = self._records().get(key.text())
        if not isinstance(record, dict) or record.get("prompts") != list(PROMPTS):
            return None
        answers = record.get("token_ids")
        return answers if isinstance(answers, list) else None

    def put(self, key: CanaryKey, answers: Answers) -> None:
        records = self._records()
        records[key.text()] = {"model": key.model, "dtype": key.dtype, "device": key.device,
                               "engine": key.engine, "prompts": list(PROMPTS),
                               "token_ids": answers, "recorded_at": round(time.time(), 1)}
        self._write(records)

    def forget(self, model: str) -> int:
        """Drop every record of `model` (the next worker start records it again)."""
        records = self._records()
        kept = {k: v for k, v in records.items() if not (isinstance(v, dict)
                                                           and v.get("model") == model)}
        self._write(kept)
        return len(records) - len(kept)

    def _write(self, records: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=self.path.parent, prefix=".canary-")
        try:
            with os.fdopen(handle, "w") as out:  # mkstemp makes it 0600
                json.dump({"version": FILE_VERSION, "records": records}, out, indent=1)
            os.replace(name, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise


async def worker_version(ask: Asker, timeout_s: float) -> str:
    answer = await ask("GET", "/version", None, timeout_s)
    if answer is None or answer[0] != 200:
        raise CanaryError(f"/version answered {answer[0] if answer else 'nothing'}")
    try:
        return str(json.loads(answer[1])["version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CanaryError(f"/version: {exc}") from exc


async def observe(ask: Asker, model_name: str, settings: CanarySettings) -> Answers:
    """Each prompt's greedy answer, as token ids, one prompt after another."""
    answers = []
    for prompt in PROMPTS:
        body = {"model": model_name, "prompt": prompt, "max_tokens": settings.max_tokens,
                "temperature": 0, "seed": 0, "return_token_ids": True}
        answer = await ask("POST", "/v1/completions", json.dumps(body).encode(),
                           settings.timeout_s)
        if answer is None or answer[0] != 200:
            raise CanaryError(f"completion answered {answer[0] if answer else 'nothing'}")
        try:
            ids = json.loads(answer[1])["choices"][0]["token_ids"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CanaryError(f"completion without token ids: {exc}") from exc
        answers.append([int(i) for i in ids])
    return answers


async def judge(ask: Asker, engine: EngineSettings, settings: CanarySettings,
                store: CanaryStore) -> CanaryResult:
    """Ask, then compare with the record, or record; one result, logged."""
    key_text = "unknown"
    try:
        key = CanaryKey.of(engine, await worker_version(ask, settings.timeout_s))
        key_text = key.text()
        observed = await observe(ask, engine.model_name, settings)
        recorded = store.get(key)
        if recorded is None:
            store.put(key, observed)
            return _logged(CanaryResult(Verdict.RECORDED, key_text,
                                        f"recorded {len(observed)} answers for this model"))
        if differing(recorded, observed):
            observed = await observe(ask, engine.model_name, settings)  # twice, to be sure
        wrong = differing(recorded, observed)
        if wrong:
            first = wrong[0]
            seen = observed[first] if first < len(observed) else []
            want = recorded[first] if first < len(recorded) else []
            return _logged(CanaryResult(Verdict.MISMATCH, key_text, (
                f"{len(wrong)} of {len(PROMPTS)} greedy answers differ from the record: "
                f"prompt {first} gave {seen}, recorded {want}"), differing=wrong))
        return _logged(CanaryResult(Verdict.PASS, key_text,
                                    f"{len(PROMPTS)} greedy answers as recorded"))
    except (CanaryError, OSError) as exc:
        return _logged(CanaryResult(Verdict.ERROR, key_text, str(exc)))


def _logged(result: CanaryResult) -> CanaryResult:
    fields = {"key": result.key, "detail": result.detail}
    if result.verdict is Verdict.MISMATCH:
        log.error("engine.canary_mismatch", differing=list(result.differing), **fields)
    elif result.verdict is Verdict.ERROR:
        log.warning("engine.canary_failed", **fields)
    else:
        log.info(f"engine.canary_{result.verdict.value}", **fields)
    return result


class CanaryWatch:
    """Judges each worker once it is ready, in the background (a listener of the manager's
    states); its last result is in /health, on the status page and in /metrics."""

    def __init__(self, engine: EngineSettings, settings: CanarySettings, ask: Asker,
                 worker: Callable[[], int | None]) -> None:
        self._engine, self._settings, self._ask = engine, settings, ask
        self._store = CanaryStore(settings.resolved_file())
        self._worker = worker
        self._task: asyncio.Task[None] | None = None
        self.result: CanaryResult | None = None

    def on_state(self, _old: EngineState, new: EngineState, _cause: str) -> None:
        if new is EngineState.READY and self._settings.enabled:
            self._cancel()
            self._task = asyncio.create_task(self._judge(self._worker()))
        elif new is not EngineState.DRAINING:  # this worker is gone: its check is moot
            self._cancel()

    async def _judge(self, worker: int | None) -> None:
        result = await judge(self._ask, self._engine, self._settings, self._store)
        self.result = CanaryResult(result.verdict, result.key, result.detail, worker,
                                   result.at, result.differing)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def summary(self) -> dict[str, Any] | None:
        if not self._settings.enabled:
            return {"verdict": "disabled", "ok": None}
        return self.result.as_dict() if self.result is not None else None

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
