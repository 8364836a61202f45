"""Header limits (issue 9 #3): a huge header or a flood of headers is refused (431, or a hang-up
before the app) quickly, memory stays bounded, and /livez stays fast meanwhile."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import pytest

from load.hostile.honest import poll_livez_during
from load.kit.procstat import MIB, PeakSampler
from load.kit.rawclient import Conn, HeaderItem, Reply, Stalled, request_head
from tests.support.stack import Stack
from tests.unit.appliance.edge.limits import LIVEZ_WORST_S, QUICK_S, RSS_GROWTH_MIB

REFUSED = (None, 431)  # a 431, or the connection closed before the app saw the request


def _livez_request(stack: Stack, headers: Sequence[HeaderItem] | bytes) -> bytes:
    """GET /livez carrying `headers` (or raw header lines)."""
    if isinstance(headers, bytes):  # raw header lines go before the blank line
        return request_head("GET", "/livez", stack.target)[:-2] + headers + b"\r\n"
    return request_head("GET", "/livez", stack.target, headers)


def _send(stack: Stack, raw: bytes) -> Reply:
    """Send it whole (a hang-up part way through is a refusal); the reply or the hang-up."""
    with Conn(stack.target, timeout_s=QUICK_S) as conn:
        conn.send(raw, timeout_s=QUICK_S)
        return conn.reply(QUICK_S)


def _livez_with(stack: Stack, headers: Sequence[HeaderItem] | bytes) -> Reply:
    return _send(stack, _livez_request(stack, headers))


def _many_headers(count: int) -> bytes:
    return b"".join(b"X-H-%d: v\r\n" % i for i in range(count))


@pytest.mark.parametrize("size_mib", [1, 64])
def test_one_huge_header_is_refused_quickly(stack: Stack, size_mib: int) -> None:
    """#3: a single 1 MiB or 64 MiB header: 431 or a hang-up, within QUICK_S."""
    started = time.monotonic()
    reply = _livez_with(stack, [("X-Big", "a" * (size_mib * MIB))])
    assert reply.status in REFUSED, f"a {size_mib} MiB header was answered {reply.status}"
    assert time.monotonic() - started < QUICK_S


def test_two_hundred_thousand_headers_are_refused_quickly(stack: Stack) -> None:
    """#3: 200,000 small headers: 431 or a hang-up, within QUICK_S."""
    started = time.monotonic()
    reply = _livez_with(stack, _many_headers(200_000))
    assert reply.status in REFUSED, f"200,000 headers were answered {reply.status}"
    assert time.monotonic() - started < QUICK_S


def test_header_floods_keep_memory_bounded_and_livez_answering(stack: Stack) -> None:
    """#3: four 64 MiB headers at once: the appliance's RSS grows by at most RSS_GROWTH_MIB and
    /livez (polled meanwhile) answers every poll, none after LIVEZ_WORST_S."""
    flood = _livez_request(stack, [("X-Big", "a" * (64 * MIB))])  # built before: no GIL hog

    def attack() -> None:
        with contextlib.suppress(Stalled):  # a server that stops reading is judged below
            _send(stack, flood)

    before = stack.usage()
    with PeakSampler(stack.pid) as sampler:
        livez = poll_livez_during(stack.url, [attack] * 4)
    grown = (sampler.peak.rss_bytes - before.rss_bytes) / MIB
    summary = f"RSS grew {grown:.0f} MiB; /livez {livez}"
    assert grown <= RSS_GROWTH_MIB, summary
    assert livez.failures == 0 and livez.worst < LIVEZ_WORST_S, summary


def test_ordinary_headers_are_accepted(stack: Stack) -> None:
    """Guard: 40 headers of 200 bytes (8 KB, a heavy but real browser request) are served."""
    reply = _livez_with(stack, [(f"X-Ordinary-{i}", "v" * 200) for i in range(40)])
    assert reply.status == 200


@pytest.mark.parametrize(("headers", "url_bytes"), [
    ([("X-Wide", "a" * 40_000)], 0),  # one header over the limit
    ([(f"X-Part-{i}", "b" * 3_000) for i in range(12)], 0),  # 36 KB in a dozen headers
    ([("X-Small", "c")], 40_000),  # the request line itself
], ids=["one-header", "a-dozen-headers", "long-url"])
def test_a_head_over_the_limit_is_refused_even_when_it_comes_in_one_read(
        stack: Stack, headers: list[HeaderItem], url_bytes: int) -> None:
    """Issue 20 #8: the head (32 KiB limit in this suite) sent in one write arrives in one read
    and is parsed whole before any byte count could stop it: the parser's parts are counted."""
    path = "/livez" + ("?q=" + "u" * url_bytes if url_bytes else "")
    reply = _send(stack, request_head("GET", path, stack.target, headers))
    assert reply.status == 431, f"a head over the limit in one read was answered {reply.status}"


def test_a_head_just_under_the_limit_in_one_read_is_served(stack: Stack) -> None:
    """Guard: 30 KB of headers in one read is under the 32 KiB limit."""
    assert _livez_with(stack, [(f"X-Near-{i}", "d" * 2_900) for i in range(10)]).status == 200
