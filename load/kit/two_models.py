"""The bundled SmolLM2 and Gemma 3 270M (`install.sh --model gemma3-270m`) as a catalog where
only one of them may be loaded at a time (by residency.max_loaded, or by the planner's
capacity): the configuration the residency tests and load.bench.swap run the real appliance
with."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from load.kit.appliance import Appliance, running_appliance

MODELS = Path(__file__).resolve().parents[2] / ".models"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct"
GEMMA = MODELS / "gemma-3-270m"


def gemma_installed() -> bool:
    return (GEMMA / "config.json").is_file()


def one_at_a_time(path: Path, *, min_resident_s: float, load_wait_s: float,
                  gemma_keep_alive_s: float | None = None,
                  memory_bytes: int | None = None) -> Path:
    """Writes the catalog to `path`: SmolLM2 the default (not pinned, so that it can be
    unloaded), Gemma with a 1024-token window; residency.max_loaded 1, or with `memory_bytes`
    no max_loaded but that capacity for the planner (set it under the two reservations' sum)."""
    keep = "" if gemma_keep_alive_s is None else f"keep_alive_s = {gemma_keep_alive_s}\n"
    limit = "max_loaded = 1" if memory_bytes is None else f"memory_bytes = {memory_bytes}"
    path.write_text(
        f"[models.smollm2]\npath = {json.dumps(str(SMOLLM2))}\ndefault = true\npinned = false\n\n"
        f"[models.gemma]\npath = {json.dumps(str(GEMMA))}\nmax_model_len = 1024\n{keep}\n"
        f"[residency]\n{limit}\nmin_resident_s = {min_resident_s}\n"
        f"load_wait_s = {load_wait_s}\n")
    return path


def models(appliance: Appliance) -> dict[str, Any]:
    """/health's entry per model."""
    return dict(appliance.health().json()["models"])


@contextlib.contextmanager
def serving(tmp_path: Path, config: Path, boot_s: float = 300) -> Iterator[Appliance]:
    """The appliance on `config`, once SmolLM2 (the one loaded at start) is ready."""
    with running_appliance(tmp_path, {"CHAT_APPLIANCE_CONFIG": str(config)}) as appliance:
        appliance.wait_ready()
        deadline = time.monotonic() + boot_s
        while models(appliance)["smollm2"]["state"] != "ready":
            assert time.monotonic() < deadline, appliance.tail()
            time.sleep(0.2)
        yield appliance
