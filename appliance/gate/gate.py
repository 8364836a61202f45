"""The gate every generation request passes before the engine: parse, validate, the policy rules.

Vetting is pure CPU work on the body (no I/O, no slot held), so a refusal costs the engine
nothing; a big body is vetted on a worker thread so that it never stalls the event loop.
The budget is fitted later, once the request holds an admission slot (it may ask the worker).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import structlog

from appliance import policy
from appliance.admission.clients import ANYONE, Client
from appliance.admission.slots import Admission
from appliance.admission.usage import Meter
from appliance.answers.shape import ErrorShape
from appliance.apis.api import GenerationApi
from appliance.core.errors import ApiError
from appliance.core.settings import Settings
from appliance.fences.vllm import StreamEnding, TokenIds
from appliance.gate.budget import BudgetFitter
from appliance.policy.client import ask_usage, cap_max_tokens, drop_priority
from appliance.policy.constraints import check_constraints
from appliance.policy.fanout import check_sequences
from appliance.policy.fields import check_fields
from appliance.policy.max_tokens import CLAMP_HEADER, apply_default_budget, header_value
from appliance.policy.token_ids import check_token_ids, vocabulary_size
from appliance.proxy.outbound import StreamAsked
from appliance.recovery.stream import Record

log = structlog.get_logger("appliance.gate")

_MULTIMODAL_KEYS = ("vision_config", "audio_config", "image_token_index", "image_token_id")


@dataclass
class Vetted(StreamAsked):
    """A request that passed the rules: what to forward, and what the gate did to it. The
    relay sends it (an appliance.proxy.outbound.Outbound) holding an admission slot."""

    method: ClassVar[str] = "POST"
    api: GenerationApi
    payload: dict[str, Any]
    raw: bytes
    changed: bool = False  # a rule rewrote the body: it is re-encoded, else forwarded as sent
    defaulted: bool = False  # the budget is the configured default
    headers: dict[str, str] = field(default_factory=dict)  # for the client's answer
    # The route's own reading of a worker's refusal (a response id lost in a restart).
    refine: Callable[[ApiError], ApiError] | None = None
    client: Client = ANYONE
    usage_added: bool = False  # the stream's usage event was asked for the meter: strip it
    priority: int | None = None  # for the worker's priority scheduler; None: not sent
    prompt_tokens: int | None = None  # counted exactly by the budget fit, for the meter
    record: Record | None = None  # what its stream keeps to go on after an engine fault
    constraint: str | None = None  # its output constraint's parameter (the first, if several)
    added: bytes = b""  # fields added to the raw body, where nothing else changed it
    sequences: int = 1  # its fan-out: the admission slots it holds
    admitted: Callable[[], None] | None = None  # what the route records once it is admitted

    @property
    def shape(self) -> ErrorShape:
        return self.api.shape

    @property
    def target(self) -> str:
        return self.api.path

    @property
    def clean_end(self) -> bytes | None:
        return self.api.clean_end

    @property
    def death(self) -> StreamEnding | None:
        return self.api.death

    @property
    def refusal(self) -> StreamEnding | None:
        return self.api.refusal

    @property
    def client_name(self) -> str:
        return self.client.name

    def body(self) -> bytes:
        if self.changed:
            return msgspec.json.encode(self.payload)
        if self.added:  # the client's object as sent, closed after the fields added to it
            return self.raw.rstrip()[:-1] + self.added + b"}"
        return self.raw

    def diagnosis(self) -> dict[str, Any] | None:
        return self.api.diagnosis(self.payload)

    def slot(self, admission: Admission) -> AbstractAsyncContextManager[Meter]:
        """The engine works for it: it holds a slot, its usage metered there."""
        return admission.slot(self.client, len(self.raw), self.sequences, self.admitted)


class Gate:
    """Vets bodies against the settings' rules; fits budgets through the BudgetFitter."""

    def __init__(self, settings: Settings, budget: BudgetFitter,
                 on_clamp: Callable[[], None] = lambda: None) -> None:
        self._settings = settings
        self._on_clamp = on_clamp
        self._policy = settings.policy
        self._budget = budget
        config = _model_config(settings)
        self._multimodal = _is_multimodal(settings, config)
        self._vocabulary = vocabulary_size(config)
        self._big_bodies = asyncio.Semaphore(1)
        self._engine_priority = settings.admission.engine_priority()

    async def vet(self, raw: bytes, api: GenerationApi, client: Client = ANYONE) -> Vetted:
        if len(raw) <= self._settings.server.parse_in_thread_bytes:
            return self.vet_now(raw, api, client)
        # One big body at a time: a parse holds the GIL, and the event loop must get it back
        # between two of them.
        async with self._big_bodies:
            return await asyncio.to_thread(self.vet_now, raw, api, client)

    def vet_now(self, raw: bytes, api: GenerationApi, client: Client = ANYONE) -> Vetted:
        """Every rule that needs only the body; raises the first refusal as an ApiError."""
        limits = self._policy
        api.screen(raw, limits)
        body = policy.parse_json(raw)
        api.validate(body)
        check_fields(body, api.fields)
        policy.check_n(body, limits.max_n)
        check_token_ids(body, self._vocabulary)
        api.check_size(body, limits)
        sequences, fanned = api.sequences(body)
        check_sequences(sequences, fanned, limits.max_inflight, client)
        media = api.media(body)
        if media is not None:
            policy.check_media(media, multimodal=self._multimodal, max_images=limits.max_images,
                               max_image_bytes=limits.max_image_bytes,
                               allowed_hosts=limits.allowed_media_hosts)
        constraint = check_constraints(body, self._settings.constraints,
                                       allowed=client.output_constraints)
        changed = api.adjust(body, self._settings)
        defaulted = bool(api.budget_fields) and apply_default_budget(
            body, api.budget_fields, limits.default_max_tokens)
        vetted = Vetted(api, body, raw, changed=changed or defaulted, defaulted=defaulted,
                        client=client, constraint=constraint, sequences=sequences)
        self._apply_client(vetted)
        if self._settings.resume.enabled:
            self._keep_record(vetted, media=bool(media))
        return vetted

    def _keep_record(self, vetted: Vetted, *, media: bool) -> None:
        """A stream that can be continued after an engine fault asks for its token ids (where
        its record continues from them)."""
        record = vetted.api.stream_record(vetted.payload, self._settings, media=media)
        payload = vetted.payload
        if record is None or (record.token_ids and payload.get(TokenIds.REQUEST) is False):
            return  # (a client that declined the ids gets none: replayed before its first byte)
        vetted.record = record
        if not record.token_ids or payload.get(TokenIds.REQUEST) is True:
            return
        # Appended to the bytes as sent where it is a new field of a body nothing else changed:
        # an encode of the whole body per stream is what it would otherwise cost.
        if not vetted.changed and TokenIds.REQUEST not in payload and payload:
            vetted.added += b',"' + TokenIds.REQUEST.encode() + b'":true'
        else:
            vetted.changed = True
        payload[TokenIds.REQUEST] = True

    def _apply_client(self, vetted: Vetted) -> None:
        """The client's own rules: its max_tokens ceiling, its priority, its usage meter."""
        client, body = vetted.client, vetted.payload
        capped, clamp = cap_max_tokens(body, vetted.api.budget_fields, client.max_tokens,
                                       vetted.defaulted)
        if clamp is not None:
            vetted.headers[CLAMP_HEADER] = header_value(clamp)
            self._on_clamp()
        dropped = False
        if self._engine_priority:
            vetted.priority = client.priority
            dropped = drop_priority(body)
        vetted.usage_added = (client.tokens_per_minute is not None
                              and vetted.api.usage_on_request and ask_usage(body))
        vetted.changed |= capped or dropped or vetted.usage_added

    async def fit_budget(self, vetted: Vetted) -> None:
        """Clamp the budget to the window's room (counting the prompt only if it may not fit)."""
        fitted = await self._budget.fit(vetted.api, vetted.payload, len(vetted.raw),
                                        defaulted=vetted.defaulted, multimodal=self._multimodal)
        vetted.prompt_tokens = fitted.prompt
        if fitted.clamp is None:
            return
        clamp = fitted.clamp
        vetted.changed = True
        vetted.headers[CLAMP_HEADER] = header_value(clamp)
        self._on_clamp()
        log.info("request.max_tokens_clamped", field=clamp.field, requested=clamp.requested,
                 applied=clamp.applied, defaulted=clamp.defaulted)


def _model_config(settings: Settings) -> dict[str, Any]:
    """The model directory's config.json; empty where it cannot be read."""
    try:
        config = json.loads((Path(settings.engine.model) / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _is_multimodal(settings: Settings, config: dict[str, Any]) -> bool:
    """From settings, else from the model directory's config (a vision or audio tower).

    A model whose config cannot be read is treated as text-only: refusing is the safe side.
    """
    setting = settings.policy.multimodal
    if setting != "auto":
        return setting == "on"
    return any(key in config for key in _MULTIMODAL_KEYS)
