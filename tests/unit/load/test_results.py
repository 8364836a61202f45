"""A bench's dated result file: what it printed, its command, its machine, never overwritten."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from load.kit import results

NOON = datetime(2026, 12, 5, 12, 30, tzinfo=UTC)


def test_the_file_holds_the_date_the_command_the_machine_and_what_was_printed(
        tmp_path: Path) -> None:
    with results.Printed() as printed:
        print("| target | ratio |\n| appliance | 0.91x |")
    assert printed.text() == "| target | ratio |\n| appliance | 0.91x |\n"
    path = results.save("load.bench.gateway", ["--against", "HEAD~1", "--note", "two words"],
                        printed.text(), tmp_path, NOON)
    assert path == tmp_path / "2026-12-05-bench-gateway.md"
    text = path.read_text()
    assert text.startswith("# load.bench.gateway, 2026-12-05\n")
    assert "`python -m load.bench.gateway --against 'HEAD~1' --note 'two words'`" in text
    assert f"{results.cpu_model()}" in text and " cores (" in text
    assert "| appliance | 0.91x |" in text


def test_what_is_printed_still_reaches_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with results.Printed() as printed:
        print("shown")
    assert printed.text() == "shown\n"
    assert capsys.readouterr().out == "shown\n"
    assert not isinstance(sys.stdout, results._Tee)


def test_a_second_run_the_same_day_gets_a_file_of_its_own(tmp_path: Path) -> None:
    first = results.save("load.hostile.cost_abort", [], "one", tmp_path, NOON)
    second = results.save("load.hostile.cost_abort", [], "two", tmp_path, NOON)
    assert (first.name, second.name) == ("2026-12-05-hostile-cost-abort.md",
                                         "2026-12-05-hostile-cost-abort-2.md")
    assert "one" in first.read_text() and "two" in second.read_text()


def test_without_arguments_the_command_is_this_process_s_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/x/load/bench/cpu.py", "--rounds", "4"])
    assert results.command("load.bench.cpu", None) == "python -m load.bench.cpu --rounds 4"


def test_a_bench_that_succeeded_is_recorded_one_that_broke_is_not(tmp_path: Path) -> None:
    def measure(code: int) -> int:
        print(f"ratio 1.00x (exit {code})")
        return code

    assert results.recorded("load.bench.x", ["--rounds", "1"], tmp_path, lambda: measure(2)) == 2
    assert list(tmp_path.iterdir()) == []
    assert results.recorded("load.bench.x", ["--rounds", "1"], tmp_path, lambda: measure(0)) == 0
    [saved] = tmp_path.iterdir()
    assert "ratio 1.00x (exit 0)" in saved.read_text()
