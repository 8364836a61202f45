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
        def get_mp_context():  # vLLM's API server: spawn, by its platform (CPU) or cli_env_setup
            return multiprocessing.get_context("spawn")
    """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/utils.py": "from vllm.utils.system_utils import get_mp_context\n",
    "vllm/v1/executor.py": "from vllm.utils.system_utils import get_mp_context\n",
}

PROBE = """
import ctypes, json, os, socket, sys, threading, types
if os.environ.get("FAKE_CUDA_INITIALISED"):  # the API server process would hold a CUDA context
    sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
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


def probe(tmp_path: Path, **env_vars: str) -> dict[str, str]:
    for name, text in FAKE_VLLM.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", **env_vars}
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    seen: dict[str, str] = json.loads(result.stdout)
    seen["stderr"] = result.stderr
    return seen


def test_engine_core_is_forked_only_while_no_foreign_thread_runs(tmp_path: Path) -> None:
    seen = probe(tmp_path)
    assert seen["alone"] == "fork"
    assert seen["imported_later"] == "fork", "modules imported after the install see it too"
    assert seen["with_zmq"] == "fork", "libzmq's background threads are fork-safe"
    assert seen["with_a_pool"] == "spawn", "an unknown thread (an OpenMP pool?) keeps spawn"
    assert "start_method=spawn reasons=1 thread(s) besides the main one" in seen["stderr"]


def test_a_forked_engine_core_lets_go_of_the_api_servers_port(tmp_path: Path) -> None:
    """As a spawned one: once the server dies, its port refuses connections at once."""
    seen = probe(tmp_path)
    assert seen["engine_core_holds_the_port"] == "0"
    assert seen["server_holds_the_port"] == "True"


def test_on_a_gpu_engine_core_is_forked_too_unless_cuda_is_initialised(tmp_path: Path) -> None:
    """On a GPU vLLM's API server says spawn (cli_env_setup sets VLLM_WORKER_MULTIPROC_METHOD),
    for no reason of the GPU's: the fork is safe while the forking process has no CUDA
    context, which is vLLM's own condition."""
    assert probe(tmp_path)["alone"] == "fork"  # the policy no longer asks for the CPU platform
    seen = probe(tmp_path, FAKE_CUDA_INITIALISED="1")
    assert {seen[key] for key in ("alone", "imported_later", "with_zmq", "with_a_pool")} == {"spawn"}
    assert "start_method=spawn reasons=CUDA is initialised" in seen["stderr"]
