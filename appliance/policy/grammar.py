"""Whether a grammar can finish at all: a root rule that only ever refers back to itself.

vLLM 0.32 accepts `root ::= root` (its syntax is sound) and fails the request at its first
token, a 500 on every route, or a stream cut. A rule can finish when one of its alternatives is
made of atoms that can: quoted strings, classes, Lark /regex/ terminals, optional or repeated-
zero-times parts, and rules that can finish (found by repeating until nothing changes). What
this module cannot read (a directive, an alias, a rule it does not know) is taken to finish:
only a grammar that surely matches nothing is refused.
"""

from __future__ import annotations

import re

# A grammar rule's head: GBNF/EBNF `name ::=`, Lark `name:` (with its `?`/`!` and `.priority`).
RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.\d+)?[ \t]*(::=|:)", re.MULTILINE)
_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*|//[^\n]*)
  | (?P<atom>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|\[(?:\\.|[^\]\\])*\]|/(?:\\.|[^/\\\n])+/[a-z]*|\.)
  | (?P<name>[A-Za-z_][\w-]*)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<optional>[*?]|\{\s*0\s*(?:,\s*\d*\s*)?\})
  | (?P<repeat>\+|\{\s*\d+\s*(?:,\s*\d*\s*)?\})
""", re.VERBOSE)
_ROOTS = ("root", "start")  # GBNF/EBNF's and Lark's


def rules(grammar: str) -> dict[str, str]:
    """Each rule's body by its name, in the grammar's order."""
    heads = list(RULE.finditer(grammar))
    ends = [head.start() for head in heads[1:]] + [len(grammar)]
    return {head.group(1): grammar[head.end():end]
            for head, end in zip(heads, ends[:len(heads)], strict=True)}


def unfinishable_root(grammar: str) -> str | None:
    """The name of the grammar's root rule when no string can ever complete it; else None."""
    bodies = rules(grammar)
    root = next((name for name in _ROOTS if name in bodies), None)
    if root is None:
        return None
    parsed = {name: _tokens(body) for name, body in bodies.items()}
    finishes: set[str] = {name for name, tokens in parsed.items() if tokens is None}
    changed = True
    while changed:  # each round adds at least one rule, or ends
        changed = False
        for name, tokens in parsed.items():
            if name not in finishes and tokens is not None \
                    and _alternatives(tokens, 0, finishes, bodies)[0]:
                finishes.add(name)
                changed = True
    return None if root in finishes else root


def _tokens(body: str) -> list[tuple[str, str]] | None:
    """The body's tokens (kind, text); None where a part of it is not understood."""
    tokens, at = [], 0
    while at < len(body):
        match = _TOKEN.match(body, at)
        if match is None:
            return None
        at = match.end()
        kind = match.lastgroup or ""
        if kind != "space":
            tokens.append((kind, match.group()))
    return tokens


def _alternatives(tokens: list[tuple[str, str]], at: int, finishes: set[str],
                  bodies: dict[str, str]) -> tuple[bool, int]:
    """Whether any alternative from `at` to the group's end can finish; where the group ends."""
    any_finishes, this_finishes = False, True
    while at < len(tokens):
        kind, text = tokens[at]
        if kind == "close":
            break
        if kind == "bar":
            any_finishes, this_finishes = any_finishes or this_finishes, True
            at += 1
            continue
        if kind == "open":
            item, at = _alternatives(tokens, at + 1, finishes, bodies)
        else:
            item = kind == "atom" or (kind == "name" and (text in finishes or text not in bodies))
        at += 1  # past the atom, or the group's `)`
        if at < len(tokens) and tokens[at][0] in ("optional", "repeat"):
            item = item or tokens[at][0] == "optional"
            at += 1
        this_finishes = this_finishes and item
    return any_finishes or this_finishes, at
