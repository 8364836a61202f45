"""The gate every generation request passes: auth, admission, then the policy rules in order."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog
from litestar import Request

from appliance import policy
from appliance.engine import EngineView
from appliance.errors import BadRequest, TooManyRequests
from appliance.metrics import Metrics
from appliance.proxy import Proxy
from appliance.settings import Settings

log = structlog.get_logger("appliance.gate")

_BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")
_CHAT_KEYS = ("messages", "tools", "chat_template", "chat_template_kwargs",
              "add_generation_prompt", "continue_final_message", "mm_processor_kwargs")
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "image_token_index", "image_token_id")


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


@dataclass
class Admitted:
    """A request that passed the gate: the body to forward and a slot to give back once."""

    payload: dict[str, Any]
    kind: str
    default_field: str | None = None  # the budget field the gate filled from the default
    headers: dict[str, str] = field(default_factory=dict)
    _gate: Gate | None = None

    def __post_init__(self) -> None:
        self.body = json.dumps(self.payload).encode()
        self.stream = self.payload.get("stream") is True

    @property
    def budgeted(self) -> bool:
        return any(self.payload.get(key) is not None for key in _BUDGET_FIELDS)

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release_slot()


class Gate:
    """Auth, admission and the policy rules, in that order; holds the in-flight slots."""

    def __init__(self, settings: Settings, engine: EngineView, proxy: Proxy,
                 metrics: Metrics) -> None:
        self._settings = settings
        self._engine = engine
        self._proxy = proxy
        self._metrics = metrics
        self._keys = [key.get_secret_value() for key in settings.server.api_keys]
        self._in_flight = 0
        self._tokenizer = httpx.AsyncClient(base_url=engine.base_url, trust_env=False,
                                            timeout=httpx.Timeout(30.0, connect=2.0))
        self._multimodal: bool | None = None

    async def aclose(self) -> None:
        await self._tokenizer.aclose()

    def authenticate(self, request: Request[Any, Any, Any]) -> None:
        policy.check_bearer(request.headers.get("authorization"), self._keys)

    def authenticate_ops(self, request: Request[Any, Any, Any]) -> None:
        if self._settings.server.protect_ops_routes:
            self.authenticate(request)

    async def admit(self, request: Request[Any, Any, Any], kind: str) -> Admitted:
        """Run every rule; raise an ApiError for the first that refuses, else hold a slot."""
        self.authenticate(request)
        self._proxy.ensure_ready()
        self._take_slot()
        try:
            return await self._vet(request, kind)
        except BaseException:
            self.release_slot()
            raise

    def release_slot(self) -> None:
        self._in_flight -= 1
        self._metrics.in_flight.set(self._in_flight)

    def _take_slot(self) -> None:
        # Decided before any tokenizing or image work: admission must stay cheap under overload.
        if self._in_flight >= self._settings.policy.max_inflight:
            raise TooManyRequests(
                f"more than {self._settings.policy.max_inflight} requests in flight; retry shortly",
                code="too_many_requests", retry_after_s=1, reason="admission")
        self._in_flight += 1
        self._metrics.in_flight.set(self._in_flight)

    async def _vet(self, request: Request[Any, Any, Any], kind: str) -> Admitted:
        rules = self._settings.policy
        body = policy.parse_json(await request.body())
        if kind == "chat":
            policy.validate_chat(body)
        else:
            policy.validate_completion(body)
        policy.check_n(body, rules.max_n)
        if kind == "chat":
            await self._check_media(body)
            policy.check_tools(body, tool_parser=self._settings.engine.tool_call_parser)
            policy.apply_thinking(body, default_kwargs=rules.default_chat_template_kwargs,
                                  disable_with_tools=rules.disable_thinking_with_tools)
        return Admitted(body, kind, self._apply_default_budget(body, kind), _gate=self)

    def _apply_default_budget(self, body: dict[str, Any], kind: str) -> str | None:
        """The configured default where the client gave no budget; refit() clamps it if needed."""
        default = self._settings.policy.default_max_tokens
        if default is None or any(body.get(key) is not None for key in _BUDGET_FIELDS):
            return None
        name = "max_completion_tokens" if kind == "chat" else "max_tokens"
        body[name] = default
        return name

    async def refit(self, admitted: Admitted) -> bool:
        """The worker refused the request (400): if a budget is the reason, count the prompt
        exactly with the worker's /tokenize, clamp it to the room left and say to send again.

        Counting only after a refusal keeps /tokenize off the hot path: a budget that fits is
        accepted by vLLM as is, and one that does not is refused in validation, before the
        engine schedules anything."""
        if not admitted.budgeted:
            return False
        body = dict(admitted.payload)
        if admitted.default_field is not None:
            del body[admitted.default_field]  # so the rule reports a clamped default as such
        count, window = await self._count_prompt(body, admitted.kind)
        clamp = policy.clamp_max_tokens(body, prompt_tokens=count, max_model_len=window,
                                        default_max_tokens=self._settings.policy.default_max_tokens)
        if clamp is None:
            return False  # the budget fits: the refusal was about something else
        self._metrics.clamps.inc()
        log.info("request.max_tokens_clamped", field=clamp.field, requested=clamp.requested,
                 applied=clamp.applied, prompt_tokens=count, max_model_len=window)
        admitted.payload, admitted.body = body, json.dumps(body).encode()
        admitted.headers[policy.CLAMP_HEADER] = policy.header_value(clamp)
        return True

    async def _check_media(self, body: dict[str, Any]) -> None:
        parts = policy.find_media_parts(body)
        if not parts:
            return
        rules = self._settings.policy
        policy.check_media(parts, multimodal=await self._is_multimodal(),
                           max_images=rules.max_images, max_image_bytes=rules.max_image_bytes,
                           allowed_hosts=rules.allowed_media_hosts)

    async def _is_multimodal(self) -> bool:
        """From settings, else asked of the worker once: does its model take images?"""
        setting = self._settings.policy.multimodal
        if setting != "auto":
            return setting == "on"
        if self._multimodal is None:
            self._multimodal = await self._ask_multimodal()
        return self._multimodal

    async def _ask_multimodal(self) -> bool:
        # vLLM's /v1/models does not say; the model directory's config does (a vision or audio
        # tower). A model we cannot read is treated as text-only: refusing is the safe side.
        path = f"{self._settings.engine.model}/config.json"
        try:
            hf = json.loads(await asyncio.to_thread(_read_text, path))
        except (OSError, ValueError):
            return False
        return isinstance(hf, dict) and any(key in hf for key in _MULTIMODAL_KEYS)

    async def _count_prompt(self, body: dict[str, Any], kind: str) -> tuple[int, int]:
        """Longest prompt and the window, counted by the worker's /tokenize (same template)."""
        if kind == "chat":
            return await self._tokenize({k: body[k] for k in _CHAT_KEYS if k in body}, kind)
        prompts = body.get("prompt", "")
        if not isinstance(prompts, list) or not prompts or isinstance(prompts[0], int):
            prompts = [prompts]
        counts = [await self._tokenize({"prompt": p}, kind) if isinstance(p, str)
                  else (len(p), await self._window()) for p in prompts]
        return max(c for c, _ in counts), counts[0][1]

    async def _window(self) -> int:
        return (await self._tokenize({"prompt": ""}, "completion"))[1]

    async def _tokenize(self, payload: dict[str, Any], kind: str) -> tuple[int, int]:
        payload["model"] = self._engine.model_name
        try:
            response = await self._tokenizer.post("/tokenize", json=payload)
        except httpx.HTTPError as exc:
            raise self._proxy.unavailable(exc) from exc
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code != 200 or not isinstance(data, dict):
            message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            raise BadRequest(message or "the prompt could not be tokenized",
                             param="messages" if kind == "chat" else "prompt", code="invalid_prompt")
        return int(data["count"]), int(data["max_model_len"])
