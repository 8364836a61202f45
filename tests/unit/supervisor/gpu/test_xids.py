"""The Xid table: NVIDIA's catalog resolution classes, and what each asks of whom."""

from __future__ import annotations

import pytest

from supervisor.gpu.xids import OPERATOR_ACTIONS, XIDS, classify_xid


@pytest.mark.parametrize(("xid", "resolution"), [
    (8, "restart_app"), (13, "restart_app"), (31, "restart_app"), (43, "restart_app"),
    (68, "restart_app"), (94, "restart_app"), (109, "restart_app"),
    (45, "informational"), (63, "informational"), (92, "informational"),
    (48, "reset_gpu"), (64, "reset_gpu"), (74, "reset_gpu"), (95, "reset_gpu"),
    (119, "reset_gpu"), (120, "reset_gpu"),
    (79, "reboot"),
])
def test_the_catalog_class_of_each_xid(xid: int, resolution: str) -> None:
    assert classify_xid(xid).resolution == resolution


def test_only_reset_and_reboot_need_an_operator_and_the_action_names_the_gpu() -> None:
    assert classify_xid(13).operator_action("GPU-1") is None
    assert classify_xid(63).operator_action("GPU-1") is None
    assert classify_xid(48).operator_action("GPU-1") == (
        "stop chat-appliance, reset the GPU (nvidia-smi -r -i GPU-1), start it again")
    assert classify_xid(79).operator_action("GPU-1") == "reboot the machine"
    assert set(OPERATOR_ACTIONS) == {"reset_gpu", "reboot"}


def test_an_xid_the_table_does_not_know_restarts_the_worker() -> None:
    """The crash-loop guard ends in `failed` if the GPU itself is what fails."""
    unknown = classify_xid(9999)
    assert unknown.resolution == "restart_app"
    assert unknown.description == "xid 9999 (not in the catalog table)"


def test_every_entry_is_named_and_classed() -> None:
    for xid, (name, resolution) in XIDS.items():
        assert name and resolution in ("restart_app", "reset_gpu", "reboot", "informational"), xid
