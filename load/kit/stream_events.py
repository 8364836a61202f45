"""A stream's events compared across runs: what each run draws anew (ids, creation times) set
aside, so a resumed stream and an uninterrupted one compare equal where they agree."""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]


def normalized(events: list[Event | str], names: dict[str, str]) -> list[Event | str]:
    """The events with each id and creation time as the n-th one met: two runs compare equal
    where only what each run draws anew differs."""
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (names.setdefault(v, f"id{len(names)}") if k in ("id", "item_id")
                        else 0 if k == "created_at" else walk(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value
    return [walk(event) for event in events]
