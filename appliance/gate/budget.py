"""Fit a request's completion budget to the context window, counting the prompt only when needed.

Counting a prompt exactly takes a round trip to the worker; most requests cannot overflow the
window, and a cheap upper bound proves it (see appliance.apis.counting). Each API gives its own
bound and its own way of counting (GenerationApi.prompt_bound, .count_prompt); the fitter
measures the worker's template costs once per worker, asks the bound, and only when budget plus
bound exceeds the window has the prompt counted exactly, through the worker routes it offers
the API (a PromptCounter), and clamps the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import structlog

from appliance.apis.api import GenerationApi
from appliance.apis.counting import Limits
from appliance.core.engine import EngineView
from appliance.core.errors import BadRequest
from appliance.core.sections import PolicySettings
from appliance.core.upstream import Upstream
from appliance.policy.max_tokens import Clamp, clamp_max_tokens, given_budget

log = structlog.get_logger("appliance.budget")


@dataclass(frozen=True)
class Fitted:
    clamp: Clamp | None
    counted: bool  # whether the prompt had to be counted exactly
    prompt: int | None = None  # the exact count, where the request has one prompt


class BudgetFitter:
    """Fits budgets; to the APIs, the PromptCounter that asks the worker."""

    def __init__(self, upstream: Upstream, engine: EngineView, policy: PolicySettings) -> None:
        self._upstream = upstream
        self._engine = engine
        self._policy = policy
        self._limits: tuple[int | None, Limits] | None = None  # (worker pid, limits)

    async def fit(self, api: GenerationApi, body: dict[str, Any], raw_len: int,
                  *, defaulted: bool, multimodal: bool) -> Fitted:
        """Clamp the budget in `body` if prompt + budget could exceed the window."""
        budget = given_budget(body, api.budget_fields)
        if budget is None:
            return Fitted(None, counted=False)  # vLLM fits its own default to the room
        limits = await self.limits()
        if budget + api.prompt_bound(body, raw_len, limits, multimodal) <= limits.window:
            return Fitted(None, counted=False)
        count = await api.count_prompt(body, budget, limits, self)
        if count is None:
            return Fitted(None, counted=False)  # the engine judges the request itself
        clamp = clamp_max_tokens(body, fields=api.budget_fields, prompt_tokens=count,
                                 max_model_len=limits.window, defaulted=defaulted)
        return Fitted(clamp, counted=True, prompt=count if api.one_prompt(body) else None)

    async def limits(self) -> Limits:
        pid = self._engine.pid
        if self._limits is None or self._limits[0] != pid:
            self._limits = (pid, await self._measure())
        return self._limits[1]

    async def _measure(self) -> Limits:
        _, models = await self._upstream.call("GET", "/v1/models")
        window = int(models["data"][0]["max_model_len"])
        one = await self.tokenize({"messages": [{"role": "user", "content": ""}]})
        three = await self.tokenize({"messages": [{"role": "user", "content": ""},
                                                  {"role": "assistant", "content": ""},
                                                  {"role": "user", "content": ""}]})
        prompt = await self.tokenize({"prompt": ""})
        limits = Limits(window, one or 0, math.ceil(max(0, (three or 0) - (one or 0)) / 2),
                        prompt or 0)
        log.info("budget.limits_measured", **limits.__dict__)
        return limits

    # --- appliance.apis.counting.PromptCounter ----------------------------------------------

    def check_counted(self, count: int, param: str, what: str) -> None:
        most = self._policy.max_counted_prompts
        if count > most:
            raise BadRequest(
                f"{count} {what} of this batch are long enough to need counting; at most {most} "
                "are counted per request (setting policy.max_counted_prompts): send fewer or "
                "shorter ones, or a smaller budget.", param=param, code="too_many_long_prompts")

    async def tokenize(self, payload: dict[str, Any]) -> int | None:
        payload = payload | {"model": self._engine.model_name}
        return await self.count("/tokenize", payload, "count")

    async def render(self, path: str, body: dict[str, Any]) -> int | None:
        status, data = await self._upstream.call("POST", path, body)
        tokens = data.get("token_ids") if isinstance(data, dict) else None
        if status != 200 or not isinstance(tokens, list):
            log.info("budget.count_refused", status=status, path=path)
            return None
        return len(tokens)

    async def count(self, path: str, payload: dict[str, Any], key: str) -> int | None:
        status, data = await self._upstream.call("POST", path, payload)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get(key), int):
            log.info("budget.count_refused", status=status, path=path)
            return None
        return int(data[key])
