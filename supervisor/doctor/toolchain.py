"""A C compiler and Python's headers, where the engine compiles.

On a GPU the worker is not eager: torch.compile runs Triton, which builds a small C launcher on
first use with $CC, else gcc, else clang (triton/runtime/build.py; read from source, not run
here), against Python.h from the engine interpreter's sysconfig include directory. A minimal
server has neither, and then every boot fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.core.sections import EngineSettings
from supervisor.doctor.box import Box
from supervisor.doctor.driver import engine_is_gpu
from supervisor.doctor.report import Finding, blocker, ok, skip

CHECK = "compiler"


def compiles(box: Box, engine: EngineSettings) -> bool:
    gpu = engine_is_gpu(box, engine)
    eager = engine.enforce_eager if engine.enforce_eager is not None else not gpu
    return gpu and not eager


def check_compiler(box: Box, engine: EngineSettings) -> Finding:
    if not engine_is_gpu(box, engine):
        return skip(CHECK, "no GPU: CPU engine (eager, nothing compiled)")
    if not compiles(box, engine):
        return skip(CHECK, "engine.enforce_eager: nothing compiled")
    compiler = box.env.get("CC") or box.which("gcc") or box.which("clang")
    if compiler is None or (box.env.get("CC") and box.which(compiler) is None):
        return blocker(CHECK, "no C compiler: Triton builds its launcher at the first start",
                       "apt-get install gcc (or set engine.enforce_eager = true: slower)")
    # Before install.sh has built the engine venv: the interpreter it is built from is ours.
    python = engine.python if engine.python.exists() else Path(sys.executable)
    include = box.python_include(python)
    if include is None:
        return blocker(CHECK, f"{python} does not run", "run install.sh again")
    if not box.path(include / "Python.h").is_file():
        return blocker(CHECK, f"no Python.h in {include}: Triton cannot build its launcher",
                       "install the engine Python's headers (Debian: apt-get install "
                       "python3-dev for the engine venv's Python version)")
    return ok(CHECK, f"{compiler} and {include}/Python.h", compiler=compiler)
