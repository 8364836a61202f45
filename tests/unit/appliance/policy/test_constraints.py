"""Output constraints are vetted by category (regex, grammar, JSON schema, choices), wherever a
request can carry one; each category is tried with inputs of its kind beyond the ones the
limits were first written against, and with ordinary constraints that must pass."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.core.errors import BadRequest
from appliance.core.sections import ConstraintSettings
from appliance.policy.constraints import (
    check_constraints,
    find_constraints,
    measure_grammar,
    measure_regex,
)

LIMITS = ConstraintSettings()


def refused(body: dict[str, Any], limits: ConstraintSettings = LIMITS,
            allowed: bool = True) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        check_constraints(body, limits, allowed=allowed)
    assert caught.value.status == 400
    return caught.value


def regex(pattern: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": pattern}}


# --- regexes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [
    r"(a+)+", r"(a*)*b", r"(\w+\s?)*", r"((ab)*c)+", r"(?:x{2,5})+", r"([a-z]+,)*$",
    r"(\d+\.)+\d+", r"(a|b+)*", r"((a)+)+", r"(.*a){3}", r"(?P<n>[0-9]+-)+", r"(a{1,9}){1,9}",
    r"(x+x+)+y", r"(?:(?:a)*)*",
])
def test_a_repeat_inside_a_repeated_group_is_refused(pattern: str) -> None:
    """Nested quantifiers, in every spelling: `+ * {n,m}`, capturing or not, named, lazy."""
    error = refused(regex(pattern))
    assert error.param == "structured_outputs.regex" and error.code == "constraint_too_complex"
    assert "max_quantifier_nesting" in error.message


@pytest.mark.parametrize("pattern", [
    r"[a-z]+@[a-z]+\.com", r"\d{3}-\d{4}", r"(ab)+", r"(yes|no)", r"[A-Z][a-z]*( [A-Z][a-z]*)?",
    r"\{\"a\": \d+\}", r"[(+*)]+", r"a\(b+\)", r"(\+|-)?\d+(\.\d+)?", r"x{2}y?",
])
def test_ordinary_regexes_pass(pattern: str) -> None:
    """Classes, escapes and single repeats: a bracket or `+` inside a class is no group."""
    check_constraints(regex(pattern), LIMITS)


def test_regex_length_alternatives_repeats_and_group_depth_have_limits() -> None:
    assert "max_regex_chars" in refused(regex("a" * 1001)).message
    assert "max_alternatives" in refused(regex("|".join(f"w{i}" for i in range(70)))).message
    assert "max_repeat" in refused(regex(r"a{1,100000}")).message
    assert "max_repeat" in refused(regex(r"a{5000}")).message
    assert "max_group_nesting" in refused(regex("(" * 9 + "a" + ")" * 9)).message


def test_the_shape_is_measured_not_guessed() -> None:
    assert measure_regex(r"(a+)+").nesting == 2
    assert measure_regex(r"((a+)+)+").nesting == 3
    assert measure_regex(r"(a?)+").nesting == 1  # `?` repeats nothing
    assert measure_regex(r"a{,5}").nesting == 0  # not a quantifier in Python's syntax: literal
    assert measure_regex(r"(a|b|c)").alternatives == 2


def test_whitespace_pattern_is_a_regex_too() -> None:
    body = {"structured_outputs": {"json_object": True, "whitespace_pattern": r"( +\n?)*"}}
    assert refused(body).param == "structured_outputs.whitespace_pattern"


# --- grammars --------------------------------------------------------------------------------

@pytest.mark.parametrize("grammar", [
    'root ::= ("a"+)+',
    'root ::= (item ",")*\nitem ::= [a-z]+',  # the repeat is in another rule
    "start: word*\nword: LETTER+\nLETTER: /[a-z]/",
    "start: /(ab+)+/",  # a Lark regex terminal
    'root ::= ( [0-9]+ "." )* [0-9]+',
])
def test_a_grammar_that_nests_repeats_is_refused_also_through_rule_names(grammar: str) -> None:
    error = refused({"structured_outputs": {"grammar": grammar}})
    assert error.param == "structured_outputs.grammar"


@pytest.mark.parametrize("grammar", [
    'root ::= "yes" | "no"',
    'root ::= "(" [0-9]+ ")"',  # brackets and a `+` inside strings and classes
    'root ::= item ("," item)*\nitem ::= "a" | "b"',  # a list of atoms: one repeat deep
    "start: expr\nexpr: NUMBER | expr \"+\" expr\nNUMBER: /[0-9]+/",  # recursion is no repeat
])
def test_ordinary_grammars_pass(grammar: str) -> None:
    check_constraints({"structured_outputs": {"grammar": grammar}}, LIMITS)


def test_grammar_size_and_a_long_chain_of_rules_are_bounded() -> None:
    assert "max_grammar_chars" in refused(
        {"structured_outputs": {"grammar": 'root ::= "' + "a" * 9000 + '"'}}).message
    chain = "\n".join(f"r{i} ::= r{i + 1}" for i in range(900)) + '\nr900 ::= "a"+'
    refused({"structured_outputs": {"grammar": chain}},
            ConstraintSettings(max_grammar_chars=100_000))
    assert measure_grammar('root ::= "a" | "b"').alternatives == 1


# --- JSON schemas ----------------------------------------------------------------------------

def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"json": deep(20)}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(deep(20))}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": deep(20)}}},
     "response_format.json_schema.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": deep(20)}}},
     "text.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": deep(20)}}},
     "output_config.format.schema"),
])
def test_a_schema_nested_too_deep_is_refused_on_every_api(body: dict[str, Any],
                                                          param: str) -> None:
    error = refused(body)
    assert error.param == param and "max_schema_depth" in error.message


@pytest.mark.parametrize(("schema", "setting"), [
    ({"type": "string", "pattern": "(a+)+$"}, "max_quantifier_nesting"),
    ({"type": "object", "patternProperties": {"^(x|y+)+$": {"type": "string"}}},
     "max_quantifier_nesting"),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "[a-f0-9]{99999}"}}},
     "max_repeat"),
    ({"type": "string", "maxLength": 100000}, "max_repeat"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 50000}, "max_repeat"),
    ({"anyOf": [{"const": i} for i in range(70)]}, "max_alternatives"),
    ({"type": "object", "properties": {f"p{i}": {"oneOf": [{"type": "string"},
                                                            {"type": "integer"}]}
                                       for i in range(40)}}, "max_alternatives"),
    ({"enum": list(range(300))}, "max_choices"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                       for i in range(300)}}, "max_schema_bytes"),
])
def test_a_costly_schema_is_refused_by_what_makes_it_costly(schema: dict[str, Any],
                                                            setting: str) -> None:
    assert setting in refused({"structured_outputs": {"json": schema}}).message


def test_an_ordinary_schema_passes() -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 100},
        "email": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 10},
        "kind": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["name"]}
    check_constraints({"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "p", "schema": schema}}},
                      LIMITS)


def test_a_structural_tag_is_walked_for_its_regexes_and_grammars() -> None:
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": "(ab*)*"}]}}
    assert refused({"response_format": tag}).param == "response_format"
    grammar_tag = {"structural_tag": {"format": {"type": "grammar",
                                                 "grammar": 'root ::= ("x"+)+'}}}
    assert refused({"structured_outputs": grammar_tag}).param == "structured_outputs.structural_tag"


# --- tools the engine is made to call --------------------------------------------------------

COSTLY = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a+)+"}}}


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": COSTLY}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": COSTLY}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": COSTLY}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "name": "f", "parameters": COSTLY}],
      "tool_choice": "required"}, "tools[0].parameters"),  # Responses
    ({"tools": [{"name": "f", "input_schema": COSTLY}], "tool_choice": {"type": "any"}},
     "tools[0].input_schema"),  # Anthropic
])
def test_a_forced_or_strict_tools_schema_is_a_constraint(body: dict[str, Any],
                                                         param: str) -> None:
    assert refused(body).param == param


def test_a_tool_the_model_may_choose_freely_is_only_text() -> None:
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": COSTLY}}]}
    assert list(find_constraints(body)) == []
    check_constraints(body, LIMITS)


# --- choices and the per-client switch -------------------------------------------------------

def test_choices_are_bounded_in_number_and_length() -> None:
    assert "max_choices" in refused(
        {"structured_outputs": {"choice": [str(i) for i in range(300)]}}).message
    assert "max_schema_bytes" in refused(
        {"structured_outputs": {"choice": ["x" * 20000, "y" * 20000]}}).message
    check_constraints({"structured_outputs": {"choice": ["yes", "no"]}}, LIMITS)


@pytest.mark.parametrize("body", [
    regex("[0-9]+"), {"structured_outputs": {"choice": ["a", "b"]}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "string"}}}},
])
def test_a_client_refused_constraints_gets_400_for_any_of_them(body: dict[str, Any]) -> None:
    assert refused(body, allowed=False).code == "constraints_not_allowed"
    assert refused(body, ConstraintSettings(enabled=False)).code == "constraints_not_allowed"
    check_constraints({"messages": []}, ConstraintSettings(enabled=False), allowed=False)


# --- any input: a 400 or a pass, never a crash -------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["pattern", "anyOf", "enum", "maxLength",
                                                       "grammar", "type", "properties", "x"]),
                                      inner, max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab()[]{}|*+?\\,0123456789:=\"'/ \n", max_size=60), JSON)
def test_any_regex_grammar_or_schema_is_vetted_without_crashing(text: str, schema: Any) -> None:
    for body in (regex(text), {"structured_outputs": {"grammar": text}},
                 {"structured_outputs": {"json": schema}},
                 {"structured_outputs": {"choice": schema}}, {"tools": schema,
                                                              "tool_choice": "required"}):
        try:
            check_constraints(body, LIMITS)
        except BadRequest as error:
            assert error.param is not None
