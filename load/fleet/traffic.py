"""Clients of the fleet: threads that send chat requests through the router until told to
stop, and count what a client sees: complete answers, and failures of any kind."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from load.fleet.boxes import KEY

TOKENS = 12  # short answers: a box's single core answers several a second
HEADERS = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Failure:
    at: float  # monotonic
    what: str


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failures: list[Failure] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, failure: str | None) -> None:
        with self.lock:
            self.sent += 1
            if failure is None:
                self.ok += 1
            else:
                self.failures.append(Failure(time.monotonic(), failure))


def ask(client: httpx.Client, url: str, n: int, stream: bool) -> str | None:
    """One request; None if the client got a whole answer, else what went wrong."""
    body = {"messages": [{"role": "user", "content": f"Say something about the number {n}."}],
            "max_tokens": TOKENS, "stream": stream}
    try:
        if not stream:
            response = client.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS)
            if response.status_code != 200:
                return f"{response.status_code} {response.text[:120]}"
            return None if response.json().get("choices") else f"no choices: {response.text[:120]}"
        with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers=HEADERS) as response:
            if response.status_code != 200:
                return f"{response.status_code} {response.read()[:120]!r}"
            lines = [line for line in response.iter_lines() if line]
        if not lines or lines[-1] != "data: [DONE]":
            return f"stream cut: {lines[-1:]}"
        if any("error" in json.loads(line[6:]) for line in lines[:-1]):
            return f"stream error event: {lines[-2][:120]}"
        return None
    except (httpx.HTTPError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


class Traffic:
    """`clients` threads, half of the requests streamed, until stop()."""

    def __init__(self, url: str, clients: int) -> None:
        self.tally = Tally()
        self._url = url
        self._stop = threading.Event()
        self._numbers = itertools.count()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                n = next(self._numbers)
                self.tally.count(ask(client, self._url, n, stream=(n + index) % 2 == 0))

    def wait_for(self, requests: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        start = self.tally.sent
        while self.tally.sent - start < requests:
            assert time.monotonic() < deadline, "the traffic stalled"
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)
