"""What a stream keeps to continue on a new worker after an engine fault, protocol aside.

The gate asks the worker for the stream's token ids (vLLM's `return_token_ids`): the prompt's
once, in the first event, then each event's generated ids. The first event is read on the way
(its id and `created`, the prompt's ids, which are cut unless the client asked for them); every
later event goes to the client as the worker wrote it, its `token_ids` included (vLLM's own
field, `null` when not asked), and is kept as it came, unread. The kept bytes are read for
their ids only when they pass KEPT_BYTES, or after a fault: one C-level pass over many events
instead of a Python step per event, the cost the hot path would otherwise pay for a fault that
mostly never comes. After a fault the protocol's subclass (appliance/apis/<family>/resume.py)
sends the prompt's ids plus the generated ones as a completions request for what is left of the
budget, and reads the new stream into the client's protocol: same id, same `created`, usage
counted over the whole answer, no seam.

Memory: the ids as the worker wrote them (digits and commas, about 6 bytes a token) for the
prompt and what was generated, so at most about 6 bytes times the context window per stream,
plus at most KEPT_BYTES of events not read yet, plus the first event's id and model.

Token ids after the last event that carried text are the worker's, not yet the client's (a
character split across tokens, held until complete): a continuation starts before them and
generates them again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

import msgspec
import structlog

from appliance.answers.shape import upstream_error
from appliance.fences.vllm import TokenIds
from appliance.proxy.sse import END as _END
from appliance.proxy.sse import END_SIZE as _END_SIZE
from appliance.proxy.sse import Events

_DATA = b"data: "
_DONE = b"data: [DONE]"
_NULL = b"null"
_FINISHED = b'"finish_reason":"'
KEPT_BYTES = 32 * 1024  # a stream's events kept unread; past it they are read for their ids


def _key(name: str) -> bytes:
    return b'"' + name.encode() + b'":['


_PROMPT_KEY = _key(TokenIds.PROMPT)
_GENERATED_KEY = _key(TokenIds.GENERATED)

log = structlog.get_logger("appliance.recovery")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Continuation:
    """The request that continues a stream on the new worker."""

    target: str  # the worker's route
    body: bytes | None  # None: no body (a pass-through)


def asks_any(body: Mapping[str, Any], fields: frozenset[str]) -> bool:
    """Whether the body gives any of these fields a value that asks for something (such a
    field keeps a stream from resuming: its answer's state is more than its tokens). Most
    bodies have none of them: one look at each of their keys."""
    if fields.isdisjoint(body):
        return False
    return any(body[name] not in (None, False, [], "", 0) for name in fields.intersection(body))


# A JSON request to the worker now serving (route, payload): its status and body.
WorkerCall = Callable[[str, dict[str, Any]], Awaitable[tuple[int, bytes]]]


async def ask(worker: WorkerCall, path: str, payload: dict[str, Any], answer: type[_T]) -> _T:
    """The new worker's answer to what a record asks to prepare its continuation; its refusal
    as the worker's error (the stream ends with it)."""
    status, content = await worker(path, payload)
    if status != 200:
        log.warning("recovery.continuation_refused", path=path, status=status)
        raise upstream_error(status, content)
    return msgspec.json.decode(content, type=answer)


def remaining(budget: int, min_tokens: object, generated: int) -> dict[str, int]:
    """A continuation's budget after `generated` tokens: what is left of the request's (at least
    one), and its `min_tokens` less what was generated, never above what is left (the worker
    refuses a minimum above the maximum)."""
    left = max(1, budget - generated)
    fields = {"max_tokens": left}
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > generated:
        fields["min_tokens"] = min(min_tokens - generated, left)
    return fields


class Record:
    """What the relay asks of a stream's record, whatever the protocol keeps to continue it."""

    token_ids: ClassVar[bool] = True  # the gate asks the worker for the stream's token ids
    finished = False  # the stream had its last token: an end is all it still needs
    # A chunk of whole events (ending with an event's end) now goes to the client as it came
    # and is only kept: the relay writes it, then appends it to `kept` and counts it in
    # `kept_bytes` itself (no call per event), and calls `read_kept` past KEPT_BYTES.
    verbatim = False
    kept: list[bytes]  # the stream's events since they were last read, as they came
    kept_bytes = 0

    def take(self, chunk: bytes) -> bytes:
        """The worker's bytes as the client gets them, what a continuation needs kept."""
        raise NotImplementedError

    def read_kept(self) -> None:
        """The events in `kept` read for what a continuation needs, and let go."""
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


class Head(NamedTuple):
    """What every event of the stream repeats, from its first one (a tuple: a frozen dataclass
    costs a call of object.__setattr__ per field, once per stream)."""

    id: str
    created: int
    model: str


class StreamRecord(Record):
    """A chat or completions stream's record; subclasses say how their protocol reads."""

    def __init__(self, payload: Mapping[str, Any], ids_visible: bool) -> None:
        self._payload = payload  # the body as forwarded (its budget fitted by then)
        self._visible = ids_visible  # the client asked for the ids itself: the prompt's stay
        self._events = Events()  # the start of an event whose end has not arrived
        self._first: bytes | None = None  # the first event (its prompt's ids cut), until read
        self._head: Head | None = None
        self._prompt = b""  # the prompt's ids as the worker wrote them
        self._generated = bytearray()  # the generated ids, comma-separated
        self._settled = 0  # bytes of the ids up to the last event with text
        self._finished = False  # an event carried the finish reason: nothing more to generate
        self.kept = []
        self._continued = False  # events now come from a continuation, to be translated
        self._steady = False  # the first event was read: the rest are kept as they come
        self._shown: list[int] = []  # held ids the client has, which a continuation generates again

    @property
    def finished(self) -> bool:
        self.read_kept()
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._finished = value

    # --- on the way to the client -----------------------------------------------------------

    def take(self, chunk: bytes) -> bytes:
        """The worker's bytes as the client gets them, kept to be read for their ids."""
        if self.verbatim and chunk[-_END_SIZE:] == _END:
            self._keep(chunk)  # the hot path, most of a stream's events: whole ones, as they came
            return chunk
        events = self._events.whole(chunk)  # whole events only: a seam never cuts one
        out: list[bytes] = []
        at = 0
        while at < len(events) and not self._steady:  # one at a time until the first is read
            end = events.find(_END, at) + len(_END)
            out.append(self._event(events[at:end]))
            at = end
        if rest := events[at:]:  # what the read held after the first event, or cut at its end
            self._keep(rest)
            out.append(rest)
        self.verbatim = self._steady and not self._events.partial
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        """One event before the stream is steady: its first, or one of a continuation."""
        if not event.startswith(_DATA) or event.startswith(_DONE):
            return event
        if self._continued:
            return self.translate(msgspec.json.decode(event[len(_DATA):]))
        event, prompt = self._cut(event, _PROMPT_KEY)
        if self._first is None and self._head is None:
            self._first = event  # its head is read if a fault ever asks (Record.head)
        if prompt is not None and not self._prompt:
            self._prompt = prompt
        self._steady = bool(self._prompt)
        self._read(event)
        return event

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

    def _keep(self, chunk: bytes) -> None:
        """As the relay keeps what it writes itself (Record.kept)."""
        self.kept.append(chunk)
        self.kept_bytes += len(chunk)
        if self.kept_bytes > KEPT_BYTES:
            self.read_kept()

    def read_kept(self) -> None:
        """The events kept so far read for their ids."""
        if self.kept:
            events = b"".join(self.kept)
            self.kept, self.kept_bytes = [], 0
            self._read(events)

    def _read(self, events: bytes) -> None:
        """Whole events' generated ids recorded, and whether the last token came. The ids of the
        events at their end that carried no text (a character not complete yet) are recorded
        as not the client's. One split at the ids' key, in C, then a step per event (cheaper than
        a regex scan of every event)."""
        # find, not `in`: bytes' `in` first tries its operand as an int (relay._from_worker)
        if events.find(_FINISHED) >= 0:
            self._finished = True
        parts = events.split(_GENERATED_KEY)  # each event's ids start the part after its key
        if len(parts) == 1:
            return
        groups = [part[:part.find(b"]")] for part in parts[1:]]
        cut = len(groups)  # the events from here to the end carried no text
        while cut:
            before = parts[cut - 1]  # up to the event's ids, from the end of the one before
            if before.find(self.no_text, before.rfind(_END) + 1) < 0:
                break
            cut -= 1
        if settled := b",".join(filter(None, groups[:cut])):
            self.record(settled, True)
        if held := b",".join(filter(None, groups[cut:])):
            self.record(held, False)

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
        self.read_kept()
        held = bytes(self._generated[self._settled:]).strip(b",")
        self._shown = [int(i) for i in held.split(b",")] if held else []
        del self._generated[self._settled:]
        count = self.generated_tokens
        self._events = Events()
        self._continued = True
        self._steady = self.verbatim = False
        ids = self._prompt + (b"," + bytes(self._generated) if self._generated else b"")
        rest = msgspec.json.encode(self.continued_fields(count))
        return Continuation(self.continued_target, b'{"prompt":[' + ids + b"]," + rest[1:])

    def unseen(self, ids: list[int]) -> list[int]:
        """A continuation event's ids as the client gets them: those the client already had
        (of a character not complete at the fault, generated again from the seam) not twice."""
        shown, same = self._shown, 0
        while same < len(ids) and same < len(shown) and ids[same] == shown[same]:
            same += 1
        self._shown = shown[same:] if same == len(ids) else []  # else no more to leave out
        return ids[same:]

    @property
    def prompt_tokens(self) -> int:
        return self._prompt.count(b",") + 1 if self._prompt else 0

    @property
    def generated_tokens(self) -> int:
        self.read_kept()
        generated = self._generated  # counted when asked: only after a fault
        return generated.count(b",") + 1 if generated else 0

    def usage(self) -> dict[str, int]:
        """The whole answer's usage, in OpenAI's names and vLLM's order."""
        prompt, completion = self.prompt_tokens, self.generated_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def usage_asked(self) -> bool:
        options = self._payload.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

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

    @property
    def head(self) -> Head | None:
        """What every event repeats, from the first event; read when first asked (a fault), not
        on the stream's way (a decode of the whole event, most streams' only one)."""
        if self._first is not None:
            first, self._first = self._first, None
            try:
                fields = _HEAD.decode(first[len(_DATA):])
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None  # not the worker's event: the stream cannot be continued
            if fields.id is not None and fields.created is not None:
                self._head = Head(fields.id, fields.created, fields.model or "")
        return self._head

    no_text: bytes  # what an event without text for the client holds

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


_HEAD = msgspec.json.Decoder(_HeadFields)


def sse(data: Mapping[str, Any]) -> bytes:
    return _DATA + msgspec.json.encode(data) + _END
