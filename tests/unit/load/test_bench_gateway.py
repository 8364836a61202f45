"""The gateway bench's before/after pair: the other tree runs from its own code and worker, on
the same transport as this one, and the report sets this tree against it."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from load.bench.client import Sample
from load.bench.report import Report
from load.bench.stack import ROOT, imports_from, listens_on_unix_socket, synthetic_worker


def tree(root: Path, *files: str) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def test_the_synthetic_worker_is_found_where_each_tree_keeps_it(tmp_path: Path) -> None:
    assert synthetic_worker(ROOT) == "load.kit.synthetic_worker"
    old = tree(tmp_path / "old", "tests/support/synthetic_upstream.py")
    assert synthetic_worker(old) == "tests.support.synthetic_upstream"
    with pytest.raises(SystemExit):
        synthetic_worker(tree(tmp_path / "none", "appliance/__init__.py"))


def test_a_tree_whose_worker_address_moved_still_gets_its_unix_socket(tmp_path: Path) -> None:
    """Each tree is measured on the transport it uses: this one keeps worker_address in
    appliance/core, an older one at appliance/, one older still had none (TCP)."""
    assert listens_on_unix_socket(ROOT)
    assert listens_on_unix_socket(tree(tmp_path / "flat", "appliance/worker_address.py"))
    assert not listens_on_unix_socket(tree(tmp_path / "tcp", "appliance/__init__.py"))


def test_the_other_tree_s_appliance_imports_that_tree_s_code(tmp_path: Path) -> None:
    assert imports_from(ROOT) == ROOT
    # A folder with no appliance of its own would import this checkout's: refused.
    with pytest.raises(SystemExit, match="would import from"):
        imports_from(tree(tmp_path / "empty", "README.md"))


def sample(requests: int, latency_s: float, seconds: float = 1.0) -> Sample:
    return Sample(requests=requests, tokens=requests * 64, elapsed_s=seconds,
                  latency_s=array("d", [latency_s] * requests),
                  ttft_s=array("d", [latency_s / 2] * requests))


def test_the_report_sets_this_tree_against_the_baseline() -> None:
    report = Report(64, 64, 0.0, 1, 1.0, ["direct", "appliance", "baseline"], [], 2)
    for stream in (True, False):
        report.add("direct", stream, 64, sample(400, 0.010), {})
        report.add("appliance", stream, 64, sample(300, 0.020), {"appliance": 0.3})
        report.add("baseline", stream, 64, sample(150, 0.040), {"baseline": 0.3})
    text = report.render(10.0)
    versus = text[text.index("against baseline"):]
    assert "streaming, 64 clients: requests/s 300.0 / 150.0 (2.00x)" in versus
    assert "proxy CPU ms per request 1.000 / 2.000 (0.50x)" in versus
    assert "request p50 ms 20.00 / 40.00 (0.50x)" in versus
