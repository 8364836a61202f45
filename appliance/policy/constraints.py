"""Output constraints vetted by what they cost the engine: regexes, grammars, JSON schemas, choices.

vLLM compiles a request's output constraint into a grammar and checks it at every token. Its
cost follows the constraint's shape, not the request's length: a short regex with nested
quantifiers (`(a+)+`) made every token of a CPU worker take seconds, for every client. So
each constraint is measured by category, wherever a request can carry one, and refused (400
naming the parameter) past a setting of [constraints]:

- regexes (`structured_outputs.regex`, `whitespace_pattern`, a schema's `pattern` and
  `patternProperties` keys, a structural tag's regex): length, group nesting, quantifier
  nesting (a repeated group that repeats inside: `(\\w+\\s?)*`), alternatives, repeat bounds;
- grammars (`structured_outputs.grammar`, a structural tag's grammar, EBNF or Lark): length,
  and the same nesting measures on their structure (quoted strings are atoms, Lark's /regex/
  terminals regexes);
- JSON schemas (`structured_outputs.json`, `response_format` json_schema, Responses'
  `text.format`, Anthropic's `output_config.format`, structural tags, and the parameters of
  tools the engine is made to call): encoded size, nesting depth, alternatives (anyOf, oneOf),
  enum size, length and item bounds, and the regexes inside;
- choices (`structured_outputs.choice`): how many, and their total length.

vLLM 0.32 no longer reads the legacy `guided_*` fields (it ignores them with a warning), so
they constrain nothing and are not vetted. A client may be refused constraints altogether
(`constraints.enabled`, or a named client's `output_constraints`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from appliance.core.errors import BadRequest
from appliance.core.sections import ConstraintSettings
from appliance.policy.grammar import rules, unfinishable_root

_QUANTIFIERS = "*+?{"
_REPEATED_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minContains",
                    "maxContains", "minProperties", "maxProperties")
_BRANCHES = ("anyOf", "oneOf", "allOf")
_FORCING_CHOICES = ("required", "any", "tool")  # OpenAI's and Anthropic's forced tool call


@dataclass
class Shape:
    """What a regex or grammar costs, measured on its structure."""

    depth: int = 0  # groups inside groups
    nesting: int = 0  # quantifiers inside quantified groups: `(a+)+` is 2
    alternatives: int = 0  # `|`, all of them
    largest_repeat: int = 0  # the largest bound of a counted repeat `{n,m}`


def check_constraints(body: Mapping[str, Any], limits: ConstraintSettings, *,
                      allowed: bool = True) -> str | None:
    """Every output constraint of the body within its limits; else 400 naming its parameter.
    The first one's parameter (what the cost watch names the request by), None if none."""
    first = None
    for param, kind, value in find_constraints(body):
        first = first or param
        if not (allowed and limits.enabled):
            raise BadRequest(f"'{param}' constrains the output, and output constraints are off "
                             "for this client (settings constraints.enabled, a client's "
                             "output_constraints).", param=param, code="constraints_not_allowed")
        if kind == "regex":
            check_regex(value, param, limits)
        elif kind == "grammar":
            check_grammar(value, param, limits)
        elif kind == "choice":
            check_choices(value, param, limits)
        else:
            check_schema(value, param, limits)
    return first


# The body's fields an output constraint can be under (find_constraints looks in no other).
_HOLDERS = frozenset(("structured_outputs", "response_format", "text", "output_config", "tools"))


def find_constraints(body: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(parameter, kind, value) of each output constraint, on any API's body."""
    if _HOLDERS.isdisjoint(body):
        return  # most bodies: one pass over their keys, in C
    structured = body.get("structured_outputs")
    if isinstance(structured, Mapping):
        for key, kind in (("regex", "regex"), ("whitespace_pattern", "regex"),
                          ("grammar", "grammar"), ("choice", "choice"), ("json", "schema"),
                          ("structural_tag", "schema")):
            if structured.get(key) is not None:
                yield f"structured_outputs.{key}", kind, structured[key]
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping):
        if response_format.get("type") == "structural_tag":
            yield "response_format", "schema", response_format
        schema = _at(response_format, "json_schema", "schema")
        if schema is not None:
            yield "response_format.json_schema.schema", "schema", schema
    for param, path in (("text.format.schema", ("text", "format", "schema")),
                        ("output_config.format.schema", ("output_config", "format", "schema"))):
        if (schema := _at(body, *path)) is not None:
            yield param, "schema", schema
    yield from _tool_schemas(body)


def _tool_schemas(body: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """The parameters of the tools vLLM compiles into a grammar: all of them when the call is
    forced (tool_choice required, any, or one named), a strict tool's own otherwise."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    choice = body.get("tool_choice")
    forced = choice in _FORCING_CHOICES or (isinstance(choice, Mapping) and (
        choice.get("type") in _FORCING_CHOICES or choice.get("type") == "function"))
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            continue
        inner = tool.get("function")
        function: Mapping[str, Any] = inner if isinstance(inner, Mapping) else tool
        strict = function.get("strict") is True or tool.get("strict") is True
        for key in ("parameters", "input_schema"):
            schema = function.get(key)
            if schema is not None and (forced or strict):
                where = "function." if function is not tool else ""
                yield f"tools[{index}].{where}{key}", "schema", schema


def _at(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


# --- regexes and grammars ----------------------------------------------------------------------

def check_regex(pattern: Any, param: str, limits: ConstraintSettings) -> None:
    if not isinstance(pattern, str):
        return  # the worker refuses a wrong type itself
    if len(pattern) > limits.max_regex_chars:
        raise _refused(param, f"is a regex of {len(pattern)} characters; at most "
                       f"{limits.max_regex_chars} are accepted (constraints.max_regex_chars)")
    _check_shape(measure_regex(pattern), param, limits, "regex")


def check_grammar(grammar: Any, param: str, limits: ConstraintSettings) -> None:
    if not isinstance(grammar, str):
        return
    if len(grammar) > limits.max_grammar_chars:
        raise _refused(param, f"is a grammar of {len(grammar)} characters; at most "
                       f"{limits.max_grammar_chars} are accepted (constraints.max_grammar_chars)")
    try:
        shape = measure_grammar(grammar)
    except RecursionError:  # rules referring down a chain longer than the stack
        raise _refused(param, "is a grammar whose rules refer to each other too deeply") from None
    _check_shape(shape, param, limits, "grammar")
    root = unfinishable_root(grammar)
    if root is not None:  # vLLM fails it only at its first token, as its own 500
        raise _impossible(param, f"is a grammar that matches nothing: its rule '{root}' can "
                          "never finish (every alternative refers back to a rule that cannot)")


def _check_shape(shape: Shape, param: str, limits: ConstraintSettings, what: str) -> None:
    if shape.nesting > limits.max_quantifier_nesting:
        raise _refused(param, f"is a {what} that repeats inside a repeat {shape.nesting} deep "
                       f"(like `(a+)+`); at most {limits.max_quantifier_nesting} is accepted "
                       "(constraints.max_quantifier_nesting)")
    if shape.depth > limits.max_group_nesting:
        raise _refused(param, f"is a {what} with groups nested {shape.depth} deep; at most "
                       f"{limits.max_group_nesting} (constraints.max_group_nesting)")
    if shape.alternatives > limits.max_alternatives:
        raise _refused(param, f"is a {what} with {shape.alternatives} alternatives; at most "
                       f"{limits.max_alternatives} (constraints.max_alternatives)")
    if shape.largest_repeat > limits.max_repeat:
        raise _refused(param, f"is a {what} with a repeat bound of {shape.largest_repeat}; at "
                       f"most {limits.max_repeat} (constraints.max_repeat)")


class _Group:
    __slots__ = ("inner", "last")

    def __init__(self) -> None:
        self.inner = 0  # the deepest quantifier nesting inside the group so far
        self.last: int | None = None  # the nesting of the last atom, before any quantifier


_NAME = re.compile(r"[A-Za-z_][\w-]*")


def measure_regex(pattern: str) -> Shape:
    return _measure(pattern, None)


def measure_grammar(grammar: str) -> Shape:
    """A grammar's rules measured as regexes over their atoms (quoted strings, classes, Lark
    /regex/ terminals, rule names), where a rule name weighs what its rule does: `root ::=
    word*` with `word ::= [a-z]+` nests as `([a-z]+)*`."""
    bodies = rules(grammar)
    nesting: dict[str, int] = {}
    shape = Shape()

    def weight(name: str) -> int:
        if name not in bodies:
            return 0
        if name not in nesting:
            nesting[name] = 0  # a rule that refers to itself: its recursion is not a repeat
            nesting[name] = _measure(bodies[name], weight).nesting
        return nesting[name]

    for body in bodies.values() if bodies else [grammar]:
        _join(shape, _measure(body, weight))
    return shape


def _measure(text: str, rules: Callable[[str], int] | None) -> Shape:
    """The shape of a regex (`rules` None) or of one grammar rule's body."""
    grammar = rules is not None
    shape, stack, i = Shape(), [_Group()], 0
    while i < len(text):
        char, top = text[i], stack[-1]
        if char == "\\" or char == "[":
            i = _skip_class(text, i) if char == "[" else i + 2
            top.last = 0
        elif rules is not None and (name := _NAME.match(text, i)) is not None:
            top.last = rules(name.group())
            i = name.end()
        elif grammar and char in "\"'":
            i = _skip_quoted(text, i)
            top.last = 0
        elif grammar and char == "/" and (end := text.find("/", i + 1)) > 0:
            inner = _measure(text[i + 1:end], None)
            _join(shape, inner)
            top.last = inner.nesting
            i = end + 1
        elif char == "(":
            stack.append(_Group())
            shape.depth = max(shape.depth, len(stack) - 1)
            i += 1
        elif char == ")" and len(stack) > 1:
            group = stack.pop()
            stack[-1].last = max(group.inner, group.last or 0)
            i += 1
        elif char == "|":
            shape.alternatives += 1
            top.last = None
            i += 1
        elif char in _QUANTIFIERS and top.last is not None:
            bound, i = _quantifier(text, i)
            if bound is None:  # a `{` that is no quantifier: a literal
                top.last = 0
                continue
            shape.largest_repeat = max(shape.largest_repeat, bound if bound != _UNBOUNDED else 0)
            nested = top.last + (1 if bound > 1 else 0)
            top.inner = max(top.inner, nested)
            shape.nesting = max(shape.nesting, nested)
            top.last = None  # `a**` quantifies nothing new
        else:  # a literal (in a grammar, space only separates atoms)
            top.last = top.last if grammar and char.isspace() else 0
            i += 1
        top = stack[-1]
        top.inner = max(top.inner, top.last or 0)
    return shape


_UNBOUNDED = 1 << 30


def _quantifier(text: str, i: int) -> tuple[int | None, int]:
    """(the repeat's upper bound, the index after it); None for what is not a quantifier."""
    char = text[i]
    if char == "{":
        end = text.find("}", i)
        low, comma, high = text[i + 1:end].partition(",") if end > 0 else ("", "", "")
        if end < 0 or not low.strip().isdigit() or (high.strip() and not high.strip().isdigit()):
            return None, i + 1
        bound = int(high) if high.strip() else (_UNBOUNDED if comma else int(low))
        i = end + 1
    else:
        bound = 1 if char == "?" else _UNBOUNDED
        i += 1
    if i < len(text) and text[i] in "?+":  # lazy or possessive: the same repeat
        i += 1
    return bound, i


def _join(shape: Shape, inner: Shape) -> None:
    shape.depth = max(shape.depth, inner.depth)
    shape.nesting = max(shape.nesting, inner.nesting)
    shape.alternatives += inner.alternatives
    shape.largest_repeat = max(shape.largest_repeat, inner.largest_repeat)


def _skip_class(text: str, i: int) -> int:
    """The index after a `[...]` class (a `]` first in it is a member)."""
    j = i + 1 + (text[i + 1:i + 2] == "^")
    j += text[j:j + 1] == "]"
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _skip_quoted(text: str, i: int) -> int:
    quote, j = text[i], i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


# --- JSON schemas and choices ------------------------------------------------------------------

def check_choices(choices: Any, param: str, limits: ConstraintSettings) -> None:
    if not isinstance(choices, list):
        return
    if not choices:  # vLLM refuses it only once a stream has begun
        raise _impossible(param, "is an empty list of choices")
    if len(choices) > limits.max_choices:
        raise _refused(param, f"holds {len(choices)} choices; at most {limits.max_choices} are "
                       "accepted (constraints.max_choices)")
    size = sum(len(choice) for choice in choices if isinstance(choice, str))
    if size > limits.max_schema_bytes:
        raise _refused(param, f"holds {size} characters of choices; at most "
                       f"{limits.max_schema_bytes} (constraints.max_schema_bytes)")


def check_schema(schema: Any, param: str, limits: ConstraintSettings) -> None:
    """A JSON schema (or structural tag), given as an object or as JSON text."""
    if isinstance(schema, str):
        if len(schema) > limits.max_schema_bytes:
            raise _schema_too_large(param, len(schema), limits)
        try:
            schema = msgspec.json.decode(schema)
        except (msgspec.DecodeError, RecursionError):
            raise _refused(param, "is a schema given as text that is not JSON") from None
    size = len(msgspec.json.encode(schema))
    if size > limits.max_schema_bytes:
        raise _schema_too_large(param, size, limits)
    _walk(schema, param, limits)


def _walk(schema: Any, param: str, limits: ConstraintSettings) -> None:
    """Every node of the schema, iteratively (a deep schema must not exhaust the stack)."""
    alternatives = 0
    pending: list[tuple[Any, int]] = [(schema, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > limits.max_schema_depth:
            raise _refused(param, f"is a schema nested more than {limits.max_schema_depth} "
                           "deep (constraints.max_schema_depth)")
        if isinstance(node, list):
            pending.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, Mapping):
            continue
        alternatives += _check_node(node, param, limits)
        if alternatives > limits.max_alternatives:
            raise _refused(param, f"is a schema with more than {limits.max_alternatives} "
                           "alternatives (anyOf, oneOf, allOf) (constraints.max_alternatives)")
        pending.extend((value, depth + 1) for value in node.values())


def _check_node(node: Mapping[str, Any], param: str, limits: ConstraintSettings) -> int:
    """One schema object's own costs; returns its alternatives."""
    for key in ("pattern", "regex", "whitespace_pattern"):
        check_regex(node.get(key), param, limits)
    if isinstance(node.get("grammar"), str):
        check_grammar(node["grammar"], param, limits)
    patterns = node.get("patternProperties")
    if isinstance(patterns, Mapping):
        for pattern in patterns:
            check_regex(pattern, param, limits)
    for key in _REPEATED_BOUNDS:
        bound = node.get(key)
        if isinstance(bound, int) and not isinstance(bound, bool) and bound > limits.max_repeat:
            raise _refused(param, f"has {key} {bound}; at most {limits.max_repeat} "
                           "(constraints.max_repeat)")
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > limits.max_choices:
        raise _refused(param, f"has an enum of {len(enum)} values; at most "
                       f"{limits.max_choices} (constraints.max_choices)")
    return sum(len(node[key]) for key in _BRANCHES if isinstance(node.get(key), list))


def _schema_too_large(param: str, size: int, limits: ConstraintSettings) -> BadRequest:
    return _refused(param, f"is a schema of {size} bytes; at most {limits.max_schema_bytes} "
                    "are accepted (constraints.max_schema_bytes)")


def _refused(param: str, why: str) -> BadRequest:
    return BadRequest(f"'{param}' {why}: an output constraint this costly slows the engine "
                      "for every request.", param=param, code="constraint_too_complex",
                      reason="constraint_too_complex")


def _impossible(param: str, why: str) -> BadRequest:
    return BadRequest(f"'{param}' {why}: no output can satisfy it.", param=param,
                      code="constraint_matches_nothing", reason="constraint_matches_nothing")
