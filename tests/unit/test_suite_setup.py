"""The test run's own set-up (tests/conftest.py): the fast suites first, Hypothesis repeatable
in CI."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from hypothesis import settings

from tests.conftest import CI_PROFILE, pytest_collection_modifyitems


def test_the_unit_tests_run_before_compat_and_the_real_workers_tests() -> None:
    root = Path("/checkout")
    collected = ["tests/compat/test_a.py", "tests/integration/test_b.py",
                 "tests/integration/test_c.py", "tests/unit/x/test_d.py",
                 "tests/compat/test_e.py", "tests/unit/test_f.py"]
    items = [SimpleNamespace(path=root / path) for path in collected]
    pytest_collection_modifyitems(SimpleNamespace(rootpath=root), items)  # type: ignore[arg-type]
    assert [str(item.path.relative_to(root)) for item in items] == [
        "tests/unit/x/test_d.py", "tests/unit/test_f.py", "tests/compat/test_a.py",
        "tests/compat/test_e.py", "tests/integration/test_b.py", "tests/integration/test_c.py"]


def test_hypothesis_draws_the_same_examples_on_every_ci_run() -> None:
    """.ci/run sets CI=true: there the project's profile is the one loaded, derandomized."""
    assert settings.get_profile(CI_PROFILE).derandomize
    if os.environ.get("CI") == "true":
        assert settings.get_current_profile_name() == CI_PROFILE
        assert settings.default.derandomize
