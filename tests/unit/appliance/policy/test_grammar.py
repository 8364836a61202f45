"""A grammar that matches nothing is refused before the engine (appliance/policy/grammar.py)."""

from __future__ import annotations

import pytest

from appliance.core.errors import BadRequest
from appliance.core.sections import ConstraintSettings
from appliance.policy.constraints import check_constraints
from appliance.policy.grammar import unfinishable_root

NEVER = {
    "root ::= root": "root",
    "root ::= a\na ::= b\nb ::= a": "root",
    'root ::= ("x" root)': "root",
    'start: start "a"': "start",  # Lark's root
    "root ::= x{2,3}\nx ::= x": "root",
    'root ::= "\\"" root': "root",
}
FINISHES = [
    'root ::= "a" root | "b"',
    "root ::= a*\na ::= a",
    'root ::= ("x" root)?',
    "root ::= x{0,3}\nx ::= x",
    "?start: item+\nitem: WORD\n%import common.WORD",  # what it cannot read is taken to finish
    'root ::= [a-z]+ " " name\nname ::= "bob" | name "x"',
    "root ::= s\ns ::= s s s | s s | [a-z ]",
    "root ::= unknown-rule",  # vLLM's own parser refuses it, with its own 400
]


@pytest.mark.parametrize(("grammar", "root"), NEVER.items())
def test_a_root_that_can_never_finish_is_named(grammar: str, root: str) -> None:
    assert unfinishable_root(grammar) == root


@pytest.mark.parametrize("grammar", FINISHES)
def test_a_grammar_that_can_finish_is_let_through(grammar: str) -> None:
    assert unfinishable_root(grammar) is None


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"grammar": "root ::= root"}},
    {"structured_outputs": {"choice": []}},
])
def test_a_constraint_no_output_can_satisfy_is_a_400_naming_it(body: dict[str, object]) -> None:
    with pytest.raises(BadRequest) as refused:
        check_constraints(body, ConstraintSettings())
    assert refused.value.code == "constraint_matches_nothing"
    assert refused.value.param is not None and refused.value.param.startswith("structured_outputs.")
