"""`chat-appliance selftest`: the operator's proof of the box, as a report (JSON and words).

This module stays light: the command line reads its arguments before anything heavy loads."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yes", action="store_true",
                        help="consent to disturb the running service (kill -9, a freeze)")
    parser.add_argument("--temporary", action="store_true",
                        help="test an instance of its own on free ports, even if one runs")
    parser.add_argument("--json", action="store_true",
                        help="the report as JSON on stdout (the summary goes to stderr)")
    parser.add_argument("--record-canary", action="store_true",
                        help="forget this model's canary record first: the run records it again")
