"""The service's state directory, and what is in it, is the service user's: a directory a root
run left there is named, with the fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from appliance.core.sections import SYSTEM_STATE
from supervisor.doctor.box import Account
from supervisor.doctor.report import Level
from supervisor.doctor.state import check_state_dir
from tests.unit.supervisor.doctor.fakes import FakeBox

SERVICE = Account("chat-appliance", 64000, frozenset({64000}))
ROOT = Account("root", 0, frozenset({0}))
DIRECTORY, FILE = stat.S_IFDIR, stat.S_IFREG


class _Box(FakeBox):
    """The state directory's entries are files under the fake root; who owns them, and their
    modes, are the test's (everything else: root's, 0755)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root, accounts={"chat-appliance": SERVICE, None: ROOT})
        self.owners: dict[Path, tuple[int, int, int]] = {}  # path: (kind | mode, uid, gid)

    def put(self, path: Path, kind: int, mode: int, owner: Account) -> None:
        target = self.path(path)
        if kind == DIRECTORY:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        self.owners[path] = (kind | mode, owner.uid, min(owner.gids))

    def stat(self, path: Path) -> os.stat_result:
        mode, uid, gid = self.owners.get(path, (DIRECTORY | 0o755, 0, 0))
        self.path(path).stat()  # absent here: absent there
        return os.stat_result((mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))

    def lstat(self, path: Path) -> os.stat_result:
        return self.stat(path)


def _installed(tmp_path: Path) -> _Box:
    """What install.sh --system leaves: the service's state directory with the model, root's."""
    box = _Box(tmp_path)
    box.put(SYSTEM_STATE, DIRECTORY, 0o750, SERVICE)
    box.put(SYSTEM_STATE / "models", DIRECTORY, 0o755, ROOT)
    box.put(SYSTEM_STATE / "cache", DIRECTORY, 0o750, SERVICE)
    return box


def test_a_fresh_install_is_the_service_users(tmp_path: Path) -> None:
    finding = check_state_dir(_installed(tmp_path), SERVICE)
    assert finding.level is Level.OK, finding.message


def test_the_run_directory_a_root_run_left_is_named_with_the_fix(tmp_path: Path) -> None:
    """The issue's box: /var/lib/chat-appliance/run, root's, 0700, made by `serve` as root."""
    box = _installed(tmp_path)
    box.put(SYSTEM_STATE / "run", DIRECTORY, 0o700, ROOT)
    finding = check_state_dir(box, SERVICE)
    assert finding.level is Level.WARNING
    assert str(SYSTEM_STATE / "run") in finding.message
    assert str(SYSTEM_STATE / "cache") not in finding.message
    assert "install.sh --system" in finding.fix
    assert f"chown -R chat-appliance:chat-appliance {SYSTEM_STATE / 'run'}" in finding.fix


def test_a_root_file_the_service_may_read_but_not_write_is_named(tmp_path: Path) -> None:
    box = _installed(tmp_path)
    box.put(SYSTEM_STATE / ".bash_history", FILE, 0o644, ROOT)
    assert check_state_dir(box, SERVICE).level is Level.WARNING


def test_a_state_directory_the_service_cannot_write_is_a_blocker(tmp_path: Path) -> None:
    box = _installed(tmp_path)
    box.put(SYSTEM_STATE, DIRECTORY, 0o755, ROOT)  # mkdir -p by a root run, before the install
    finding = check_state_dir(box, SERVICE)
    assert finding.level is Level.BLOCKER
    assert f"chown chat-appliance:chat-appliance {SYSTEM_STATE}" in finding.fix


def test_only_the_service_users_state_is_judged(tmp_path: Path) -> None:
    box = _installed(tmp_path)
    box.put(SYSTEM_STATE / "run", DIRECTORY, 0o700, ROOT)
    assert check_state_dir(box, ROOT).level is Level.SKIP
    assert check_state_dir(box, None).level is Level.SKIP
    assert check_state_dir(_Box(tmp_path / "elsewhere"), SERVICE).level is Level.SKIP
