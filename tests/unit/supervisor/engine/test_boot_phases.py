"""Boot phases read from a real vLLM 0.32 CPU worker's output, captured with the time each line
arrived (vllm_cpu_boot.tsv: seconds since spawn, stream, line), and from CUDA runner lines."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from supervisor.engine.boot_phases import IMPORTING, READY, BootPhase, BootPhases

CAPTURE = Path(__file__).with_name("vllm_cpu_boot.tsv")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replay(phases: BootPhases, clock: Clock) -> list[BootPhase]:
    """Feed the captured boot as the pump would, each line at the moment it arrived."""
    reached = []
    # Newlines only: tqdm's progress lines carry carriage returns, as they came down the pipe.
    for row in CAPTURE.read_bytes().decode().rstrip("\n").split("\n"):
        offset, _stream, line = row.split("\t", 2)
        clock.now = 1000.0 + float(offset)
        phase = phases.feed(line)
        if phase is not None:
            reached.append(phase)
    return reached


def test_a_real_cpu_boot_goes_through_every_phase_in_order_with_its_seconds() -> None:
    clock = Clock()
    phases = BootPhases(started_at=1000.0, clock=clock)
    assert replay(phases, clock) == [
        BootPhase("configuring", 26.3),
        BootPhase("starting the engine core", 82.1),
        BootPhase("loading weights", 87.8),
        BootPhase("allocating the KV cache", 90.6),
        BootPhase("starting the API server", 97.8),
        BootPhase(READY, 104.4),
    ]
    assert phases.done


def test_each_phase_is_logged_once_and_the_boot_ends_with_its_timeline() -> None:
    clock = Clock()
    with capture_logs() as logs:
        replay(BootPhases(started_at=1000.0, clock=clock), clock)
    boots = [(entry["phase"], entry["after_s"]) for entry in logs if entry["event"] == "engine.boot"]
    assert [name for name, _ in boots] == ["configuring", "starting the engine core",
                                           "loading weights", "allocating the KV cache",
                                           "starting the API server", READY]
    (booted,) = [entry for entry in logs if entry["event"] == "engine.booted"]
    assert booted["after_s"] == 104.4
    assert booted["timeline"] == (
        "importing vLLM 26.3 s → configuring 55.8 s → starting the engine core 5.7 s → "
        "loading weights 2.8 s → allocating the KV cache 7.2 s → "
        "starting the API server 6.6 s → ready after 104.4 s")


def test_a_boot_starts_importing_and_ignores_lines_that_open_no_phase() -> None:
    phases = BootPhases(started_at=0.0, clock=lambda: 3.0)
    assert phases.phase == BootPhase(IMPORTING, 0.0)
    assert phases.feed("WARNING Triton is not installed.") is None
    assert phases.timeline() == "importing vLLM …"


def test_phases_only_move_forward() -> None:
    """EngineCore repeats early lines; a late repeat must not send the display backwards."""
    clock = Clock()
    phases = BootPhases(started_at=1000.0, clock=clock)
    assert phases.feed("INFO [cpu_model_runner.py:68] Starting to load model /m...") is not None
    assert phases.feed("INFO [api_utils.py:286] non-default args: {'model': '/m'}") is None
    assert phases.phase.name == "loading weights"
    assert phases.timeline() == "importing vLLM 0.0 s → loading weights …"


def test_cuda_runner_lines_open_the_same_phases() -> None:
    phases = BootPhases(started_at=0.0, clock=lambda: 1.0)
    lines = [
        "(EngineCore_DP0 pid=7) INFO [gpu_model_runner.py:5040] Starting to load model /m...",
        "(EngineCore_DP0 pid=7) INFO [gpu_model_runner.py:5150] Model loading took 15.2 GiB "
        "memory and 10.500000 seconds",
        "(EngineCore_DP0 pid=7) INFO [core.py:403] init engine (profile, create kv cache, "
        "warmup model) took 41.20 s",
        "INFO:     Application startup complete.",
    ]
    assert [getattr(phases.feed(line), "name", None) for line in lines] == [
        "loading weights", "allocating the KV cache", "starting the API server", READY]


def test_after_ready_nothing_is_logged_for_the_rest_of_the_workers_life() -> None:
    phases = BootPhases(started_at=0.0, clock=lambda: 1.0)
    phases.feed("INFO:     Application startup complete.")
    with capture_logs() as logs:
        assert phases.feed("INFO:     Application startup complete.") is None
        assert phases.feed("(EngineCore pid=7) INFO Starting to load model /m...") is None
    assert logs == []
