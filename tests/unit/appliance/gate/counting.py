"""The real Gate, with the real BudgetFitter, over a worker that counts every prompt the same.

Tests of what the gate does to a body in order (a default budget, then the fit to the room)
drive this instead of calling the rules one after another themselves: a test that rebuilds
the gate's order would agree with a gate whose order is wrong.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from appliance.apis.api import GenerationApi
from appliance.core.settings import Settings
from appliance.gate.budget import BudgetFitter
from appliance.gate.gate import Gate, Vetted

MODEL = "counting-model"


@dataclass
class CountingWorker:
    """vLLM's answers as the BudgetFitter asks for them: its window, and `prompt` tokens for
    whatever is counted (a chat, a raw prompt, a rendered response, an Anthropic count)."""

    prompt: int
    window: int

    async def call(self, method: str, path: str,
                   body: dict[str, Any] | None = None) -> tuple[int, Any]:
        if path == "/v1/models":
            return 200, {"data": [{"id": MODEL, "max_model_len": self.window}]}
        return 200, {"count": self.prompt, "input_tokens": self.prompt,
                     "token_ids": [0] * self.prompt}


@dataclass
class _Engine:
    pid: int = 1
    model_name: str = MODEL


def counting_gate(prompt: int, window: int, **policy: Any) -> Gate:
    settings = Settings(policy=policy)
    fitter = BudgetFitter(CountingWorker(prompt, window), _Engine(), settings.policy)  # type: ignore[arg-type]
    return Gate(settings, fitter)


def through(gate: Gate, body: dict[str, Any], api: GenerationApi) -> Vetted:
    """`body` sent as a client would: vetted, then fitted, as the app does before forwarding."""
    vetted = gate.vet_now(json.dumps(body).encode(), api)
    asyncio.run(gate.fit_budget(vetted))
    return vetted
