"""The worker's output in the log: lines as they are, a traceback as one event."""

from __future__ import annotations

from structlog.testing import capture_logs

from supervisor.engine.worker_output import MAX_LINES, WorkerOutput

TRACEBACK = """(APIServer pid=77) ERROR 11-29 10:00:00 [serving.py:1] Error in chat
(APIServer pid=77) Traceback (most recent call last):
(APIServer pid=77)   File "/venv/vllm/entrypoints/openai/serving.py", line 10, in create
(APIServer pid=77)     return await self._go(request)
(APIServer pid=77)   File "/venv/vllm/sampling_params.py", line 99, in _go
(APIServer pid=77)     raise ValueError("bad structured output")
(APIServer pid=77) ValueError: bad structured output
(APIServer pid=77) INFO 11-29 10:00:01 [api_server.py:1] next line""".splitlines()


def test_a_traceback_is_one_event_with_its_error_and_innermost_frame() -> None:
    with capture_logs() as logs:
        output = WorkerOutput("stderr")
        for line in TRACEBACK:
            output.line(line)
    events = [entry["event"] for entry in logs]
    assert events == ["worker.output", "worker.traceback", "worker.output"]
    traceback = logs[1]
    assert traceback["error"] == "ValueError: bad structured output"
    assert traceback["where"].endswith("line 99, in _go")
    assert (traceback["frames"], traceback["lines"]) == (2, 6)
    assert logs[2]["line"].endswith("next line")


def test_an_endless_traceback_is_cut_at_the_bound() -> None:
    with capture_logs() as logs:
        output = WorkerOutput("stderr")
        output.line("Traceback (most recent call last):")
        for _ in range(MAX_LINES * 3):
            output.line('  File "x.py", line 1, in f')
        output.close()
    assert {entry["event"] for entry in logs} == {"worker.traceback"}
    assert 3 <= len(logs) <= 4 and all(entry["lines"] <= MAX_LINES for entry in logs)


def test_a_traceback_cut_off_by_the_end_of_output_is_still_logged() -> None:
    with capture_logs() as logs:
        output = WorkerOutput("stdout")
        output.line("Traceback (most recent call last):")
        output.line('  File "x.py", line 1, in f')
        output.close()
    assert logs[0]["event"] == "worker.traceback" and logs[0]["error"] == "(incomplete)"
