"""The interpreter vLLM's tests run in: the engine's packages plus vLLM's pinned pytest tools.

vLLM's tests import vllm, torch and the OpenAI SDK, which only the engine venv has; nothing may
be installed into that venv, so this is a venv of its own whose `.pth` file puts the engine's
site-packages on its path, with only pytest, pytest-asyncio, pytest-timeout and tblib added, at
the versions vLLM's own `requirements/test/cpu.txt` pins. Built aside, moved into place when
complete, reused while the engine and the pins are the same.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

ADDED = ("pytest", "pytest-asyncio", "pytest-timeout", "tblib")
PINS_FILE = "requirements/test/cpu.txt"
MARKER = "compat-env.json"
ENGINE_PTH = "_chat_appliance_engine.pth"
INSTALL_TIMEOUT_S = 600


class CompatEnvError(Exception):
    """The compatibility environment could not be built."""


def pinned(tree: Path, names: tuple[str, ...] = ADDED) -> list[str]:
    """`name==version` for each name, as vLLM's test requirements pin it."""
    pins: dict[str, str] = {}
    for line in (tree / PINS_FILE).read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep and name.lower() in names:
            pins[name.lower()] = f"{name.lower()}=={version.strip()}"
    missing = [name for name in names if name not in pins]
    if missing:
        raise CompatEnvError(f"{PINS_FILE} pins none of {missing}")
    return [pins[name] for name in names]


def engine_facts(python: Path) -> tuple[Path, str]:
    """(site-packages, version) of the venv that python belongs to, its links resolved."""
    code = "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); print(sys.version)"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    return Path(out[0]).resolve(), out[1]


def ensure_env(cache: Path, engine_python: Path, tree: Path) -> Path:
    """The compat venv's python under cache, built on first use or when its recipe changed."""
    engine_site, version = engine_facts(engine_python)
    pins = pinned(tree)
    recipe = {"engine_site": str(engine_site), "python": version, "pins": pins}
    env = cache / "venv"
    marker = env / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return env / "bin" / "python"
    staging = cache / "venv.part"
    shutil.rmtree(staging, ignore_errors=True)
    _run([str(engine_python), "-m", "venv", "--without-pip", str(staging)])
    own_site, _ = engine_facts(staging / "bin" / "python")
    (own_site / ENGINE_PTH).write_text(f"{engine_site}\n")
    # pip comes from the engine's site-packages (through the .pth) and installs into this venv.
    _run([str(staging / "bin" / "python"), "-m", "pip", "install", "--quiet", *pins])
    (staging / MARKER).write_text(json.dumps(recipe, indent=2))
    shutil.rmtree(env, ignore_errors=True)
    staging.replace(env)
    return env / "bin" / "python"


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise CompatEnvError(f"{' '.join(argv[:4])} ... failed:\n{result.stdout}{result.stderr}")
