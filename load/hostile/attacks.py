"""What a hostile but ordinary LAN client does to the edge, each attack bounded in size and time.

An attack runs to its end and returns what it saw, with the connections it still holds open:
the run decides how long to keep them (what the appliance does with a connection its client
never releases is the point) and closes them.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from load.kit.rawclient import Conn, Reply, Stalled, Target, json_request, request_head

MIB = 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
BIG_BODY_BYTES = 15 * MIB + MIB // 2  # under the default 16 MiB body limit
MALFORMED = [b"{", b'{"messages": [', b"[1, 2, 3]", b'{"messages": "hi"}', b"\xff\xfe\x00",
             b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}',
             b'{"a": ' * 5000, b"null", b'{"messages": [{"role": 7}]}', b"\x00" * 64]


@dataclass
class Outcome:
    """What came back while the attack ran (status codes, hang-ups), and what it holds."""

    answers: Counter[str] = field(default_factory=Counter)
    held: list[Conn] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, reply: Reply | None) -> None:
        with self._lock:
            self.answers["hang-up" if reply is None or reply.hung_up else str(reply.status)] += 1

    def note_text(self, what: str) -> None:
        with self._lock:
            self.answers[what] += 1


@dataclass(frozen=True)
class Plan:
    """Sizes and times of a run; `scale` shrinks the counts and sizes for a short test run."""

    target: Target
    scale: float = 1.0
    hold_s: float = 10.0
    headers: tuple[tuple[str, str], ...] = ()

    def count(self, full: int) -> int:
        return max(1, int(full * self.scale))


Attack = Callable[[Plan], Outcome]


def slow_bodies(plan: Plan) -> Outcome:
    """64 clients send headers and 10 bytes of a 1,000-byte body, then wait (slots? timeouts?)."""
    outcome = Outcome()
    head = request_head("POST", CHAT_PATH, plan.target,
                        [("Content-Type", "application/json"), *plan.headers], content_length=1000)
    for _ in range(plan.count(64)):
        conn = _open(plan, outcome)
        if conn is not None and conn.send(head + b'{"messages"'):
            outcome.held.append(conn)
    time.sleep(plan.hold_s)  # holding the connections is the attack
    return outcome


def idle_flood(plan: Plan) -> Outcome:
    """2,000 connections that never send a byte (descriptors, a connection cap?)."""
    outcome = Outcome()
    for _ in range(plan.count(2000)):
        conn = _open(plan, outcome)
        if conn is not None:
            outcome.held.append(conn)
    time.sleep(plan.hold_s)
    return outcome


def header_floods(plan: Plan) -> Outcome:
    """Four GET /livez at once, each with one 64 MiB header (memory, loop stalls)."""
    size = plan.count(64 * MIB)
    raw = request_head("GET", "/livez", plan.target, [("X-Flood", "a" * size)])
    return _concurrently(plan, [raw] * 4, timeout_s=60)


def many_headers(plan: Plan) -> Outcome:
    """Two GET /livez with 200,000 headers each."""
    lines = b"".join(b"X-H-%d: v\r\n" % i for i in range(plan.count(200_000)))
    raw = request_head("GET", "/livez", plan.target)[:-2] + lines + b"\r\n"
    return _concurrently(plan, [raw] * 2, timeout_s=60)


def big_bodies(plan: Plan) -> Outcome:
    """Four chat requests of ~15.5 MiB of JSON at once (parsing on the loop?)."""
    body = big_chat_body(max(1024, plan.count(BIG_BODY_BYTES)))
    raw = json_request("POST", CHAT_PATH, plan.target, body, plan.headers)
    return _concurrently(plan, [raw] * 4, timeout_s=120)


def malformed_json(plan: Plan) -> Outcome:
    """A burst of 500 malformed bodies from 8 clients (every one a 4xx, none a 5xx)."""
    raws = [json_request("POST", CHAT_PATH, plan.target, MALFORMED[i % len(MALFORMED)],
                         plan.headers) for i in range(plan.count(500))]
    return _concurrently(plan, raws, timeout_s=30, workers=8)


ATTACKS: dict[str, Attack] = {
    "slow bodies": slow_bodies,
    "header floods": header_floods,
    "200k headers": many_headers,
    "idle flood": idle_flood,
    "big bodies": big_bodies,
    "malformed JSON": malformed_json,
}


def big_chat_body(size: int = BIG_BODY_BYTES) -> bytes:
    """A valid chat body of about `size` bytes made of many small messages (costly to parse)."""
    message = {"role": "user", "content": "x"}
    one = len(json.dumps(message)) + 2
    body = json.dumps({"messages": [message] * max(1, (size - 64) // one),
                       "max_tokens": 1}).encode()
    return body


def _open(plan: Plan, outcome: Outcome) -> Conn | None:
    try:
        return Conn(plan.target, timeout_s=5)
    except OSError as exc:  # refused at connect: the listen backlog or a cap said no
        outcome.note_text(f"connect {type(exc).__name__}")
        return None


def _concurrently(plan: Plan, raws: list[bytes], timeout_s: float, workers: int = 4) -> Outcome:
    outcome = Outcome()

    def one(raw: bytes) -> None:
        try:
            with Conn(plan.target, timeout_s=timeout_s) as conn:
                conn.send(raw, timeout_s)
                outcome.note(conn.reply(timeout_s))
        except Stalled:
            outcome.note_text("no answer")
        except OSError as exc:
            outcome.note_text(f"error {type(exc).__name__}")

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, raws))
    return outcome


def release(outcome: Outcome) -> None:
    """Classify each held connection (cut off by the appliance, or still open) and close it."""
    for conn in outcome.held:
        try:
            reply: Reply | None = conn.reply(0.01)
        except Stalled:
            outcome.note_text("still open")
        else:
            outcome.note(reply)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
    outcome.held.clear()
