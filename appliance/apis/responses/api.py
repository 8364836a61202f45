"""The Responses API as the gate and the relay serve it, and its error shape and stream ending."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from appliance import policy
from appliance.apis.api import GenerationApi, relayed
from appliance.apis.openai.api import OpenAIShape
from appliance.apis.shape import StreamSoFar, sse_event
from appliance.errors import ApiError, BadRequest
from appliance.policy import fields, surface
from appliance.policy.tools import apply_template_defaults, tools_active
from appliance.settings import Settings

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


def responses_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Responses: no background generation unless allowed, tools as for chat, template
    defaults (its `reasoning` is vLLM's own), and a response id the appliance knows."""
    limits = settings.policy
    if body.get("background") is True and not limits.allow_background_responses:
        raise BadRequest("'background' responses run on the engine with no client connection, "
                         "outside admission control, and are off on this appliance (setting "
                         "policy.allow_background_responses).", param="background",
                         code="background_not_allowed")
    policy.check_tools(body, tool_parser=settings.engine.tool_call_parser)
    changed = apply_template_defaults(
        body, limits.default_chat_template_kwargs,
        thinking_off=limits.disable_thinking_with_tools and tools_active(body))
    if not isinstance(body.get("request_id"), str) or not body["request_id"]:
        # The worker names the response after it: known here, the id's worker can be told.
        body["request_id"] = f"resp_{uuid.uuid4().hex}"
        changed = True
    return changed


RESPONSES_CREATE = GenerationApi(
    name="responses",
    path="/v1/responses",
    validate=surface.validate_responses,
    fields=fields.ResponsesFields,
    budget_fields=("max_output_tokens",),
    prompt="responses",
    shape=RESPONSES,
    find_media=policy.find_responses_media,
    rules=responses_rules,
)

RESPONSES_RETRIEVE = relayed("responses_retrieve", "/v1/responses/{id}", RESPONSES)
RESPONSES_CANCEL = relayed("responses_cancel", "/v1/responses/{id}/cancel", RESPONSES)


def _last_sequence(so_far: StreamSoFar) -> int:
    """The last sequence number the client saw (-1 if none): found in the last chunks only."""
    for chunk in (so_far.last, so_far.before_last):
        found = _SEQUENCE.findall(chunk[-4096:])
        if found:
            return int(found[-1])
    return -1
