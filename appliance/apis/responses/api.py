"""The Responses API as the gate and the relay serve it (create; retrieve and cancel relayed as
they are), and its error shape and stream ending."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from appliance import policy
from appliance.answers.shape import StreamSoFar, sse_event
from appliance.apis.api import GenerationApi, WorkerRoute
from appliance.apis.counting import Limits, PromptCounter, chat_bound
from appliance.apis.openai.api import OpenAIShape
from appliance.apis.responses.resume import ResponsesRecord, plain_response
from appliance.core.errors import ApiError, BadRequest
from appliance.core.settings import Settings
from appliance.fences.vllm import RESPONSES_RENDER
from appliance.policy import fields, surface
from appliance.policy.tools import apply_template_defaults, tools_active

_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


class ResponsesShape(OpenAIShape):
    """The Responses API: OpenAI's error body; a stream ends in its own events, `error` then the
    terminal `response.failed` (same response id as the stream's), and no [DONE]."""

    name = "responses"

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        sequence = _last_sequence(so_far) + 1
        request = so_far.request
        failed: dict[str, Any] = {
            "id": str(request.get("request_id") or ""), "object": "response",
            "created_at": int(time.time()), "model": str(request.get("model") or ""),
            "status": "failed", "output": [], "error": {"code": "server_error",
                                                         "message": error.message},
            "incomplete_details": None, "instructions": request.get("instructions"),
            "metadata": request.get("metadata"), "parallel_tool_calls": True,
            "temperature": None, "top_p": None, "tool_choice": "auto", "tools": [],
            "background": bool(request.get("background")),
        }
        events = (
            ("error", {"type": "error", "code": error.code, "message": error.message,
                       "param": error.param, "sequence_number": sequence}),
            ("response.failed", {"type": "response.failed", "sequence_number": sequence + 1,
                                 "response": failed}),
        )
        return b"".join(sse_event(name, data) for name, data in events)


RESPONSES = ResponsesShape()


class ResponsesApi(GenerationApi):
    """/v1/responses (create): counted by the worker's own /v1/responses/render."""

    name, path, shape = "responses", "/v1/responses", RESPONSES
    fields = fields.ResponsesFields
    budget_fields = ("max_output_tokens",)

    def validate(self, body: Mapping[str, Any]) -> None:
        surface.validate_responses(body)

    def media(self, body: Mapping[str, Any]) -> list[policy.MediaPart]:
        return policy.find_responses_media(body)

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """No background generation unless allowed, tools as for chat, template defaults (its
        `reasoning` is vLLM's own), and a response id the appliance knows."""
        limits = settings.policy
        if body.get("background") is True and not limits.allow_background_responses:
            raise BadRequest("'background' responses run on the engine with no client "
                             "connection, outside admission control, and are off on this "
                             "appliance (setting policy.allow_background_responses).",
                             param="background", code="background_not_allowed")
        policy.check_tools(body, tool_parser=settings.engine.tool_call_parser,
                           setting=settings.model_key("tool_call_parser"))
        changed = apply_template_defaults(
            body, limits.default_chat_template_kwargs,
            thinking_off=limits.disable_thinking_with_tools and tools_active(body))
        if not isinstance(body.get("request_id"), str) or not body["request_id"]:
            # The worker names the response after it: known here, the id's worker can be told.
            body["request_id"] = f"resp_{uuid.uuid4().hex}"
            changed = True
        return changed

    def prompt_bound(self, body: Mapping[str, Any], raw_len: int, limits: Limits,
                     multimodal: bool) -> float:
        items = body.get("input")
        turns = (len(items) if isinstance(items, list) else 1) + 1  # and the instructions
        return chat_bound(body, raw_len, limits, turns, multimodal)

    def stream_record(self, body: Mapping[str, Any], settings: Settings, *,
                      media: bool | None = None) -> ResponsesRecord | None:
        """A plain text stream (see appliance/apis/responses/resume.py)."""
        plain = self.plain_text(body, settings, plain_response, media)
        return ResponsesRecord(body) if plain else None

    def diagnosis(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's Responses stream validates the sampling parameters (logit_bias against the
        vocabulary, the output format's grammar) only after its first two events, and a refusal
        there cuts the connection (vllm/entrypoints/openai/responses/serving.py); not streamed,
        the same refusal is a 400 with its reason, before anything is generated."""
        asked = {k: v for k, v in body.items() if k not in ("request_id", "previous_response_id")}
        return asked | {"stream": False, "store": False, "background": False,
                        self.budget_fields[0]: 1}

    async def count_prompt(self, body: dict[str, Any], budget: int, limits: Limits,
                           counter: PromptCounter) -> int | None:
        # The render refuses a budget above the window, as generating would: leave it out.
        rendered = {k: v for k, v in body.items() if k not in self.budget_fields}
        return await counter.render(RESPONSES_RENDER, rendered)


RESPONSES_CREATE = ResponsesApi()
RESPONSES_RETRIEVE = WorkerRoute("responses_retrieve", "/v1/responses/{id}", RESPONSES)
RESPONSES_CANCEL = WorkerRoute("responses_cancel", "/v1/responses/{id}/cancel", RESPONSES)


def _last_sequence(so_far: StreamSoFar) -> int:
    """The last sequence number the client saw (-1 if none): found in the last chunks only."""
    for chunk in (so_far.last, so_far.before_last):
        found = _SEQUENCE.findall(chunk[-4096:])
        if found:
            return int(found[-1])
    return -1
