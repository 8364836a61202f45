"""How an OpenAI chat or completions stream goes on after an engine fault.

The continuation is a completions request whose prompt is the prompt's token ids plus those
generated so far, with the same sampling fields and what is left of the budget; its events are
read back into the client's protocol (appliance/recovery/stream.py says what is kept).

A stream is resumable when its tokens alone say where it stood. Not when the worker keeps
state beside them that a continuation would lose or restart: several choices, logprobs, stop
strings (the worker holds back text that might start one), output constraints and tool or
reasoning parsing (their parser state), media in the prompt (its placeholders need the media),
continuous usage. Those streams are replayed while the client has received nothing, and
otherwise end with the engine_lost error as before.

With sampling, the continuation draws from a fresh random state (a seed restarts), so a resumed
stream is a valid sample of the same request, not the uninterrupted run's; presence and
frequency penalties count the tokens before the seam as prompt. Greedy decoding is the same
either way, byte for byte.

The continuation carries what is left of the budget the request resolved to, and its
`min_tokens` less what was generated (never above what is left). A request sent without a
budget (and no `policy.default_max_tokens` put one in) had the worker's own: the room its
prompt left in the window for chat, 16 for completions. The completions route a continuation
goes to would take its own 16 again, so the new worker renders the body once (its render route
resolves the budget as generating did) and the continuation carries the rest of that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from appliance.fences.vllm import CHAT_RENDER, COMPLETIONS_RENDER
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET
from appliance.recovery.stream import StreamRecord, WorkerCall, ask, asks_any, remaining, sse

# The sampling fields a continuation carries over as they are: each means the same to a
# completions request as to the chat or completions request it continues.
_CARRIED = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
    "cache_salt", "vllm_xargs", "user", "stream_interval",
)
# Fields whose presence (with a value that asks for something) keeps a stream from resuming.
_STATEFUL = frozenset((
    "stop", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "best_of",
    "use_beam_search", "structured_outputs", "tools", "prompt_embeds",
    "return_tokens_as_token_ids", "return_token_offsets", "return_mm_kwargs",
    "kv_transfer_params", "ec_transfer_params", "logprob_token_ids", "thinking_token_budget",
))


def plain_stream(body: Mapping[str, Any]) -> bool:
    """Whether a streamed body's tokens alone say where it stands (see the module's doc)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return False
    if asks_any(body, _STATEFUL):
        return False
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("continuous_usage_stats"))


class _Rendered(msgspec.Struct):
    sampling_params: dict[str, Any]


class _Continued(StreamRecord):
    """What chat and completions continuations share: the request for the rest."""

    budget_fields: ClassVar[tuple[str, ...]]  # the worker obeys the first one given
    render_path: ClassVar[str]  # where the worker resolves a body's budget without generating
    _budget: int | None = None  # the budget the request resolved to, once prepared

    def given_budget(self) -> int | None:
        """The budget in the body as forwarded (the client's, the gate's default, clamped)."""
        for name in self.budget_fields:
            value = self._payload.get(name)
            if value is not None:
                return value if isinstance(value, int) else None
        return None

    async def prepare(self, worker: WorkerCall) -> None:
        """The budget the request resolved to: the body's, else as the new worker renders it
        (once: a second fault continues from the same one)."""
        if self._budget is None:
            self._budget = self.given_budget()
        if self._budget is None:
            rendered = await ask(worker, self.render_path, dict(self._payload),
                                 _Rendered | list[_Rendered])  # type: ignore[arg-type]
            first = rendered[0] if isinstance(rendered, list) else rendered
            self._budget = int(first.sampling_params["max_tokens"])

    def continued_fields(self, generated: int) -> dict[str, Any]:
        payload = self._payload
        fields: dict[str, Any] = {k: payload[k] for k in _CARRIED if k in payload}
        budget = self._budget if self._budget is not None else self.given_budget()
        assert budget is not None, "prepare() resolves the budget before the continuation"
        fields |= remaining(budget, payload.get("min_tokens"), generated)
        fields["stream"] = True
        fields["stream_options"] = {"include_usage": self.usage_asked()}
        fields["return_token_ids"] = True  # a second fault continues from the new ids too
        return fields

    def _continued_choice(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The continuation event's choice, its ids recorded and left as the client gets them;
        None for the usage event."""
        choices = event.get("choices") or []
        if not choices:
            return None
        choice: dict[str, Any] = choices[0]
        ids = choice.get("token_ids") or []
        self.record(",".join(map(str, ids)).encode(), bool(choice.get("text")))
        if choice.get("finish_reason") is not None:
            self.finished = True
        choice["token_ids"] = self.unseen(ids)
        return choice

    @staticmethod
    def _says_nothing(choice: dict[str, Any]) -> bool:
        """No text, no ids the client has not seen, no finish: the event is not sent."""
        return not (choice.get("text") or choice["token_ids"] or choice.get("finish_reason"))

    def _usage(self, event: dict[str, Any]) -> bytes:
        """The continuation's usage event as the whole answer's (b"" for an empty event)."""
        return self.usage_event(event.get("system_fingerprint")) if "usage" in event else b""


class ChatRecord(_Continued):
    """A chat stream: its first event holds the prompt's ids at the top; a content event with
    nothing to say (`"delta":{}`) carries the ids of a character not complete yet."""

    budget_fields = CHAT_BUDGET
    render_path = CHAT_RENDER
    event_object = "chat.completion.chunk"

    no_text = b'"delta":{}'

    def translate(self, event: dict[str, Any]) -> bytes:
        choice = self._continued_choice(event)
        if choice is None:
            return self._usage(event)
        assert self.head is not None
        if self._says_nothing(choice):
            return b""
        text, finish = choice.get("text") or "", choice.get("finish_reason")
        delta = {"content": text} if text or finish is not None else {}
        out_choice: dict[str, Any] = {"index": 0, "delta": delta,
                                      "logprobs": None, "finish_reason": finish}
        if finish is not None:
            out_choice["stop_reason"] = choice.get("stop_reason")
        out_choice["token_ids"] = choice.get("token_ids")
        out: dict[str, Any] = {"id": self.head.id, "object": "chat.completion.chunk",
                               "created": self.head.created, "model": self.head.model,
                               "choices": [out_choice]}
        if "system_fingerprint" in event:
            out["system_fingerprint"] = event["system_fingerprint"]
        return sse(out)


class CompletionRecord(_Continued):
    """A completions stream: its first choice holds the prompt's ids."""

    budget_fields = COMPLETION_BUDGET
    render_path = COMPLETIONS_RENDER
    event_object = "text_completion"

    no_text = b'"text":""'

    def translate(self, event: dict[str, Any]) -> bytes:
        choice = self._continued_choice(event)
        if choice is None:
            return self._usage(event)
        if self._says_nothing(choice):
            return b""
        assert self.head is not None
        event["id"], event["created"], event["model"] = self.head.id, self.head.created, self.head.model
        choice["prompt_token_ids"] = None
        return sse(event)
