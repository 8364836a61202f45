"""When EngineCore may be forked, checked against a stand-in `vllm` package in a fresh
interpreter, so the threads that exist are the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/utils/__init__.py": "",
    "vllm/utils/system_utils.py": """
        import multiprocessing
        def get_mp_context():  # vLLM on the CPU: spawn, forced by the platform
            return multiprocessing.get_context("spawn")
    """,
    "vllm/platforms/__init__.py": """
        import os
        class _Platform:
            def is_cpu(self):
                return os.environ.get("FAKE_DEVICE", "cpu") == "cpu"
        current_platform = _Platform()
    """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/utils.py": "from vllm.utils.system_utils import get_mp_context\n",
    "vllm/v1/executor.py": "from vllm.utils.system_utils import get_mp_context\n",
}

PROBE = """
import ctypes, json, socket, sys, threading
from supervisor.template import engine_fork
import vllm.v1.engine.utils as launcher_module
engine_fork.install_engine_core_fork_policy()
import vllm.v1.executor as imported_later

def method(module):
    return module.get_mp_context().get_start_method()

def name_thread(name):
    ctypes.CDLL(None).prctl(15, name.encode())  # PR_SET_NAME, as libzmq names its threads
    stop.wait()

seen = {"alone": method(launcher_module), "imported_later": method(imported_later)}
api_port = socket.create_server(("127.0.0.1", 0))  # the API server's, bound before EngineCore

def engine_core():
    sys.exit(1 if engine_fork.is_listening_socket(api_port.fileno()) else 0)

context = launcher_module.get_mp_context()
if context.get_start_method() == "fork":
    core = context.Process(target=engine_core)
    core.start()
    core.join()
    seen["engine_core_holds_the_port"] = str(core.exitcode)
seen["server_holds_the_port"] = str(engine_fork.is_listening_socket(api_port.fileno()))
stop = threading.Event()
zmq = threading.Thread(target=name_thread, args=("ZMQbg/IO/0",))
zmq.start()
seen["with_zmq"] = method(launcher_module)
pool = threading.Thread(target=stop.wait)
pool.start()
seen["with_a_pool"] = method(launcher_module)
stop.set()
print(json.dumps(seen))
"""


def probe(tmp_path: Path, device: str) -> dict[str, str]:
    for name, text in FAKE_VLLM.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", "FAKE_DEVICE": device}
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    seen: dict[str, str] = json.loads(result.stdout)
    seen["stderr"] = result.stderr
    return seen


def test_engine_core_is_forked_on_the_cpu_only_while_no_foreign_thread_runs(
        tmp_path: Path) -> None:
    seen = probe(tmp_path, "cpu")
    assert seen["alone"] == "fork"
    assert seen["imported_later"] == "fork", "modules imported after the install see it too"
    assert seen["with_zmq"] == "fork", "libzmq's background threads are fork-safe"
    assert seen["with_a_pool"] == "spawn", "an unknown thread (an OpenMP pool?) keeps spawn"
    assert "start_method=spawn reasons=1 thread(s) besides the main one" in seen["stderr"]


def test_a_forked_engine_core_lets_go_of_the_api_servers_port(tmp_path: Path) -> None:
    """As a spawned one: once the server dies, its port refuses connections at once."""
    seen = probe(tmp_path, "cpu")
    assert seen["engine_core_holds_the_port"] == "0"
    assert seen["server_holds_the_port"] == "True"


def test_elsewhere_vllm_keeps_its_own_start_method(tmp_path: Path) -> None:
    """On a GPU vLLM already forks where CUDA allows; the policy never overrides it."""
    seen = probe(tmp_path, "cuda")
    assert {seen[key] for key in ("alone", "imported_later", "with_zmq", "with_a_pool")} == {"spawn"}

