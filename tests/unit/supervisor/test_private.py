"""What the supervisor writes is its user's alone: crash bundles 0600 in any directory, the
directories it makes 0700, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.core.sections import CrashSettings
from supervisor.forensics.bundles import Bundles
from supervisor.operator.private import private_dir, write_private


# Common, none at all, and one that takes the owner's own write bit.
@pytest.fixture(params=[0o022, 0o000, 0o277], ids=["umask-022", "umask-000", "umask-277"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_crash_bundle_in_an_existing_open_directory_is_readable_by_its_user_only(
        tmp_path: Path, umask: int) -> None:
    shared = tmp_path / "crashes"
    shared.mkdir()
    shared.chmod(0o755)  # an operator's directory, entered by every local user
    bundles = Bundles(CrashSettings(dir=shared))
    name = bundles.write({"pid": 1, "cause": {"reason": "hung", "at": 1.0}})
    assert name is not None
    assert mode(shared / f"{name}.json") == 0o600
    rewritten = bundles.write({"pid": 1, "cause": {"reason": "hung", "at": 1.0}, "more": 1}, name)
    assert rewritten == name and mode(shared / f"{name}.json") == 0o600
    assert mode(shared) == 0o755, "a directory that was there is not ours to change"
    assert [p.name for p in shared.iterdir()] == [f"{name}.json"], "no temporary file is left"


def test_every_directory_made_on_the_way_is_0700(tmp_path: Path, umask: int) -> None:
    target = tmp_path / "state" / "chat-appliance" / "crashes"
    name = Bundles(CrashSettings(dir=target)).write({"pid": 1, "cause": {"reason": "hung"}})
    for made in (tmp_path / "state", tmp_path / "state" / "chat-appliance", target):
        assert mode(made) == 0o700, made
    assert mode(target / f"{name}.json") == 0o600
    write_private(target / "other.json", b"{}")
    assert mode(target / "other.json") == 0o600
    private_dir(target)  # there already: nothing changes, nothing fails
    assert mode(target) == 0o700
