"""Locust users that talk to the appliance as OpenAI SDK clients do; every outcome is tallied.

Run through `python -m load.locust.run` (it sets the environment below and judges the summary), or
plainly: `locust -f load/locust/locustfile.py --host http://127.0.0.1:8000`.

Environment: LOAD_MODEL (else asked of /v1/models), LOAD_API_KEY, LOAD_MAX_TOKENS (32),
LOAD_TIMEOUT_S (120: a read timeout, longer than a hang takes to detect), LOAD_SUMMARY (path of
the JSON summary written when locust quits).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import time
from collections.abc import Iterator, Mapping
from typing import Any

import openai
from locust import User, between, events, task
from locust.env import Environment

from load.locust.outcome import Outcome, Tally

MODEL = os.environ.get("LOAD_MODEL", "")
API_KEY = os.environ.get("LOAD_API_KEY", "unused")
MAX_TOKENS = int(os.environ.get("LOAD_MAX_TOKENS", "32"))
TIMEOUT_S = float(os.environ.get("LOAD_TIMEOUT_S", "120"))
OVERSIZED = 1_000_000
MAX_EVENTS = 20_000  # a stream longer than this is cut: every loop here is bounded
CLAMP_HEADER = "x-max-tokens-clamped"


def _http_errors() -> tuple[type[Exception], ...]:
    """Transport errors escape a stream being read; the SDK uses httpx or (3.x) httpx2."""
    found = []
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).HTTPError)
        except ImportError:
            continue
    return tuple(found)


TRANSPORT_ERRORS: tuple[type[Exception], ...] = (openai.APIConnectionError, *_http_errors())
QUESTIONS = (
    "What is the capital of France?", "Name three primary colours.",
    "Give me one tip for writing clear code.", "What does a thermometer measure?",
    "Say hello in Spanish.", "Why is the sky blue? One sentence.",
)
LONG_PROMPT = " ".join(
    f"Paragraph {i}: the appliance keeps answering while its engine restarts, and every "
    f"request gets a terminal answer." for i in range(60)
) + " Summarise the text above in one sentence."
PNG_1PX = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
           "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


@events.init.add_listener
def _install_tally(environment: Environment, **_: Any) -> None:
    """One tally per run: it listens to request events and writes the summary at quit."""
    tally = Tally()
    environment.events.request.add_listener(tally.on_request)
    environment.events.user_error.add_listener(tally.on_user_error)
    path = os.environ.get("LOAD_SUMMARY")
    if path:
        environment.events.quitting.add_listener(lambda **_: tally.write(path))


def _chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The data fields of an SSE stream, at most MAX_EVENTS of them."""
    seen = 0
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()
            seen += 1
            if seen >= MAX_EVENTS:
                return


@contextlib.contextmanager
def _recorded(outcome: Outcome) -> Iterator[None]:
    """Settle the outcome from the SDK's refusal or transport failure instead of raising."""
    try:
        yield
    except openai.APIStatusError as exc:
        outcome.settle(exc.status_code, len(exc.response.content))
    except TRANSPORT_ERRORS as exc:
        outcome.error = _transport_error(exc)


def _transport_error(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    name = type(cause).__name__
    return "timeout" if "Timeout" in name else f"connection:{name}"


def _has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


class SdkUser(User):
    """An application with its own OpenAI client: no retries, so every status is seen as sent."""

    abstract = True
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.sdk = openai.OpenAI(base_url=f"{self.host}/v1", api_key=API_KEY, max_retries=0,
                                 timeout=openai.Timeout(TIMEOUT_S, connect=5.0))
        self.model = MODEL or self._discover_model()

    def on_stop(self) -> None:
        self.sdk.close()

    def _discover_model(self) -> str:
        try:
            return self.sdk.models.list().data[0].id
        except (openai.APIError, IndexError):
            return "default"  # the request's own status will say what went wrong

    def report(self, outcome: Outcome) -> None:
        """Fire locust events: the request itself, then TTFT and time per output token."""
        fire = self.environment.events.request.fire
        reason = outcome.failure()
        fire(request_type="POST", name=outcome.scenario, response_time=outcome.elapsed_ms(),
             response_length=outcome.length, context={"outcome": outcome},
             exception=AssertionError(reason) if reason else None)
        if outcome.ttft_s is not None:
            fire(request_type="TTFT", name=outcome.scenario, response_time=outcome.ttft_s * 1000,
                 response_length=0, context={}, exception=None)
        if outcome.tpot_s() is not None:
            fire(request_type="TPOT", name=outcome.scenario,
                 response_time=(outcome.tpot_s() or 0.0) * 1000, response_length=0,
                 context={}, exception=None)

    def complete(self, outcome: Outcome, **params: Any) -> Mapping[str, str] | None:
        """One non-streaming chat completion; the outcome records status and terminal answer."""
        with _recorded(outcome):
            raw = self.sdk.chat.completions.with_raw_response.create(model=self.model, **params)
            raw.parse()
            outcome.settle(raw.status_code, len(raw.content))
            headers: Mapping[str, str] = raw.headers
            return headers
        return None

    def stream(self, outcome: Outcome, keep: int | None = None,
               **params: Any) -> Mapping[str, str] | None:
        """One streamed chat completion, read to `[DONE]`, or left after `keep` tokens."""
        outcome.terminal = False
        with _recorded(outcome), self.sdk.chat.completions.with_streaming_response.create(
                model=self.model, stream=True, **params) as response:
            outcome.status = response.status_code
            self._read_events(response.iter_lines(), outcome, keep)
            headers: Mapping[str, str] = response.headers
            return headers
        return None

    @staticmethod
    def _read_events(lines: Iterator[str], outcome: Outcome, keep: int | None) -> None:
        for data in _sse_data(lines):
            outcome.length += len(data)
            if data == "[DONE]":
                outcome.terminal = True
                return
            event = json.loads(data)
            if "error" in event:
                outcome.sse_errors += 1  # the appliance's "engine lost" event; [DONE] follows
            elif _has_content(event):
                outcome.note_token(time.perf_counter())
            if keep is not None and outcome.tokens >= keep:
                outcome.terminal = None  # the client leaves on purpose: nothing is owed
                return


class ChatUser(SdkUser):
    """The bulk of the traffic: short chats, streamed chats, long prompts, n=2."""

    weight = 3

    @task(4)
    def short_chat(self) -> None:
        outcome = Outcome("short chat")
        self.complete(outcome, messages=_chat(random.choice(QUESTIONS)), max_tokens=MAX_TOKENS)
        self.report(outcome)

    @task(4)
    def streamed_chat(self) -> None:
        outcome = Outcome("streamed chat")
        self.stream(outcome, messages=_chat(random.choice(QUESTIONS)), max_tokens=MAX_TOKENS)
        self.report(outcome)

    @task(1)
    def long_prompt(self) -> None:
        outcome = Outcome("long prompt (streamed)")
        self.stream(outcome, messages=_chat(LONG_PROMPT), max_tokens=MAX_TOKENS)
        self.report(outcome)

    @task(1)
    def two_choices(self) -> None:
        outcome = Outcome("n=2")
        self.complete(outcome, messages=_chat(random.choice(QUESTIONS)), max_tokens=MAX_TOKENS,
                      n=2)
        self.report(outcome)


class WindowUser(SdkUser):
    """Legitimately long work: a prompt that fills most of the context window. On the CPU its
    prefill sends no byte for tens of seconds: the watchdog must never call that a hang."""

    weight = 1

    def on_start(self) -> None:
        super().on_start()
        window = self._window()
        # " the" is one token in byte-level BPE vocabularies; the template adds a few dozen.
        self.prompt = "the" + " the" * int(window * 0.85) if window else LONG_PROMPT

    def _window(self) -> int:
        try:
            model = self.sdk.models.list().data[0]
        except (openai.APIError, IndexError):
            return 0
        return int((model.model_extra or {}).get("max_model_len") or 0)

    @task
    def window_prompt(self) -> None:
        outcome = Outcome("window-filling prompt (streamed)")
        self.stream(outcome, messages=_chat(self.prompt), max_tokens=16)
        self.report(outcome)


class EdgeCaseUser(SdkUser):
    """The awkward clients: oversized max_tokens, mid-stream hang-ups, images to a text model."""

    weight = 1

    @task
    def oversized_max_tokens(self) -> None:
        """Clamped, not refused: 200 with the clamp header; read a little and leave."""
        outcome = Outcome("max_tokens=1e6 (clamped)")
        headers = self.stream(outcome, keep=MAX_TOKENS, max_tokens=OVERSIZED,
                              messages=_chat(random.choice(QUESTIONS)))
        if outcome.status == 200:
            outcome.expected = headers is not None and CLAMP_HEADER in headers
        self.report(outcome)

    @task
    def disconnect_mid_stream(self) -> None:
        outcome = Outcome("disconnect mid-stream")
        self.stream(outcome, keep=2, messages=_chat(random.choice(QUESTIONS)),
                    max_tokens=MAX_TOKENS)
        self.report(outcome)

    @task
    def image_to_text_model(self) -> None:
        """A text-only model refuses image parts with 400 before they reach the engine."""
        outcome = Outcome("image part (expect 400)", expect=400)
        content = [{"type": "text", "text": "What is in this picture?"},
                   {"type": "image_url", "image_url": {"url": PNG_1PX}}]
        self.complete(outcome, messages=[{"role": "user", "content": content}],
                      max_tokens=MAX_TOKENS)
        self.report(outcome)
