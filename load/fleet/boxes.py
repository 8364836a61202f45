"""One appliance of the fleet: the real `serve` with the real CPU worker, pinned to one core."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from load.kit.appliance import TREE_MARKER, Appliance
from load.kit.isolation import clean_env
from load.kit.net import free_port

KEY = "sk-fleet-client"  # every box holds the same clients table
ROOT = Path(__file__).resolve().parents[2]
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


@dataclass
class Box:
    """A box's ports and directories stay across its restarts; `appliance` is the one running."""

    name: str
    core: int
    workdir: Path
    port: int = field(default_factory=free_port)
    engine_port: int = field(default_factory=free_port)
    run_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ca-fleet-")))
    synthetic: bool = False  # the synthetic upstream as worker: the plumbing, without vLLM
    appliance: Appliance | None = None
    runs: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control(self) -> Path:
        return self.run_dir / "control.sock"

    def env(self) -> dict[str, str]:
        clients = [{"name": "fleet-client", "key": KEY}]
        worker = {} if not self.synthetic else {
            "CHAT_APPLIANCE_ENGINE__COMMAND": json.dumps([
                sys.executable, "-m", "load.kit.synthetic_worker", "--port",
                str(self.engine_port), "--token-delay", "0.02"]),
            "CHAT_APPLIANCE_ENGINE__LISTEN": "tcp"}
        return clean_env() | worker | {
            "CHAT_APPLIANCE_SERVER__PORT": str(self.port),
            "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
            "CHAT_APPLIANCE_SERVER__CONTROL_SOCKET": str(self.control),
            "CHAT_APPLIANCE_ADMISSION__CLIENTS": json.dumps(clients),
            "CHAT_APPLIANCE_ENGINE__PORT": str(self.engine_port),
            "CHAT_APPLIANCE_ENGINE__SOCKET_DIR": str(self.run_dir / "worker"),
            "CHAT_APPLIANCE_ENGINE__MAX_MODEL_LEN": "2048",
            "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
            "CHAT_APPLIANCE_CRASHES__DIR": str(self.workdir / "crashes"),
            "CHAT_APPLIANCE_CANARY__FILE": str(self.workdir / "canary.json"),
            # vLLM's CPU worker binds its OpenMP threads to these cores: the box's own.
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
        }

    def start(self) -> Appliance:
        """`taskset -c <core> python -m supervisor.main serve`; its worker inherits the core."""
        self.runs += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        marker = uuid.uuid4().hex
        log_path = self.workdir / f"serve-{self.runs}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                ["taskset", "-c", str(self.core), sys.executable, "-m", "supervisor.main",
                 "serve"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env=self.env() | {TREE_MARKER: marker})
        socket = None if self.synthetic else self.run_dir / "worker" / "worker.sock"
        self.appliance = Appliance(self.url, proc, log_path, self.engine_port, marker, socket)
        return self.appliance

    @property
    def live(self) -> Appliance:
        assert self.appliance is not None, f"{self.name} is not running"
        return self.appliance

    def drain(self, wait: bool = True) -> subprocess.CompletedProcess[str]:
        """`chat-appliance drain` on the box's control socket, as an operator runs it."""
        command = [sys.executable, "-m", "supervisor.main", "drain", "--socket",
                   str(self.control), *(["--wait"] if wait else [])]
        return subprocess.run(command, env=clean_env(), capture_output=True, text=True,
                              timeout=300, check=False)

    def kill_engine(self) -> int:
        """kill -9 of the worker's server pid (its EngineCore dies with its process group)."""
        pid = self.live.worker_pid()
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_supervisor(self) -> None:
        """The box gone: its supervisor SIGKILLed; the worker it leaves is reaped in stop()."""
        self.live.proc.send_signal(signal.SIGKILL)
        self.live.proc.wait(10)

    def prefix_cache(self) -> tuple[float, float]:
        """(hits, queries) in tokens, from the worker's own /metrics."""
        text = self.live.engine_get("/metrics").text
        found = {_PREFIX_HITS: 0.0, _PREFIX_QUERIES: 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[1])
        return found[_PREFIX_HITS], found[_PREFIX_QUERIES]

    def stop(self) -> None:
        """SIGTERM (a drain), then whatever this box started is killed: no worker outlives it."""
        if self.appliance is None:
            return
        appliance, self.appliance = self.appliance, None
        appliance.stop()
        left = appliance.tree()
        for member in left:
            try:
                member.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=10)


def wait_all_ready(boxes: list[Box], timeout_s: float = 600) -> float:
    started = time.monotonic()
    for box in boxes:
        box.live.wait_ready(timeout_s)
    return time.monotonic() - started


