"""Streams recorded from vLLM 0.32 (CPU, SmolLM2) with and without
stream_options.include_usage, seed 7 so that the tokens are the same; ids and timestamps made
equal. The completion is n=2, max_tokens=3; the chat max_tokens=3."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent / "recorded"

COMPLETION_PLAIN = (_HERE / "completion_plain.sse").read_bytes()
COMPLETION_USAGE = (_HERE / "completion_usage.sse").read_bytes()
COMPLETION_TOKENS = 7
CHAT_PLAIN = (_HERE / "chat_plain.sse").read_bytes()
CHAT_USAGE = (_HERE / "chat_usage.sse").read_bytes()
CHAT_TOKENS = 34
