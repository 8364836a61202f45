"""Fit a request's completion budget to the context window, counting the prompt only when needed.

Counting a prompt exactly takes a round trip to the worker's /tokenize (same tokenizer, same
chat template). Most requests cannot overflow the window, and a cheap upper bound proves it:
a byte-level tokenizer never makes more tokens than the UTF-8 bytes it reads, so the raw body's
length plus the template's own tokens (measured once per worker) bounds the prompt. Only a
request whose budget plus that bound exceeds the window is counted exactly and clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from appliance.apis.api import GenerationApi
from appliance.engine import EngineView
from appliance.errors import BadRequest
from appliance.policy.max_tokens import Clamp, clamp_max_tokens, given_budget
from appliance.settings import PolicySettings
from appliance.upstream import Upstream

log = structlog.get_logger("appliance.budget")

# The request keys that change how a chat prompt is rendered, as vLLM's /tokenize takes them.
_TEMPLATE_KEYS = ("messages", "tools", "chat_template", "chat_template_kwargs",
                  "add_generation_prompt", "continue_final_message", "add_special_tokens",
                  "mm_processor_kwargs", "media_io_kwargs")
# What changes how an Anthropic conversation is rendered, as count_tokens takes it.
_ANTHROPIC_KEYS = ("model", "messages", "system", "tools", "tool_choice", "thinking",
                   "output_config", "chat_template_kwargs")
# Tools and tool calls may be re-serialised by the template with indentation: allow 3x bytes.
_REFORMATTED = ("tools", "documents")
_SAFETY_TOKENS = 8
# The APIs whose count is the whole prompt (a batch's is its longest prompt's).
_ONE_PROMPT = ("messages", "responses", "anthropic")


@dataclass(frozen=True)
class Limits:
    """What one worker's tokenizer and template cost: measured once per worker process."""

    window: int
    chat_base: int  # a one-message conversation with empty content
    chat_per_message: int
    prompt_base: int  # the special tokens around a raw prompt


@dataclass(frozen=True)
class Fitted:
    clamp: Clamp | None
    counted: bool  # whether the prompt had to be counted exactly
    prompt: int | None = None  # the exact count, where the request has one prompt


class BudgetFitter:
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
        if budget + self._bound(api, body, raw_len, limits, multimodal) <= limits.window:
            return Fitted(None, counted=False)
        count = await self._count(api, body, budget, limits)
        if count is None:
            return Fitted(None, counted=False)  # the engine judges the request itself
        clamp = clamp_max_tokens(body, fields=api.budget_fields, prompt_tokens=count,
                                 max_model_len=limits.window, defaulted=defaulted)
        single = api.prompt in _ONE_PROMPT or isinstance(body.get("prompt"), str)
        return Fitted(clamp, counted=True, prompt=count if single else None)

    async def limits(self) -> Limits:
        pid = self._engine.pid
        if self._limits is None or self._limits[0] != pid:
            self._limits = (pid, await self._measure())
        return self._limits[1]

    async def _measure(self) -> Limits:
        _, models = await self._upstream.call("GET", "/v1/models")
        window = int(models["data"][0]["max_model_len"])
        one = await self._chat_tokens([{"role": "user", "content": ""}])
        three = await self._chat_tokens([{"role": "user", "content": ""},
                                         {"role": "assistant", "content": ""},
                                         {"role": "user", "content": ""}])
        prompt = await self._tokens({"prompt": ""})
        limits = Limits(window, one or 0, math.ceil(max(0, (three or 0) - (one or 0)) / 2),
                        prompt or 0)
        log.info("budget.limits_measured", **limits.__dict__)
        return limits

    def _bound(self, api: GenerationApi, body: dict[str, Any], raw_len: int, limits: Limits,
               multimodal: bool) -> float:
        """An upper bound of the prompt's tokens, or infinity where none is cheap."""
        if api.prompt == "prompt":
            prompts = body.get("prompt")
            if isinstance(prompts, list) and prompts and isinstance(prompts[0], list):
                return max(len(p) for p in prompts)  # token ids: exact already
            if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
                return len(prompts)
            return limits.prompt_base + raw_len + _SAFETY_TOKENS
        if multimodal or body.get("chat_template") is not None \
                or body.get("previous_response_id") is not None:
            # Images expand to many tokens; a custom template to anything; a previous
            # response's history lives in the worker.
            return math.inf
        return _chat_bound(body, raw_len, limits, _turns(api, body))

    async def _count(self, api: GenerationApi, body: dict[str, Any], budget: int,
                     limits: Limits) -> int | None:
        """The prompt's exact length (the longest, for a batch); None if the worker cannot say."""
        if api.prompt == "messages":
            return await self._tokens({k: body[k] for k in _TEMPLATE_KEYS if k in body})
        if api.prompt == "responses":
            # The render refuses a budget above the window, as generating would: leave it out.
            rendered = {k: v for k, v in body.items() if k not in api.budget_fields}
            return await self._rendered("/v1/responses/render", rendered)
        if api.prompt == "anthropic":
            counted = {k: body[k] for k in _ANTHROPIC_KEYS if k in body}
            return await self._counted("/v1/messages/count_tokens", counted, "input_tokens")
        if api.prompt == "conversations":
            return await self._count_conversations(body, budget, limits)
        return await self._count_prompts(body, budget, limits)

    async def _count_prompts(self, body: dict[str, Any], budget: int,
                             limits: Limits) -> int | None:
        prompts = body.get("prompt")
        items = prompts if isinstance(prompts, list) and prompts and not isinstance(
            prompts[0], int) else [prompts]
        longest = 0
        uncounted = [p for p in items if isinstance(p, str)
                     and budget + limits.prompt_base + len(p.encode()) + _SAFETY_TOKENS > limits.window]
        self._check_counted(len(uncounted), "prompt", "prompts")
        for item in items:
            if isinstance(item, list):
                longest = max(longest, len(item))
            elif isinstance(item, str):
                size = (await self._tokens({"prompt": item}) if item in uncounted
                        else limits.prompt_base + len(item.encode()))
                if size is None:
                    return None
                longest = max(longest, size)
        return longest

    async def _count_conversations(self, body: dict[str, Any], budget: int,
                                   limits: Limits) -> int | None:
        """A batch: each conversation that might not fit is counted as a chat's messages."""
        shared = {k: body[k] for k in _TEMPLATE_KEYS if k in body and k != "messages"}
        bounds = [(conversation, _chat_bound(shared, len(msgspec.json.encode(conversation)),
                                             limits, len(conversation)))
                  for conversation in body.get("messages") or []]
        uncounted = [c for c, bound in bounds if budget + bound > limits.window]
        self._check_counted(len(uncounted), "messages", "conversations")
        longest = max((int(bound) for c, bound in bounds if budget + bound <= limits.window),
                      default=0)
        for conversation in uncounted:
            size = await self._tokens(shared | {"messages": conversation})
            if size is None:
                return None
            longest = max(longest, size)
        return longest

    def _check_counted(self, count: int, param: str, what: str) -> None:
        most = self._policy.max_counted_prompts
        if count > most:
            raise BadRequest(
                f"{count} {what} of this batch are long enough to need counting; at most {most} "
                "are counted per request (setting policy.max_counted_prompts): send fewer or "
                "shorter ones, or a smaller budget.", param=param, code="too_many_long_prompts")

    async def _chat_tokens(self, messages: list[dict[str, Any]]) -> int | None:
        return await self._tokens({"messages": messages})

    async def _tokens(self, payload: dict[str, Any]) -> int | None:
        payload = payload | {"model": self._engine.model_name}
        return await self._counted("/tokenize", payload, "count")

    async def _rendered(self, path: str, body: dict[str, Any]) -> int | None:
        """The length of the prompt the worker renders for this very body."""
        status, data = await self._upstream.call("POST", path, body)
        tokens = data.get("token_ids") if isinstance(data, dict) else None
        if status != 200 or not isinstance(tokens, list):
            log.info("budget.count_refused", status=status, path=path)
            return None
        return len(tokens)

    async def _counted(self, path: str, payload: dict[str, Any], key: str) -> int | None:
        status, data = await self._upstream.call("POST", path, payload)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get(key), int):
            log.info("budget.count_refused", status=status, path=path)
            return None
        return int(data[key])


def _turns(api: GenerationApi, body: dict[str, Any]) -> int:
    """How many chat messages the template renders for this body (the system one included)."""
    if api.prompt == "responses":
        items = body.get("input")
        return (len(items) if isinstance(items, list) else 1) + 1
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    if api.prompt == "conversations":
        return max((len(c) for c in messages or [] if isinstance(c, list)), default=0)
    return count + 1 if api.prompt == "anthropic" else count


def _chat_bound(body: dict[str, Any], raw_len: int, limits: Limits, turns: int) -> float:
    """A byte-level tokenizer makes at most one token per byte of the text the template is
    given, which the raw body holds; the template's own tokens are measured per message."""
    factor = 3 if any(body.get(key) for key in _REFORMATTED) else 1
    overhead = limits.chat_base + (limits.chat_per_message + 1) * turns
    return overhead + factor * raw_len + _SAFETY_TOKENS
