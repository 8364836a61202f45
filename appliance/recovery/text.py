"""What a stream without token ids keeps to continue on a new worker: the text its client has.

vLLM's Responses and Anthropic streams cannot carry their token ids (`return_token_ids` is a
chat and completions field). So on the way to the client the record keeps the text of each
delta event as the worker escaped it in JSON (the bytes between its quotes, found with two
substring searches and appended; decoded only after a fault), and the protocol's subclass
reads the stream's few other events by name, parsing the handful whose data continuing takes
(ids, indices, the head).

After a fault, `prepare` asks the new worker for the prompt's ids and the sampling parameters
generation used (the protocol's render route renders a body exactly as generating it does, and
resolves its defaults) and for the ids of the text sent (/tokenize, without special tokens).
The continuation is a completions request from the prompt's ids plus the text's, for what is
left of the budget, asking for its token ids to count the output; the subclass writes its
events as the protocol's own, and the stream's end with the whole text and usage.

The text is tokenized again, not read back: where the tokenizer splits it otherwise than the
engine generated it, the continuation's context differs from an uninterrupted run's, and even
greedy decoding may differ after the seam. The usage counts the sent text as tokenized again.

Memory: the text sent, JSON-escaped (a few bytes a token, so bounded by the budget), the last
event, and the protocol's head (for Responses, the response object of its first event).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from appliance.proxy.sse import END as _END
from appliance.proxy.sse import Events
from appliance.recovery.stream import Continuation, Record, WorkerCall, ask, remaining

_EVENT = b"event: "
_DATA = b"data: "
_DONE = b"data: [DONE]"
_TOKENIZE = "/tokenize"
# Sampling parameters a completions request takes from the model's generation config when it
# leaves them out, and SamplingParams' own defaults, which a render leaves out: given always.
_SAMPLING_DEFAULTS = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
}
# The other sampling parameters a render resolves, carried as it gives them.
_CARRIED = ("seed", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
            "spaces_between_special_tokens", "allowed_token_ids", "bad_words")


class _Rendered(msgspec.Struct):
    token_ids: list[int]
    sampling_params: dict[str, Any]


class _Tokenized(msgspec.Struct):
    tokens: list[int]


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


class TextRecord(Record):
    """A stream of plain text; subclasses say how their protocol reads and writes it."""

    token_ids = False
    render_path: ClassVar[str]  # the worker's render route for the protocol's body
    delta_prefix: ClassVar[bytes]  # how a text delta event starts
    text_key: ClassVar[bytes]  # what precedes its text
    text_end: ClassVar[bytes]  # what follows its text (JSON cannot hold it inside a string)

    def __init__(self, payload: Mapping[str, Any]) -> None:
        self._payload = payload  # the body as forwarded (its budget fitted by then)
        self._events = Events()  # the start of an event whose end has not arrived
        self._sent = bytearray()  # the text the client has, JSON-escaped
        self._last = b""  # the last event from the worker, as the client got it
        self.plain = True  # nothing but the protocol's events of one text so far
        self.closing = False  # the text ended, the stream's end was under way
        self._continued = False  # events now come from a continuation, to be translated
        self._body: dict[str, Any] = {}  # the continuation's request, once prepared
        self.input_tokens = 0  # the prompt's, as rendered
        self.output_tokens = 0  # the text sent, tokenized again, then each continued token

    # --- on the way to the client -----------------------------------------------------------

    def take(self, chunk: bytes) -> bytes:
        if not self._events.partial and chunk.endswith(_END) and chunk.count(_END) == 1:
            return self._event(chunk)  # one whole event: the common case
        return self._events.each(chunk, self._event)

    def _event(self, event: bytes) -> bytes:
        if self._continued:
            return self._translate(event)
        self._last = event
        if event.startswith(self.delta_prefix):
            start = event.find(self.text_key)
            end = event.find(self.text_end, start)
            if start >= 0 and end >= 0:
                self._sent += event[start + len(self.text_key):end]
                return event
        if event.startswith(_EVENT):
            name = event.find(b"\n")
            self.read(event[len(_EVENT):name].decode(), event[name + 1 + len(_DATA):])
        return event

    @property
    def text(self) -> str:
        """The whole text the client has."""
        return str(msgspec.json.decode(b'"' + bytes(self._sent) + b'"'))

    # --- after a fault ----------------------------------------------------------------------

    @property
    def resumable(self) -> bool:
        return self.plain and self.opened and not (self.closing or self.finished)

    async def prepare(self, worker: WorkerCall) -> None:
        """The prompt's ids and sampling parameters as the new worker renders the body, and the
        ids of the text sent: the continuation's request."""
        rendered = await ask(worker, self.render_path, dict(self._payload), _Rendered)
        text, sent = self.text, []
        if text:
            tokenize: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
            if "model" in self._payload:
                tokenize["model"] = self._payload["model"]
            sent = (await ask(worker, _TOKENIZE, tokenize, _Tokenized)).tokens
        self.input_tokens, self.output_tokens = len(rendered.token_ids), len(sent)
        self._body = self._continued_body(rendered.token_ids + sent, rendered.sampling_params,
                                          len(sent))

    def _continued_body(self, prompt: list[int], params: dict[str, Any],
                        sent: int) -> dict[str, Any]:
        body: dict[str, Any] = {k: self._payload[k] for k in ("model", "cache_salt", "vllm_xargs")
                                if k in self._payload}
        body["prompt"] = prompt
        body |= {k: params.get(k, default) for k, default in _SAMPLING_DEFAULTS.items()}
        body |= {k: params[k] for k in _CARRIED if params.get(k) not in (None, [])}
        # The render resolved the budget as generating did (the client's, or the room the
        # window leaves), so a continuation never falls back to the completions route's 16.
        body |= remaining(int(params["max_tokens"]), params.get("min_tokens"), sent)
        body["stream"] = True
        body["return_token_ids"] = True  # to count the output
        return body

    def continuation(self) -> Continuation:
        if not self._continued:
            self.seam(self._last)
        self._events = Events()
        self._continued = True
        return Continuation("/v1/completions", msgspec.json.encode(self._body))

    def _translate(self, event: bytes) -> bytes:
        """One completions event as the protocol's; its end once the text is finished."""
        if not event.startswith(_DATA) or event.startswith(_DONE) or self.finished:
            return b""
        chunk = msgspec.json.decode(event[len(_DATA):], type=_Chunk)
        if not chunk.choices:
            return b""
        choice = chunk.choices[0]
        self.output_tokens += len(choice.token_ids or ())
        out = b""
        if choice.text:
            self._sent += msgspec.json.encode(choice.text)[1:-1]
            out = self.delta(choice.text)
        if choice.finish_reason is not None:
            self.finished = True
            out += self.end(choice.finish_reason)
        return out

    def tail(self) -> bytes:
        """Nothing: a finished stream had its end already (the worker's, or the record's)."""
        return b""

    # --- what a protocol says ---------------------------------------------------------------

    @property
    def opened(self) -> bool:
        """Whether the stream's head went to the client: the continuation goes on from it."""
        raise NotImplementedError

    def read(self, name: str, data: bytes) -> None:
        """An event of the worker's stream other than a text delta: its name and its data
        (JSON, decoded only where the record needs what it says)."""
        raise NotImplementedError

    def seam(self, last: bytes) -> None:
        """Where the worker's stream stopped: its last event, as the client got it."""

    def delta(self, text: str) -> bytes:
        """The protocol's events for continued text."""
        raise NotImplementedError

    def end(self, finish_reason: str) -> bytes:
        """The protocol's events that end the stream, with the whole text and usage."""
        raise NotImplementedError

