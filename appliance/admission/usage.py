"""Tokens one request used, from the usage the worker reports, streamed or not.

A JSON answer carries `usage`, in its protocol's names (OpenAI's prompt and completion tokens,
Responses' and Anthropic's input and output tokens). A Responses stream carries it in
`response.completed`, an Anthropic stream in `message_start` and `message_delta`. A chat or
completions stream carries it only when the request asked for
`stream_options.include_usage`; for a metered client that did not, the gate asks on its behalf
and the tap takes the usage event out again, so the client receives what it would have: vLLM
then moves `system_fingerprint` from each finished choice's event to the usage event, and the
tap puts it back. The tap looks at a chunk with two substring searches; only a chunk holding
the usage event (or, while it strips, a finished choice) is split into events and parsed.

A request the engine worked on is charged whether or not its client waited for the answer.
One that ends without a complete report (its client left, the engine was lost) is charged the
least it is known to have cost: its prompt (the gate's exact count where it counted one, else
an estimate from the body's bytes; the worker's own count where a stream reported it) plus the
tokens generated until then (the stream's events, or the worker's running count). A
non-streamed request left before its answer has no such count: vLLM reports nothing for an
aborted request, so it is charged its prompt. A request the worker refused costs nothing; a
stream resumed after an engine fault whose continuation the next worker refused (or that
failed) still cost what the lost worker generated before the seam, and is charged that.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from appliance.proxy.sse import END as _END
from appliance.proxy.sse import Events

_USAGE = b'"usage":{'
_FINISHED = b'"finish_reason":"'
_FINGERPRINT = b'"system_fingerprint"'
_BYTES_PER_PROMPT_TOKEN = 4  # for the estimate only


class _Usage(msgspec.Struct):
    """OpenAI's names, and Responses' and Anthropic's (Anthropic's input excludes the cache)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None

    def counts(self) -> tuple[int, int]:
        """(prompt, completion) tokens, in whichever protocol's names."""
        anthropic_input = ((self.input_tokens or 0) + (self.cache_read_input_tokens or 0)
                           + (self.cache_creation_input_tokens or 0))
        return (max(self.prompt_tokens or 0, anthropic_input),
                max(self.completion_tokens or 0, self.output_tokens or 0))


class _Carrier(msgspec.Struct):
    usage: _Usage | None = None


class _Reported(msgspec.Struct):
    usage: _Usage | None = None
    system_fingerprint: str | None = None
    response: _Carrier | None = None  # Responses: response.completed carries the usage
    message: _Carrier | None = None  # Anthropic: message_start carries the prompt's

    def found(self) -> _Usage | None:
        for carrier in (self, self.response, self.message):
            if carrier is not None and carrier.usage is not None:
                return carrier.usage
        return None


class Meter:
    """Counts one request's tokens for its client's tokens-per-minute bucket (if it has one)."""

    def __init__(self, enabled: bool, prompt_bytes: int = 0) -> None:
        self.enabled = enabled
        self.reported: int | None = None
        self.events = 0  # stream events seen, for the estimate
        self._prompt = self._completion = 0  # the largest reported so far
        self._prompt_estimate = prompt_bytes // _BYTES_PER_PROMPT_TOKEN
        self._sent = False  # the engine has the request: from here on it costs
        self._finished = False  # the answer came whole: its report, if any, is the total

    def sending(self, prompt_tokens: int | None) -> None:
        """The request goes to the engine now, with its prompt as the gate counted it (None:
        not counted, the estimate from bytes stands)."""
        self._sent = True
        if prompt_tokens is not None:
            self._prompt_estimate = prompt_tokens

    def refused(self) -> None:
        """The worker refused the request: the engine generated nothing for it in this exchange.
        Where an earlier one had generated (a stream's continuation refused), that stays
        charged."""
        if not (self.events or self._completion):
            self._sent = False

    def tokens(self) -> int:
        """Prompt + completion as reported for a whole answer; for an answer cut short (or
        without a report), the prompt and what was seen generated so far."""
        if not self._sent:
            return 0
        if self._finished and self.reported is not None:
            return self.reported
        return (self._prompt or self._prompt_estimate) + max(self._completion, self.events)

    def ended(self) -> None:
        """The answer came whole: a report in it is the request's total."""
        self._finished = True

    def read_body(self, body: bytes) -> None:
        self.ended()
        if self.enabled and b'"usage"' in body:
            self.take(_decode(body))

    def tap(self, chunks: AsyncIterator[bytes], *, strip: bool) -> AsyncIterator[bytes]:
        """The stream as the client should see it, the usage counted on the way."""
        return _Tap(self, strip).relay(chunks) if self.enabled else chunks

    def take(self, reported: _Reported | None) -> None:
        """One report of usage. Several in one stream (Anthropic's message_start, then its
        message_delta; continuous usage stats) are running totals: the largest of each counts."""
        usage = reported.found() if reported is not None else None
        if usage is None:
            return
        prompt, completion = usage.counts()
        self._prompt, self._completion = max(self._prompt, prompt), max(self._completion, completion)
        self.reported = self._prompt + self._completion


class _Tap:
    def __init__(self, meter: Meter, strip: bool) -> None:
        self._meter = meter
        self._strip = strip  # the usage event was asked for the meter, not by the client
        self._events = Events()  # the start of an event whose end has not arrived
        self._held: list[bytes] = []  # events kept back, in order, until the usage event

    async def relay(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if out := self.feed(chunk):
                yield out
        self._meter.ended()
        if rest := self.finish():
            yield rest

    def feed(self, chunk: bytes) -> bytes:
        self._meter.events += chunk.count(b"data:")
        # find, not `in`: bytes' `in` builds and drops a TypeError first (see Relay._from_worker)
        if (not self._events.partial and not self._held and chunk.endswith(_END)
                and chunk.find(_USAGE) < 0 and not (self._strip and chunk.find(_FINISHED) >= 0)):
            return chunk  # the common case: nothing to look at
        return self._events.each(chunk, self._event)

    def finish(self) -> bytes:
        """What is left when the stream ends (without a usage event: held events as they are)."""
        rest = b"".join(self._held) + self._events.partial
        self._held, self._events.partial = [], b""
        return rest

    def _event(self, event: bytes) -> bytes:
        """What to send of one complete event now (possibly nothing, or held events too)."""
        if event.find(_USAGE) >= 0:
            reported = _decode(event[event.find(b"{"):])
            self._meter.take(reported)
            if not self._strip:
                return event
            fingerprint = reported.system_fingerprint if reported is not None else None
            held, self._held = self._held, []
            return b"".join(_stamp(e, fingerprint) for e in held)
        if self._strip and (self._held or event.find(_FINISHED) >= 0):
            self._held.append(event)
            return b""
        return event


def _stamp(event: bytes, fingerprint: str | None) -> bytes:
    """A finished choice's event with the fingerprint vLLM gives it when usage is not asked."""
    body = event.rstrip()
    if fingerprint is None or _FINISHED not in event or _FINGERPRINT in event \
            or not body.endswith(b"}"):
        return event
    return body[:-1] + b',"system_fingerprint":' + msgspec.json.encode(fingerprint) + b"}" + _END


def _decode(data: bytes) -> _Reported | None:
    try:
        return msgspec.json.decode(data, type=_Reported)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
