"""A request as the appliance's Waiting holds it while the worker has it, with a secret body:
what the engine tests and the crash-bundle tests both describe."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.admission.clients import Client

SECRET = b'{"messages": [{"role": "user", "content": "my secret prompt"}]}'


@dataclass
class Pending:
    raw: bytes
    target: str = "/v1/chat/completions"
    stream: bool = True
    client: Client = field(default_factory=lambda: Client(name="team-a"))
