"""The monitors' clock in their tests: it stands still until the test moves `now`."""

from __future__ import annotations


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now
