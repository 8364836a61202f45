"""What vLLM 0.32 writes, for the synthetic worker: its Responses and Anthropic Messages
objects and stream events (fields in vLLM's order, its defaults and nulls) and its own error
answers (tests/unit/support/test_synthetic_upstream.py compares them with recorded streams)."""

from __future__ import annotations

import json
import time
from typing import Any

REJECT_MARKER = "synthetic:reject"
CRASH_MARKER = "synthetic:crash"
Event = tuple[str, dict[str, Any]]


def response(response_id: str, model: str, request: dict[str, Any], text: str, prompt: int,
             count: int, *, cut: bool) -> dict[str, Any]:
    """A finished Responses response holding `text`: `incomplete` where the budget cut it."""
    usage = {"input_tokens": prompt,
             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                      "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
             "output_tokens": count,
             "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                       "output_tokens_per_turn": [],
                                       "tool_output_tokens_per_turn": []},
             "total_tokens": prompt + count}
    return {
        "id": response_id, "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": request.get("instructions"), "metadata": request.get("metadata"),
        "model": model, "object": "response", "output": [_message(text, "completed")],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": float(request.get("temperature", 1.0)),
        "tool_choice": request.get("tool_choice", "none"), "tools": request.get("tools", []),
        "top_p": float(request.get("top_p", 1.0)), "background": False,
        "max_output_tokens": request.get("max_output_tokens"), "max_tool_calls": None,
        "previous_response_id": request.get("previous_response_id"), "prompt": None,
        "reasoning": None, "service_tier": "auto", "status": "incomplete" if cut else "completed",
        "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
        "user": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
        "output_messages": None}


def response_events(answer: dict[str, Any], deltas: list[str]) -> list[Event]:
    """The stream of `answer`: its nine kinds of event, numbered, a delta a token."""
    running = answer | {"output": [], "status": "in_progress", "usage": None,
                        "incomplete_details": None}
    item, done = _message("", "in_progress"), answer["output"][0]
    part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    at = {"content_index": 0, "item_id": item["id"], "output_index": 0}
    events = [("response.created", {"response": running}),
              ("response.in_progress", {"response": running}),
              ("response.output_item.added", {"item": item, "output_index": 0}),
              ("response.content_part.added", at | {"part": part}),
              *(("response.output_text.delta", at | {"delta": delta, "logprobs": []})
                for delta in deltas),
              ("response.output_text.done", at | {"logprobs": [], "text": "".join(deltas)}),
              ("response.content_part.done", at | {"part": done["content"][0]}),
              ("response.output_item.done", {"item": done, "output_index": 0}),
              ("response.completed", {"response": answer})]
    # vLLM writes these events' fields in alphabetical order (the OpenAI types' order).
    return [(name, dict(sorted((data | {"sequence_number": n, "type": name}).items())))
            for n, (name, data) in enumerate(events)]


def message_events(message: dict[str, Any], deltas: list[str]) -> list[Event]:
    """The Anthropic stream of `message`: the usage so far in message_start, one text block
    (start, a delta a token, stop), the total in message_delta."""
    start = {"type": "message_start", "message": message | {
        "content": [], "stop_reason": None, "usage": message["usage"] | {"output_tokens": 0}}}
    block = {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
             "index": 0}
    end = {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                              "stop_sequence": None},
           "usage": message["usage"]}
    return [("message_start", start), ("content_block_start", block),
            *(("content_block_delta", {"type": "content_block_delta", "delta": {
                "type": "text_delta", "text": delta}, "index": 0}) for delta in deltas),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", end), ("message_stop", {"type": "message_stop"})]


def _message(text: str, status: str) -> dict[str, Any]:
    """A Responses output message: holding `text` once completed, empty while in progress."""
    content = [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
    return {"id": "msg_synthetic", "content": content if status == "completed" else [],
            "role": "assistant", "status": status, "type": "message", "phase": None}


def vllm_fault(request: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's own error answer where a field or a marker upsets it (its shape: an integer code)."""
    text = json.dumps([request.get("prompt"), request.get("messages")])
    structured = request.get("structured_outputs")
    if CRASH_MARKER in text or (structured is not None and not isinstance(structured, dict)):
        return {"error": {"message": "'bool' object has no attribute 'get'",
                          "type": "InternalServerError", "param": None, "code": 500}}
    if request.get("prompt_embeds") is not None:  # vLLM without --enable-prompt-embeds
        return {"error": {"message": "You must set `--enable-prompt-embeds` to input "
                                     "`prompt_embeds`.", "type": "BadRequestError",
                          "param": "prompt_embeds", "code": 400}}
    if REJECT_MARKER in text:
        return {"error": {"message": "1 validation error for ChatCompletionRequest\n  Value "
                                     "error, synthetic rejection [type=value_error]",
                          "type": "BadRequestError", "param": None, "code": 400}}
    return None
