"""`chat-appliance status --watch`: refreshes until Ctrl-C, through an outage, at its interval."""

from __future__ import annotations

import io
from typing import Any

import pytest

from supervisor.main import (
    WATCH_INTERVAL_S,
    HealthUnavailable,
    _describe_health,
    main,
    watch_status,
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Answers:
    """/health answers in order; each entry a (status, body) or a HealthUnavailable."""

    def __init__(self, *answers: tuple[int, dict[str, Any]] | HealthUnavailable) -> None:
        self._answers = list(answers)

    def __call__(self) -> tuple[int, dict[str, Any]]:
        answer = self._answers.pop(0)
        if isinstance(answer, HealthUnavailable):
            raise answer
        return answer


class Sleeps:
    """Records each pause; Ctrl-C arrives during pause number `interrupt_at`."""

    def __init__(self, interrupt_at: int) -> None:
        self.taken: list[float] = []
        self._interrupt_at = interrupt_at

    def __call__(self, seconds: float) -> None:
        self.taken.append(seconds)
        if len(self.taken) == self._interrupt_at:
            raise KeyboardInterrupt


def health(state: str, restarts: int = 0) -> tuple[int, dict[str, Any]]:
    return (200 if state == "ready" else 503), {"state": state, "pid": 42, "restarts": restarts}


def test_watch_shows_each_refresh_through_a_restart_and_stops_cleanly_on_ctrl_c() -> None:
    out, sleeps = io.StringIO(), Sleeps(interrupt_at=4)
    fetch = Answers(health("ready"), HealthUnavailable("chat-appliance is not answering at x"),
                    health("starting", restarts=1), health("ready", restarts=1))
    assert watch_status(fetch, _describe_health, 0.5, out, sleep=sleeps, now=lambda: "12:00:00") == 0
    text = out.getvalue()
    shown = [line for line in text.splitlines() if line.startswith(("engine:", "chat-appliance"))]
    assert [line.split(" (")[0] for line in shown] == [
        "engine:   ready", "chat-appliance is not answering at x", "engine:   starting",
        "engine:   ready"]
    assert "restarts: 1" in text.split("starting")[1]
    assert sleeps.taken == [0.5] * 4
    assert "\x1b[2J" not in text, "a pipe gets plain blocks, no screen control codes"


def test_watch_redraws_the_screen_on_a_terminal() -> None:
    out = Terminal()
    watch_status(Answers(health("ready"), health("ready")), _describe_health, 2, out,
                 sleep=Sleeps(interrupt_at=2), now=lambda: "12:00:00")
    assert out.getvalue().count("\x1b[H\x1b[2J") == 2
    assert out.getvalue().startswith("\x1b[H\x1b[2J12:00:00  every 2 s, Ctrl-C to stop\n")


@pytest.mark.parametrize("interval", ["0", "-1", "soon"])
def test_interval_must_be_a_positive_number(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--watch", "--interval", interval])
    assert exited.value.code == 2
    assert "--interval" in capsys.readouterr().err


def test_status_watch_polls_the_appliance_at_the_default_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command line reaches the loop: --watch with no --interval uses the documented 2 s."""
    calls: list[tuple[float, bool]] = []

    def fake_watch(fetch: Any, render: Any, interval_s: float, out: Any) -> int:
        calls.append((interval_s, render is _describe_health))
        return 0

    monkeypatch.setattr("supervisor.main.watch_status", fake_watch)
    assert main(["status", "--watch"]) == 0
    assert calls == [(WATCH_INTERVAL_S, True)]
    assert WATCH_INTERVAL_S == 2.0
