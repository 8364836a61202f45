"""`doctor` with a catalog: every model's directory, files and GPU reservation are checked, not
the default's alone, and the models loaded at once must fit the card together."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from appliance.core.sections import default_model
from appliance.core.settings import Settings
from supervisor.doctor.access import check_access, wanted_paths
from supervisor.doctor.report import Level
from supervisor.doctor.resources import check_models_gpu_memory
from supervisor.engine.gpu_budget import GIB, GpuMemory
from tests.unit.supervisor.doctor.fakes import engine_venv, gpu_box
from tests.unit.supervisor.doctor.test_access import (
    SERVICE,
    _box,
    _install,
    config_of_the_install,  # noqa: F401 (autouse)
)


def two_models(tmp_path: Path) -> Settings:
    """The access test's install, its model as `smol`, and a second model `gemma` beside it."""
    install = _install(tmp_path)
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text("{}")
    (gemma / "model-00001-of-00002.safetensors").write_text("")
    return install.model_copy(update={"models": Settings(models={
        "smol": {"path": install.engine.model},
        "gemma": {"path": str(gemma)}}).models})


def test_every_models_directory_and_weights_are_wanted(tmp_path: Path) -> None:
    settings = two_models(tmp_path)
    wanted = {(what, path) for what, path, _ in wanted_paths(settings, Path("/usr/bin/python3"))}
    assert {("model smol", tmp_path / "model" / "config.json"),
            ("model smol weights", tmp_path / "model" / "model.safetensors"),
            ("model gemma", tmp_path / "gemma" / "config.json"),
            ("model gemma weights", tmp_path / "gemma" / "model-00001-of-00002.safetensors"),
            } <= wanted
    one = {what for what, _, _ in wanted_paths(_install(tmp_path / "one"), Path("/usr/bin/python3"))}
    assert {"model", "model weights"} <= one  # one model: named as before


def test_a_second_model_the_service_cannot_read_is_a_blocker_naming_it(tmp_path: Path) -> None:
    settings = two_models(tmp_path)
    box = _box(tmp_path)
    assert check_access(box, settings, SERVICE, app_python=settings.engine.python).level \
        is Level.OK
    (tmp_path / "gemma").chmod(0o700)  # the test's user's, not the service's
    finding = check_access(box, settings, SERVICE, app_python=settings.engine.python)
    assert finding.level is Level.BLOCKER
    assert f"model gemma ({tmp_path / 'gemma'})" in finding.message
    assert "model smol" not in finding.message
    shutil.rmtree(tmp_path / "gemma")
    missing = check_access(box, settings, SERVICE, app_python=settings.engine.python)
    assert "model gemma" in missing.message and "(missing)" in missing.message


def gpu_catalog(tmp_path: Path, **each: Any) -> Settings:
    engine = engine_venv(tmp_path, "13.0")
    model = str(default_model())
    return Settings(engine=engine, models={"smol": {"path": model, **each},
                                           "again": {"path": model, **each}})


def test_each_models_reservation_is_checked_with_its_own_settings(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=24 * GIB, free_bytes=int(21.6 * GIB))
    settings = gpu_catalog(tmp_path, max_model_len=2048)
    settings.models["again"].max_model_len = 512
    findings = check_models_gpu_memory(box, settings)
    per_model = {f.detail["model"]: f for f in findings if "model" in f.detail}
    assert set(per_model) == {"smol", "again"}
    assert per_model["smol"].detail["window"] == 2048 and per_model["again"].detail["window"] == 512
    assert per_model["again"].message.startswith("model again: ")
    together = findings[-1]
    assert together.level is Level.OK and "the 2 largest models reserve" in together.message


def test_models_that_cannot_be_loaded_together_are_swapped_unless_one_is_pinned(
        tmp_path: Path) -> None:
    """0.6 of the card each: either fits alone, both never do. With the default pinned the
    other can never be loaded beside it (a blocker, as serve refuses it); unpinned, residency
    swaps them."""
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=24 * GIB, free_bytes=int(21.6 * GIB))
    settings = gpu_catalog(tmp_path, gpu_memory_utilization=0.6)
    findings = check_models_gpu_memory(box, settings)
    assert [f.level for f in findings[:2]] == [Level.OK, Level.OK]
    together = findings[-1]
    assert together.level is Level.BLOCKER and together.refuses_start
    assert "pinned" in together.message and "again, smol" in together.message
    settings.models["smol"].pinned = False
    swapped = check_models_gpu_memory(box, settings)[-1]
    assert swapped.level is Level.OK and "swaps them" in swapped.message
    one_at_a_time = settings.model_copy(update={"residency": settings.residency.model_copy(
        update={"max_loaded": 1})})
    assert "they fit together" in check_models_gpu_memory(box, one_at_a_time)[-1].message


def test_one_model_is_checked_as_before(tmp_path: Path) -> None:
    box = gpu_box(tmp_path / "root")
    box.memory = GpuMemory(total_bytes=24 * GIB, free_bytes=int(21.6 * GIB))
    engine = engine_venv(tmp_path, "13.0").model_copy(update={"model": default_model()})
    (finding,) = check_models_gpu_memory(box, Settings(engine=engine))
    assert finding.level is Level.OK and "model" not in finding.detail
