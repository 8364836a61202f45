"""The cap on sequences per request: n, best_of and the beam width."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.core.errors import BadRequest
from appliance.policy import check_n


def refusal(body: dict[str, Any], max_n: int = 2) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        check_n(body, max_n)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("param", ["n", "best_of", "beam_width"])
def test_a_value_above_the_cap_is_refused_naming_the_parameter(param: str) -> None:
    error = refusal({param: 3}, max_n=2)
    assert (error.param, error.code, error.reason) == (param, "sequence_limit_exceeded", "n_cap")
    assert "policy.max_n" in error.message and "2" in error.message


@pytest.mark.parametrize("param", ["n", "best_of", "beam_width"])
def test_a_value_equal_to_the_cap_passes(param: str) -> None:
    check_n({param: 2}, 2)


def test_absent_and_null_values_pass() -> None:
    check_n({}, 1)
    check_n({"n": None, "best_of": None, "beam_width": None}, 1)


def test_a_huge_n_is_refused_not_overflowed() -> None:
    assert refusal({"n": 10**30}).param == "n"


def test_under_beam_search_n_is_reported_as_the_beam_width() -> None:
    error = refusal({"use_beam_search": True, "n": 8}, max_n=4)
    assert error.param == "n"
    assert "beam width" in error.message


def test_best_of_is_checked_even_when_n_is_within_the_cap() -> None:
    assert refusal({"n": 1, "best_of": 5}).param == "best_of"


@pytest.mark.parametrize("value", [True, 0, -1, "3", 2.0])
def test_a_count_of_the_wrong_type_is_a_400_not_a_crash(value: Any) -> None:
    assert refusal({"n": value}).param == "n"
