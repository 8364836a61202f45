"""install.sh's long steps show progress: a heartbeat with the elapsed time and what the step
last said when the output is a pipe, the command's own output (pip's progress bars) through a
terminal when it is one, and the log's tail with the advice when the step fails."""

from __future__ import annotations

import os
import pty
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bash(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` after sourcing install.sh (which then only defines its functions)."""
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", "-c", f"source ./install.sh\n{script}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_sourcing_install_sh_runs_nothing(tmp_path: Path) -> None:
    result = bash("true", tmp_path)
    assert result.returncode == 0
    assert result.stdout == "" and result.stderr == ""


def test_a_long_step_into_a_pipe_beats_with_elapsed_time_and_the_last_thing_it_said(
    tmp_path: Path,
) -> None:
    # The step takes a real couple of seconds: the heartbeat is about wall-clock time.
    step = "echo Collecting torch; sleep 2.5; echo Installing collected packages: torch"
    result = bash(f'HEARTBEAT_S=1; run_long "pip install vllm" "advice" bash -c "{step}"', tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "    pip install vllm ..."
    beats = [line for line in lines if re.fullmatch(r"      \.\.\. \d+ s: .+", line)]
    assert beats and "Collecting torch" in beats[0]
    assert re.fullmatch(r"    pip install vllm: done in [2-9] s", lines[-1])


def test_a_long_step_on_a_terminal_shows_its_own_output(tmp_path: Path) -> None:
    """pip draws progress bars only for a terminal: the step must see one, and the log a copy."""
    step = "test -t 1 && echo own-progress-on-a-terminal"
    main, child = pty.openpty()
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(["bash", "-c", f'source ./install.sh; run_long step advice bash -c "{step}"'],
                            cwd=ROOT, env=env, stdin=child, stdout=child, stderr=child)
    os.close(child)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed: every process holding it has exited
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert proc.wait(30) == 0, shown
    assert b"own-progress-on-a-terminal" in shown
    assert b"step: done in" in shown
    (log,) = tmp_path.glob("chat-appliance-install.*")
    assert "own-progress-on-a-terminal" in log.read_text()


def test_a_failing_long_step_shows_the_log_tail_and_the_advice(tmp_path: Path) -> None:
    result = bash('run_long "pip install vllm" "check the network" bash -c "echo no route; exit 3"',
                  tmp_path)
    assert result.returncode == 1
    assert "no route" in result.stderr
    assert "install.sh: error: check the network (full log:" in result.stderr
    assert "done in" not in result.stdout


def test_the_heartbeat_shows_a_redrawn_progress_bar_at_its_latest_state(tmp_path: Path) -> None:
    """tqdm (the model conversion) redraws one line with carriage returns."""
    (tmp_path / "log").write_bytes(b"starting\nConverting: 0%| 0/272\rConverting: 50%| 136/272"
                                   b"\rConverting: 99%| 270/272")
    result = bash('LOG="$TMPDIR/log"; last_log_line', tmp_path)
    assert result.stdout == "Converting: 99%| 270/272\n", result.stderr
