"""The verdict over two runs: only the listed n-cap refusals may differ."""

from __future__ import annotations

from tests.compat.compare import RunResult, Verdict, differences
from tests.compat.selection import ALLOWED_DIFFERENCES, EXCLUDED, FILES

N_TEST = next(iter(ALLOWED_DIFFERENCES)) + "[some-model]"
N_REFUSAL = ("openai.BadRequestError: Error code: 400 - 'n' value 3 is above this appliance's "
             "limit of 2 (setting policy.max_n).")
OTHER = "tests/entrypoints/openai/completion/test_completion.py::test_no_logprobs[m]"


def verdict(direct: dict[str, str], appliance: dict[str, str],
            messages: dict[str, str] | None = None) -> Verdict:
    first = RunResult("direct", "http://w", 1.0, direct, {})
    second = RunResult("appliance", "http://a", 1.0, appliance, messages or {})
    return Verdict(first, second, differences(first, second))


def test_an_n_cap_refusal_of_a_listed_test_is_the_allowed_difference() -> None:
    result = verdict({N_TEST: "passed", OTHER: "passed"}, {N_TEST: "failed", OTHER: "passed"},
                     {N_TEST: N_REFUSAL})
    assert result.ok
    assert [d.nodeid for d in result.found] == [N_TEST] and result.found[0].allowed


def test_a_listed_test_failing_for_another_reason_is_unexpected() -> None:
    result = verdict({N_TEST: "passed"}, {N_TEST: "failed"}, {N_TEST: "NotFoundError: 404"})
    assert not result.ok and [d.nodeid for d in result.unexpected] == [N_TEST]


def test_any_other_difference_is_unexpected_whatever_its_message() -> None:
    result = verdict({OTHER: "passed"}, {OTHER: "failed"}, {OTHER: N_REFUSAL})
    assert not result.ok and [d.nodeid for d in result.unexpected] == [OTHER]


def test_a_test_missing_from_one_run_is_a_difference() -> None:
    result = verdict({OTHER: "passed", N_TEST: "passed"}, {N_TEST: "passed"})
    assert not result.ok and [d.nodeid for d in result.unexpected] == [OTHER]


def test_a_run_that_reported_nothing_fails_without_listing_every_test() -> None:
    result = verdict({OTHER: "passed"}, {})
    assert not result.ok and not result.found
    assert "appliance run reported nothing" in result.render()


def test_a_failure_against_the_worker_itself_fails_the_verdict() -> None:
    """The selection must hold on the worker; a test failing in both runs is not silently equal."""
    result = verdict({OTHER: "failed"}, {OTHER: "failed"})
    assert not result.found and not result.ok
    assert OTHER in result.render()


def test_counts_and_render_name_both_runs() -> None:
    result = verdict({OTHER: "passed", N_TEST: "skipped"}, {OTHER: "passed", N_TEST: "skipped"})
    assert result.direct.counts() == {"passed": 1, "failed": 0, "skipped": 1}
    assert "direct" in result.render() and "appliance" in result.render()
    assert result.as_json()["ok"] is True


def test_exclusions_and_allowed_differences_name_selected_files_only() -> None:
    """A typo in a node id would silently exclude or allow nothing."""
    for nodeid in [*EXCLUDED, *ALLOWED_DIFFERENCES]:
        assert nodeid.split("::", 1)[0] in FILES, nodeid
        assert not set(EXCLUDED) & set(ALLOWED_DIFFERENCES)
