"""A request as the appliance's Waiting holds it while the worker has it, with a secret body:
what the engine tests and the crash-bundle tests both describe."""

from __future__ import annotations

from dataclasses import dataclass

SECRET = b'{"messages": [{"role": "user", "content": "my secret prompt"}]}'


@dataclass
class Pending:
    """appliance.core.engine.Pending, as an Outbound shows it to the supervisor."""

    raw: bytes
    target: str = "/v1/chat/completions"
    stream: bool = True
    client_name: str = "team-a"

    def body(self) -> bytes | None:
        return self.raw
