"""What a stream keeps to continue on a new worker after an engine fault, protocol aside.

The gate asks the worker for the stream's token ids (vLLM's `return_token_ids`): the prompt's
once, in the first event, then each event's generated ids. On the way to the client each event
gives its ids to this record and goes on as it would have without them (`null` where the ids
were, and an event that exists only to carry ids is dropped). After a fault the protocol's
subclass (appliance/apis/<family>/resume.py) sends the prompt's ids plus the generated ones as a
completions request for what is left of the budget, and reads the new stream into the client's
protocol: same id, same `created`, usage counted over the whole answer, no seam.

Memory: the ids as the worker wrote them (digits and commas, about 6 bytes a token) for the
prompt and what was generated, so at most about 6 bytes times the context window per stream,
plus the first event's id and model. Nothing is parsed on the way unless a fault happens, but
the first event (once per stream, for its id) and the events of a continuation.

Token ids after the last event that carried text are the worker's, not yet the client's (a
character split across tokens, held until complete): a continuation starts before them and
generates them again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from appliance.fences.vllm import TokenIds
from appliance.sse import END as _END
from appliance.sse import Events, per_event

_DATA = b"data: "
_DONE = b"data: [DONE]"
_NULL = b"null"
_FINISHED = b'"finish_reason":"'
_UNFINISHED = b'"finish_reason":null'


def _key(name: str) -> bytes:
    return b'"' + name.encode() + b'":['


_PROMPT_KEY = _key(TokenIds.PROMPT)
_GENERATED_KEY = _key(TokenIds.GENERATED)
_NULLED = _GENERATED_KEY[:-1] + _NULL  # the key as the worker writes it without ids


@dataclass(frozen=True)
class Continuation:
    """The request that continues a stream on the new worker."""

    target: str  # the worker's route
    body: bytes | None  # None: no body (a pass-through)


# A JSON request to the worker now serving (route, payload): its status and body.
WorkerCall = Callable[[str, dict[str, Any]], Awaitable[tuple[int, bytes]]]


class Record:
    """What the relay asks of a stream's record, whatever the protocol keeps to continue it."""

    token_ids: ClassVar[bool] = True  # the gate asks the worker for the stream's token ids
    finished = False  # the stream had its last token: an end is all it still needs

    def take(self, chunk: bytes) -> bytes:
        """The worker's bytes as the client gets them, what a continuation needs kept."""
        raise NotImplementedError

    @property
    def resumable(self) -> bool:
        """Whether the stream can go on from what was kept."""
        raise NotImplementedError

    async def prepare(self, worker: WorkerCall) -> None:
        """What the continuation needs from the new worker, asked before `continuation()`."""

    def continuation(self) -> Continuation:
        """The request for the rest; what follows is translated into the client's stream."""
        raise NotImplementedError

    def tail(self) -> bytes:
        """The end of a stream whose last token had come when its engine was lost."""
        raise NotImplementedError


@dataclass(frozen=True)
class Head:
    """What every event of the stream repeats, from its first one."""

    id: str
    created: int
    model: str


class StreamRecord(Record):
    """A chat or completions stream's record; subclasses say how their protocol reads."""

    def __init__(self, payload: Mapping[str, Any], ids_visible: bool) -> None:
        self._payload = payload  # the body as forwarded (its budget fitted by then)
        self._visible = ids_visible  # the client asked for the ids itself: they stay
        self._events = Events()  # the start of an event whose end has not arrived
        self.head: Head | None = None
        self._prompt = b""  # the prompt's ids as the worker wrote them
        self._generated = bytearray()  # the generated ids, comma-separated
        self._settled = 0  # bytes of the ids up to the last event with text
        self.finished = False  # an event carried the finish reason: nothing more to generate
        self._continued = False  # events now come from a continuation, to be translated
        self._steady = False  # the first event was read: the rest take the one-pass path
        # How a token's event without text ends (such an event goes one at a time).
        self._empty = b"" if self.open_ids is None else self.no_text + self.open_ids

    # --- on the way to the client -----------------------------------------------------------

    def take(self, chunk: bytes) -> bytes:
        """The worker's bytes as the client gets them, the ids recorded on the way."""
        events = self._events.whole(chunk)
        if self._steady:
            return self._token_events(events)
        out: list[bytes] = []
        at = 0
        while at < len(events) and not self._steady:  # one at a time until the first is read
            end = events.find(_END, at) + len(_END)
            out.append(self._event(events[at:end]))
            at = end
        if at < len(events):  # the rest of the read that brought the stream's first event
            out.append(self._token_events(events[at:]))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA) or event.startswith(_DONE):
            return event
        if self._continued:
            return self.translate(msgspec.json.decode(event[len(_DATA):]))
        if self.head is None:
            self._read_head(event[len(_DATA):])
        event, prompt = self._cut(event, _PROMPT_KEY)
        if prompt is not None and not self._prompt:
            self._prompt = prompt
        self._steady = self.head is not None and bool(self._prompt)
        event, ids = self._cut(event, _GENERATED_KEY)
        if _FINISHED in event:
            self.finished = True
        if ids is not None:
            empty = self.no_text in event
            self.record(ids, not empty)
            if not self._visible and empty and self.drops_empty and _UNFINISHED in event:
                return b""  # exists only to carry ids
        return event

    def _token_events(self, events: bytes) -> bytes:
        """The whole events of one read after the first event, in one pass (the hot path: most
        of a stream): the events vLLM writes for a token with text (ids last, after
        `open_ids`) have their ids gathered and cut in one split of the read; from the first
        other one (without text, the last one, the usage event), each goes through
        _token_event."""
        open_ids, empty = self.open_ids, self._empty
        parts = events.split(_GENERATED_KEY)
        if open_ids is None or len(parts) == 1:
            return per_event(events, self._token_event)
        ids: list[bytes] = []
        kept = [parts[0]]  # the read without its ids, in the pieces around them
        for i in range(1, len(parts)):
            before, part = parts[i - 1], parts[i]
            end = part.find(b"]")
            if end < 0 or not before.endswith(open_ids) or before.endswith(empty):
                return self._other_from(events, parts, i, ids, kept)
            if end:
                ids.append(part[:end])
            kept.append(part[end + 1:])
        self.record(b",".join(ids), True)
        return events if self._visible else _NULLED.join(kept)

    def _other_from(self, events: bytes, parts: list[bytes], i: int, ids: list[bytes],
                    kept: list[bytes]) -> bytes:
        """The read of _token_events whose `i`th ids are in an event it does not know: the
        events before that one as it cut them, the rest one at a time."""
        before = parts[i - 1]
        cut = before.rfind(_END)  # the end of the event before it, if in the same part
        tail = len(before) - (cut + len(_END) if cut >= 0 else 0)  # the event's own start
        at = sum(map(len, parts[:i])) + (i - 1) * len(_GENERATED_KEY) - tail
        if i > 1:  # events with text came before it
            self.record(b",".join(ids), True)
        done = _NULLED.join(kept)
        known = events[:at] if self._visible else done[:len(done) - tail]
        return known + per_event(events[at:], self._token_event)

    def _token_event(self, event: bytes) -> bytes:
        """An event after the first that _token_events does not know."""
        start = event.rfind(_GENERATED_KEY)
        if start < 0:  # the usage event, [DONE]: nothing to record or cut
            if _FINISHED in event:
                self.finished = True
            return event
        first = start + len(_GENERATED_KEY)
        end = event.find(b"]", first)
        empty = self.no_text in event
        self.record(event[first:end] if end > first else b"", not empty)
        if _FINISHED in event:
            self.finished = True
        if self._visible:
            return event
        if empty and self.drops_empty and _UNFINISHED in event:
            return b""  # exists only to carry ids
        return event[:first - 1] + _NULL + event[end + 1:]

    def _cut(self, event: bytes, key: bytes) -> tuple[bytes, bytes | None]:
        """The event without the ids under `key` (unless the client asked for them), and the
        ids; None where it has none."""
        start = event.find(key)
        if start < 0:
            return event, None
        first = start + len(key)
        end = event.find(b"]", first)
        ids = event[first:end]
        if self._visible:
            return event, ids
        return event[:start + len(key) - 1] + _NULL + event[end + 1:], ids

    def record(self, ids: bytes, has_text: bool) -> None:
        """Ids generated (digits and commas, possibly none), and whether their event carried
        text: the client holds everything up to such an event."""
        if ids:
            generated = self._generated
            if generated:
                generated += b","
            generated += ids
        if has_text:
            self._settled = len(self._generated)

    # --- after a fault ----------------------------------------------------------------------

    @property
    def resumable(self) -> bool:
        """Whether the stream can go on from its ids: its first event came (it holds the
        prompt's), and the stream did not already end."""
        return self.head is not None and bool(self._prompt) and not self.finished

    def continuation(self) -> Continuation:
        """The request for the rest, from the last settled id; what follows is translated."""
        del self._generated[self._settled:]
        count = self.generated_tokens
        self._events = Events()
        self._continued = True
        self._steady = False
        ids = self._prompt + (b"," + bytes(self._generated) if self._generated else b"")
        rest = msgspec.json.encode(self.continued_fields(count))
        return Continuation(self.continued_target, b'{"prompt":[' + ids + b"]," + rest[1:])

    @property
    def prompt_tokens(self) -> int:
        return self._prompt.count(b",") + 1 if self._prompt else 0

    @property
    def generated_tokens(self) -> int:
        generated = self._generated  # counted when asked: only after a fault
        return generated.count(b",") + 1 if generated else 0

    def usage(self) -> dict[str, int]:
        """The whole answer's usage, in OpenAI's names and vLLM's order."""
        prompt, completion = self.prompt_tokens, self.generated_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def usage_asked(self) -> bool:
        options = self._payload.get("stream_options")
        return isinstance(options, Mapping) and options.get("include_usage") is True

    def usage_event(self, fingerprint: str | None) -> bytes:
        """The whole answer's usage event, as the protocol's stream ends with it."""
        assert self.head is not None
        event: dict[str, Any] = {"id": self.head.id, "object": self.event_object,
                                 "created": self.head.created, "model": self.head.model,
                                 "choices": [], "usage": self.usage()}
        if fingerprint is not None:
            event["system_fingerprint"] = fingerprint
        return sse(event)

    def tail(self) -> bytes:
        """The end of a stream whose last token had come when its engine was lost."""
        return (self.usage_event(None) if self.usage_asked() else b"") + _DONE + _END

    # --- what a protocol says ---------------------------------------------------------------

    continued_target = "/v1/completions"  # a prompt of token ids continues every stream here
    event_object: str  # the protocol's name for one event of its stream

    def _read_head(self, data: bytes) -> None:
        head = msgspec.json.decode(data, type=_HeadFields)
        if head.id is not None and head.created is not None:
            self.head = Head(head.id, head.created, head.model or "")

    no_text: bytes  # what an event without text for the client holds
    # What comes just before the ids in vLLM's event for a token, not the last one, of a
    # plain stream (its choice's fields after the text, in vLLM's order); None: the protocol
    # has no such event, and each event goes one at a time.
    open_ids: bytes | None = None
    # Whether such an event (unfinished) exists only because the ids were asked, and is dropped.
    drops_empty = False

    def continued_fields(self, generated: int) -> dict[str, Any]:
        """The continuation's body but its prompt, after `generated` tokens."""
        raise NotImplementedError

    def translate(self, event: dict[str, Any]) -> bytes:
        """One event of the continuation as the client's stream goes on (b"": none)."""
        raise NotImplementedError


class _HeadFields(msgspec.Struct):
    id: str | None = None
    created: int | None = None
    model: str | None = None


def sse(data: Mapping[str, Any]) -> bytes:
    return _DATA + msgspec.json.encode(data) + _END
