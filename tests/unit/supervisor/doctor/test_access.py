"""The service user's access, judged from permission bits along each path."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from appliance.core.sections import CONFIG_ENV, EngineSettings
from appliance.core.settings import Settings
from supervisor.doctor.access import allowed, check_access, service_account
from supervisor.doctor.box import Account
from supervisor.doctor.report import Level
from tests.unit.supervisor.doctor.fakes import FakeBox

SERVICE = Account("chat-appliance", 64000, frozenset({64000}))


@pytest.fixture(autouse=True)
def config_of_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config the check reads is the install's own, not the test isolation's file in the
    checkout, whose directory a clean clone may have made 0700 (mktemp -d)."""
    config = tmp_path / "config.toml"
    config.write_text("")
    monkeypatch.setenv(CONFIG_ENV, str(config))


def _install(tmp_path: Path) -> Settings:
    """A world-readable install: an engine venv whose python links to an interpreter, a model."""
    base = tmp_path / "python" / "bin"
    base.mkdir(parents=True)
    (base / "python3.11").write_text("")
    (base / "python3.11").chmod(0o755)
    (tmp_path / "python" / "lib").mkdir()
    venv = tmp_path / "engine-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin" / "python").symlink_to(base / "python3.11")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_text("")
    tmp_path.chmod(0o755)
    return Settings(engine=EngineSettings(python=venv / "bin" / "python", model=str(model)))


class _Box(FakeBox):
    """The directories above the test's own are taken as root's 0755 ones (pytest's are 0700)."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(root=Path("/"), accounts={"chat-appliance": SERVICE, None: SERVICE})
        self.tmp_path = tmp_path

    def stat(self, path: Path) -> os.stat_result:
        if path in self.tmp_path.parents:
            return os.stat_result((stat.S_IFDIR | 0o755, 0, 0, 1, 0, 0, 0, 0, 0, 0))
        return super().stat(path)


def _box(tmp_path: Path) -> FakeBox:
    return _Box(tmp_path)


def test_a_world_readable_install_is_usable(tmp_path: Path) -> None:
    settings = _install(tmp_path)
    finding = check_access(_box(tmp_path), settings, SERVICE,
                           app_python=settings.engine.python)
    assert finding.level is Level.OK, finding.message


def test_an_interpreter_in_a_private_home_is_a_blocker_naming_it(tmp_path: Path) -> None:
    """The pyenv-in-root's-home case: the venv's link resolves into a 0700 directory."""
    settings = _install(tmp_path)
    (tmp_path / "python").chmod(0o700)
    finding = check_access(_box(tmp_path), settings, SERVICE,
                           app_python=settings.engine.python)
    assert finding.level is Level.BLOCKER
    assert f"engine interpreter ({tmp_path / 'python'})" in finding.message


def test_a_model_only_its_owner_may_read_is_refused(tmp_path: Path) -> None:
    _install(tmp_path)
    (tmp_path / "model" / "model.safetensors").chmod(0o600)
    where = allowed(_box(tmp_path), SERVICE, tmp_path / "model" / "model.safetensors", "r")
    assert where == str(tmp_path / "model" / "model.safetensors")


def test_before_install_what_is_not_built_yet_is_not_reported(tmp_path: Path) -> None:
    settings = _install(tmp_path).model_copy(deep=True)
    settings.engine.python = tmp_path / "not-yet" / "bin" / "python"
    box = _box(tmp_path)
    app = Path(sys.executable)
    assert check_access(box, settings, SERVICE, app_python=app,
                        missing_ok=False).level is Level.BLOCKER
    finding = check_access(box, settings, SERVICE, app_python=settings.engine.python,
                           missing_ok=True)
    assert finding.level is Level.OK, finding.message


def test_an_unknown_user_is_a_blocker(tmp_path: Path) -> None:
    box = _box(tmp_path)
    assert check_access(box, Settings(), service_account(box, "nobody-here")).level is Level.BLOCKER


def test_root_checks_on_behalf_of_the_service_user_and_anyone_else_as_themselves(
    tmp_path: Path,
) -> None:
    root = Account("root", 0, frozenset({0}))
    box = FakeBox(root=tmp_path, accounts={None: root, "chat-appliance": SERVICE})
    assert service_account(box, None) == SERVICE
    box.accounts[None] = SERVICE
    assert service_account(box, None) == SERVICE
    box.accounts = {None: root}
    assert service_account(box, None) == root  # no service user here: root itself


def test_serve_checks_its_own_access_not_the_service_users(tmp_path: Path) -> None:
    """Root running serve by hand on a box that also has the service user: its own access."""
    from supervisor.doctor import fast_checks

    root = Account("root", 0, frozenset({0}))
    box = FakeBox(root=Path("/"), accounts={None: root, "chat-appliance": SERVICE})
    access = next(f for f in fast_checks(Settings(), box) if f.check == "access")
    assert access.level is Level.OK and access.message.startswith("root can use"), access.message


def test_serve_leaves_a_wrong_model_path_to_the_workers_boot_failure(tmp_path: Path) -> None:
    """/health reports a model that is not there as a boot failure; serve does not refuse it."""
    from supervisor.doctor import fast_checks

    root = Account("root", 0, frozenset({0}))
    box = FakeBox(root=Path("/"), accounts={None: root})
    settings = Settings(engine={"model": str(tmp_path / "no-such-model")})
    access = next(f for f in fast_checks(settings, box) if f.check == "access")
    assert access.level is Level.OK, access.message
