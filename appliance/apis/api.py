"""What an API is to the gate, the budget fitter and the relay: one object per worker route.

Each API family has its folder under appliance/apis/<family>/: `api.py` holds its API objects
(subclasses of GenerationApi: how a body is screened, validated, bounded and rewritten, and how
its prompt is counted with the worker), its error shape and stream ending (an ErrorShape);
`routes.py` wires them to routes, one line per route. A worker route relayed as it is, with
nothing to vet, is a WorkerRoute: it never passes the gate and takes no admission slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from appliance.answers.shape import ErrorShape
from appliance.apis.counting import Limits, PromptCounter
from appliance.core.sections import PolicySettings
from appliance.core.settings import Settings
from appliance.fences.vllm import StreamEnding
from appliance.policy import MediaPart
from appliance.policy.fanout import (
    batch_size,
    check_conversation,
    check_message_count,
    check_prompts,
    sequences,
)
from appliance.recovery.stream import Record


class GenerationApi:
    """A worker route that makes the engine work (it takes an admission slot).

    The defaults describe an API with no screening before the parse, the common bound on a
    list of prompts, no media, no rules of its own and no completion budget; a subclass says
    what its protocol adds."""

    name: ClassVar[str]  # the route's name, its metric and log label
    path: ClassVar[str]  # the worker's route (the appliance serves it at the same path)
    shape: ClassVar[ErrorShape]
    fields: ClassVar[type[msgspec.Struct]]  # the JSON type of every field vLLM reads
    budget_fields: ClassVar[tuple[str, ...]] = ()  # the engine obeys the first one present
    # A stream reports its usage only when `stream_options.include_usage` asks (OpenAI's chat
    # and completions); the other APIs always report it.
    usage_on_request: ClassVar[bool] = False
    # How a token event of its stream ends, where the worker writes the error event of an engine
    # death only after its last one: a read ending so holds no such error, and the relay writes
    # it unsearched. None: every read is searched.
    clean_end: ClassVar[bytes | None] = None
    # The event its stream ends with when the worker's engine core died (a hint the supervisor
    # confirms); None: the worker writes none, its stream is cut.
    death: ClassVar[StreamEnding | None] = None
    # The event its stream ends with when the worker refused the request in words the stream
    # lost (the worker's reason is then read with `diagnosis`); None: its refusals say it all.
    refusal: ClassVar[StreamEnding | None] = None

    def screen(self, raw: bytes, limits: PolicySettings) -> None:
        """Bounds checked on the raw bytes, before parsing costs anything."""

    def validate(self, body: Mapping[str, Any]) -> None:
        """The protocol's own shape of a body: required fields and their values."""
        raise NotImplementedError

    def check_size(self, body: Mapping[str, Any], limits: PolicySettings) -> None:
        """How much work the body holds, bounded."""
        check_prompts(body, limits.max_batch_prompts)

    def sequences(self, body: Mapping[str, Any]) -> tuple[int, str]:
        """The sequences the body makes the engine run at once (admission holds as many slots),
        and the field to name when they are too many: a batch of prompts, each `n` times."""
        prompts = batch_size(body.get("prompt"))
        return sequences(prompts, body), "prompt" if prompts > 1 else "n"

    def media(self, body: Mapping[str, Any]) -> list[MediaPart] | None:
        """The media the body would make the worker fetch or decode; None: none possible."""
        return None

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """The API's own policy on the body (tools, thinking, template defaults...); whether
        it changed the body, so that the gate re-encodes it."""
        return False

    def prompt_bound(self, body: Mapping[str, Any], raw_len: int, limits: Limits,
                     multimodal: bool) -> float:
        """A cheap upper bound of the prompt's tokens, or infinity where none is cheap."""
        return math.inf

    async def count_prompt(self, body: dict[str, Any], budget: int, limits: Limits,
                           counter: PromptCounter) -> int | None:
        """The prompt's exact length (the longest, for a batch); None if the worker cannot say."""
        return None

    def one_prompt(self, body: Mapping[str, Any]) -> bool:
        """Whether count_prompt's count is the whole request's prompt, to charge it by."""
        return True

    def stream_record(self, body: Mapping[str, Any], settings: Settings, *,
                      media: bool | None = None) -> Record | None:
        """What lets its stream continue on a new worker after an engine fault, or None: the
        request is then sent again only while its client has received nothing of it. `media`:
        whether the body holds any, where the caller already looked (None: looked up)."""
        return None

    def diagnosis(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Where its stream cannot carry the worker's refusal (the worker cuts it instead), the
        body to ask again, not streamed and for one token, to read the refusal; None where the
        stream says it itself."""
        return None

    def plain_text(self, body: Mapping[str, Any], settings: Settings,
                   plain: Callable[[Mapping[str, Any]], bool], media: bool | None = None) -> bool:
        """Whether a stream's tokens alone say where it stands: `plain` by its protocol's
        fields, no media, and its reasoning not parsed apart (the parser's state is the
        worker's)."""
        if settings.engine.reasoning_parser or not plain(body):
            return False
        return not (self.media(body) if media is None else media)


class ConversationApi(GenerationApi):
    """An API whose body is one conversation under `messages`: bounded in messages."""

    def screen(self, raw: bytes, limits: PolicySettings) -> None:
        check_message_count(raw, limits.max_messages)

    def check_size(self, body: Mapping[str, Any], limits: PolicySettings) -> None:
        check_prompts(body, limits.max_batch_prompts)
        check_conversation(body, limits.max_messages)


@dataclass(frozen=True)
class WorkerRoute:
    """A worker route relayed as it is: nothing to vet, no budget, no admission slot (the
    engine does no generation work for it)."""

    name: str  # the route's name, its metric and log label
    path: str  # the worker's route, `{id}` where a path parameter goes
    shape: ErrorShape
