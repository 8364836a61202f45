"""What the relay sends the worker: a request the gate vetted, or one passed through as it is.

A Vetted request (appliance.gate.gate) makes the engine work: it holds an admission slot and
has its budget fitted (the relay asks the gate: Gate.fit_budget). A PassThrough is a worker
route relayed as it is (a stored response, the tokenizer's description): nothing to vet, no
slot, no budget. The relay sees only Outbound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.admission.slots import Admission
from appliance.admission.usage import Meter
from appliance.answers.shape import ErrorShape
from appliance.apis.api import WorkerRoute
from appliance.core.errors import ApiError
from appliance.fences.vllm import StreamEnding
from appliance.recovery.stream import Record

Refine = Callable[[ApiError], ApiError]  # a route's own reading of a worker's refusal


class Outbound(Protocol):
    """One request on its way to the worker, as the relay sends it."""

    @property
    def shape(self) -> ErrorShape: ...  # the route's error vocabulary

    @property
    def payload(self) -> Mapping[str, Any]: ...  # what a stream's ending may read of it

    @property
    def method(self) -> str: ...

    @property
    def target(self) -> str: ...  # the worker's path

    @property
    def stream(self) -> bool: ...

    @property
    def client_name(self) -> str: ...  # whose work it is, for the supervisor's forensics

    @property
    def headers(self) -> dict[str, str]: ...  # for the client's answer

    @property
    def priority(self) -> int | None: ...  # for the worker's scheduler; None: not sent

    @property
    def prompt_tokens(self) -> int | None: ...  # counted exactly by the budget fit, for the meter

    @property
    def usage_added(self) -> bool: ...  # the stream's usage event is the meter's: strip it

    @property
    def refine(self) -> Refine | None: ...

    @property
    def record(self) -> Record | None: ...  # what its stream keeps to go on after a fault

    @property
    def constraint(self) -> str | None: ...  # its output constraint's parameter, for the cost watch

    @property
    def clean_end(self) -> bytes | None: ...  # how a read of its stream with no death ends

    @property
    def death(self) -> StreamEnding | None: ...  # the event its stream ends with if the engine died

    @property
    def refusal(self) -> StreamEnding | None: ...  # ... if the worker refused it, reason lost

    def body(self) -> bytes | None: ...

    def diagnosis(self) -> dict[str, Any] | None:
        """The body that reads the worker's refusal its stream could not carry (GenerationApi)."""
        ...

    def slot(self, admission: Admission) -> AbstractAsyncContextManager[Meter]:
        """What it holds while the worker answers, and the meter its usage is counted on."""
        ...


class StreamAsked:
    """A request that streams when its body asks for it: only a JSON `true` does."""

    payload: Mapping[str, Any]

    @property
    def stream(self) -> bool:
        return self.payload.get("stream") is True


@dataclass
class PassThrough(StreamAsked):
    """A worker route relayed as it is: no body, no slot, no budget, not metered."""

    route: WorkerRoute
    method: str
    target: str  # the route's path with its parameters, and the query passed on
    payload: Mapping[str, Any] = field(default_factory=dict)
    refine: Refine | None = None
    headers: dict[str, str] = field(default_factory=dict)
    priority: None = None
    usage_added: bool = False
    client_name: str = ""  # a pass-through is nobody's work: no slot, not metered
    prompt_tokens: None = None
    record: None = None  # nothing generated: a pass-through is sent again whole
    constraint: None = None
    clean_end: None = None
    death: None = None  # a stored response's stream (the one GET that streams) writes none
    refusal: None = None

    @property
    def shape(self) -> ErrorShape:
        return self.route.shape

    def body(self) -> None:
        return None

    def diagnosis(self) -> None:
        return None

    def slot(self, admission: Admission) -> AbstractAsyncContextManager[Meter]:
        return contextlib.nullcontext(Meter(enabled=False))
