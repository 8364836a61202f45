"""Each API's own rules beyond the common ones (tools, thinking, background, the response id),
composed from the policy functions with the settings they need. Every one returns whether it
changed the body, so that the gate knows to re-encode it."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from appliance import policy
from appliance.errors import BadRequest
from appliance.policy.tools import apply_template_defaults, tools_active
from appliance.settings import Settings

ApiRules = Callable[[dict[str, Any], Settings], bool]

# Anthropic's tool_choice types, in the chat vocabulary vLLM translates them to.
_ANTHROPIC_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Chat: tool calls need a parser; the thinking switch and template defaults."""
    rules = settings.policy
    policy.check_tools(body, tool_parser=settings.engine.tool_call_parser)
    return policy.apply_thinking(body, default_kwargs=rules.default_chat_template_kwargs,
                                 disable_with_tools=rules.disable_thinking_with_tools)


def batch_rules(body: dict[str, Any], settings: Settings) -> bool:
    """A chat batch: one set of parameters for every conversation, so the chat's rules."""
    return chat_rules(body, settings)


def tokenize_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Messages are rendered with the template defaults a chat gets, so counts agree."""
    if body.get("messages") is None:
        return False
    return apply_template_defaults(body, settings.policy.default_chat_template_kwargs,
                                   thinking_off=False)


def responses_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Responses: no background generation unless allowed, tools as for chat, template
    defaults (its `reasoning` is vLLM's own), and a response id the appliance knows."""
    rules = settings.policy
    if body.get("background") is True and not rules.allow_background_responses:
        raise BadRequest("'background' responses run on the engine with no client connection, "
                         "outside admission control, and are off on this appliance (setting "
                         "policy.allow_background_responses).", param="background",
                         code="background_not_allowed")
    policy.check_tools(body, tool_parser=settings.engine.tool_call_parser)
    changed = apply_template_defaults(
        body, rules.default_chat_template_kwargs,
        thinking_off=rules.disable_thinking_with_tools and tools_active(body))
    if not isinstance(body.get("request_id"), str) or not body["request_id"]:
        # The worker names the response after it: known here, the id's worker can be told.
        body["request_id"] = f"resp_{uuid.uuid4().hex}"
        changed = True
    return changed


def anthropic_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Anthropic Messages: tools as for chat (in Anthropic's tool_choice vocabulary); its
    `thinking` is vLLM's own; template defaults under the client's chat_template_kwargs."""
    policy.check_tools(_as_chat(body), tool_parser=settings.engine.tool_call_parser)
    return anthropic_count_rules(body, settings)


def anthropic_count_rules(body: dict[str, Any], settings: Settings) -> bool:
    """count_tokens renders what /v1/messages would: the same template arguments."""
    rules = settings.policy
    thinking = body.get("thinking")
    chose_thinking = isinstance(thinking, dict) and thinking.get("type") == "enabled"
    return apply_template_defaults(
        body, rules.default_chat_template_kwargs,
        thinking_off=rules.disable_thinking_with_tools and tools_active(_as_chat(body))
        and not chose_thinking)


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    return {"tools": body.get("tools"), "tool_choice": _chat_tool_choice(body)}


def _chat_tool_choice(body: dict[str, Any]) -> Any:
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None  # vLLM: "auto" whenever tools are given
    kind = choice.get("type")
    return _ANTHROPIC_CHOICES.get(kind, choice) if isinstance(kind, str) else choice
