"""The fault-load run's accounting: a request counts for every fault it met (in flight between
the signal and the new worker's readiness), the others apart, and two runs side by side."""

from __future__ import annotations

from load.faults.chaos import Strike
from load.faults.report import account, side_by_side
from load.faults.seams import Facts, Result


def answered(started: float, ended: float, text: str = "ok", status: int = 200,
             ttft_s: float | None = None) -> Result:
    return Result("chat-stream", "p", started, ended, status=status,
                  facts=Facts(text=text, ids=["id"], roles=1, complete=True), ttft_s=ttft_s)


def strikes() -> list[Strike]:
    first = Strike("kill", 101, 10.0, 100, recovered_s=13.0, new_pid=200)
    second = Strike("hang", 201, 30.0, 200)  # never recovered: it lasts to the run's end
    return [first, second]


def test_each_request_is_counted_for_the_faults_it_met_and_the_rest_apart() -> None:
    references = {("chat-stream", "p"): "ok"}
    results = [
        answered(1.0, 5.0),  # before any fault
        answered(8.0, 11.0, status=503),  # in flight at the kill
        answered(12.0, 16.0, text="oops", ttft_s=3.5),  # sent while the engine was away
        answered(14.0, 15.0),  # after the recovery
        answered(29.0, 40.0, status=503),  # in flight at the freeze, which never recovered
    ]
    run = account("resume on", results, strikes(), references)
    first, second = run.per_fault
    assert first.requests == 2 and first.failures == {"503": 1}
    assert first.seams == {"text discontinuity": 1} and first.ttft_s == [3.5]
    assert second.requests == 1 and second.failures == {"503": 1}
    assert run.met_none.requests == 2 and not run.met_none.failures
    assert run.total.requests == 5 and run.total.failures == {"503": 2}
    assert run.total.total_s == [4.0, 3.0, 4.0, 1.0, 11.0]


def test_two_runs_print_side_by_side_and_a_missing_fault_is_blank() -> None:
    references = {("chat-stream", "p"): "ok"}
    off = account("resume off", [answered(9.0, 11.0, status=503)], strikes(), references)
    on = account("resume on", [answered(9.0, 14.0)], strikes()[:1], references)
    lines = side_by_side([off, on]).splitlines()
    assert lines[0].split() == ["resume", "off", "resume", "on"]
    failures = [line for line in lines if line.startswith("  client-visible failures")]
    assert failures[0].split()[2:] == ["1", "(1", "503)", "0"]  # fault 1: off, then on
    fault2 = next(line for line in lines if line.startswith("fault 2"))
    assert "SIGSTOP EngineCore at 30 s, not recovered" in fault2
    assert fault2.rstrip().endswith("not recovered")  # nothing in the on column
