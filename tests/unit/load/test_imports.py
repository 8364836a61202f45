"""Every script in load/ still imports: a restructuring that moves a name they use breaks them
at once here, not when an operator next runs a benchmark."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import load

ROOT = Path(__file__).resolve().parents[3]


def test_every_load_module_imports() -> None:
    names = sorted(m.name for m in pkgutil.walk_packages(load.__path__, "load."))
    assert "load.bench.cpu" in names and "load.locust.locustfile" in names
    # In a process of their own: locust monkey-patches the standard library when imported.
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
