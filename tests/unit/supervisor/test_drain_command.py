"""Drain: `chat-appliance drain` asks the control socket, the supervisor treats it as SIGTERM's
stop (not ready at once, what it holds finishes, then it exits 0), and `--wait` returns once
the supervisor is gone."""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.main import main
from supervisor.operator.control import control_socket
from supervisor.serve import Signals

pytestmark = pytest.mark.anyio


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A Unix socket's path must fit in 108 bytes: pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="ca-drn-") as name:
        yield Path(name)


async def test_drain_starts_the_stop_once_and_says_what_is_in_flight() -> None:
    signals, in_flight = Signals(), [3]
    answer = signals.drain(lambda: in_flight[0], 30.0)
    assert signals.first.is_set() and not signals.second.is_set()
    assert signals.cause == "drain command"
    assert answer == {"draining": True, "in_flight": 3, "drain_timeout_s": 30.0}
    in_flight[0] = 1
    # A second drain is not a second signal: it never forces the stop past the drain.
    assert signals.drain(lambda: in_flight[0], 30.0)["in_flight"] == 1
    assert not signals.second.is_set()


async def test_a_signal_before_the_drain_keeps_its_cause() -> None:
    signals = Signals()
    signals._record(signal.SIGTERM)
    signals.drain(lambda: 0, 30.0)
    assert signals.cause == "signal"


def _drain_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["drain", *args])
    return code, out.getvalue(), err.getvalue()


async def test_the_command_asks_the_socket_and_prints_the_answer(short_dir: Path) -> None:
    path, signals = short_dir / "run" / "control.sock", Signals()
    actions = {"drain": lambda: signals.drain(lambda: 2, 12.5)}
    async with control_socket(path, actions):
        code, out, _ = await asyncio.to_thread(_drain_cli, "--socket", str(path))
    assert code == 0 and signals.first.is_set()
    assert out.splitlines()[-1] == "draining: 2 in flight, stopping within 12.5 s"


async def test_wait_returns_once_the_supervisor_has_removed_its_socket(short_dir: Path) -> None:
    path, signals = short_dir / "run" / "control.sock", Signals()
    actions = {"drain": lambda: signals.drain(lambda: 0, 1.0)}
    async with control_socket(path, actions):
        waiting = asyncio.ensure_future(asyncio.to_thread(_drain_cli, "--socket", str(path),
                                                          "--wait"))
        await signals.first.wait()
        await asyncio.sleep(0.5)
        assert not waiting.done()  # the socket is still there: the supervisor still runs
    code, out, _ = await waiting
    assert code == 0 and out.splitlines()[-1] == "stopped"


async def test_nothing_answering_is_exit_3_naming_the_socket(short_dir: Path) -> None:
    path = short_dir / "none.sock"
    code, _, err = await asyncio.to_thread(_drain_cli, "--socket", str(path))
    assert code == 3 and str(path) in err
