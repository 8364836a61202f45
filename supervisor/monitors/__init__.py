"""The signals that can declare a worker dead, each a Monitor; the manager asks them in turn.

A new health signal is one module here with a class that has `name`, `reset()` and
`async check(worker) -> ExitCause | None`, plus one line where supervisor/serve.py builds
the list. A monitor keeps its own cadence: check() is called on every turn of the manager's
loop (about once a second) and returns at once when it is not yet due.
A monitor with `watches_boot = True` is asked during a boot too, between readiness probes.
"""

from __future__ import annotations

from typing import Protocol

from supervisor.engine.exits import ExitCause
from supervisor.engine.worker import Worker


class Monitor(Protocol):
    name: str

    def reset(self) -> None:
        """A new worker is being watched: forget what was learnt of the last one."""
        ...

    async def check(self, worker: Worker) -> ExitCause | None:
        """None while the worker looks fine; else why it must be restarted (or failed)."""
        ...
