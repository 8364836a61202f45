"""A test-only appliance with a fault injected behind two routes, served as serve serves it.

`alive()` raises (so GET /livez meets an unhandled exception) and the engine view's on_lost
raises (so a chat request meets one where the relay subscribes to the engine's loss). The process logs through
the supervisor's own logging set-up, as JSON lines on stderr.

Run: python -m tests.unit.appliance.edge.faulty_app --port 8000 --upstream http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from appliance.app import create_app
from appliance.core.sections import LoggingSettings
from appliance.core.settings import Settings
from supervisor.observe import logs
from tests.unit.appliance.fakes import FakeEngine


class InjectedFault(RuntimeError):
    """The bug the test plants: nothing in the appliance expects it."""


@dataclass
class FaultyEngine(FakeEngine):
    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        raise InjectedFault("injected fault in on_lost")


def _dead_alive() -> bool:
    raise InjectedFault("injected fault in alive()")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    logs.configure(LoggingSettings(format="json"))
    app = create_app(Settings(), FaultyEngine(args.upstream), alive=_dead_alive)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_config=None, access_log=False)


if __name__ == "__main__":
    main()
