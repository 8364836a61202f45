"""Typed validation of every field the gate forwards, so a wrong type is a 400 naming the field.

vLLM's own models are lax in places, and some wrong types pass its validation only to fail
later as a 500 (`structured_outputs: true` did). Each request field vLLM 0.32 reads is declared
here with its JSON type; a body is checked against its API's declaration in one C-speed pass
(msgspec). JSON null is accepted wherever vLLM has a default, as OpenAI's API does; fields not
declared here pass through untouched (vLLM decides about them). Value ranges live with the rules
that need them (body.py, sampling.py, max_tokens.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from appliance.core.errors import BadRequest

Object = dict[str, Any]
Scalar = str | int | float


class _Common(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """Fields of both the chat and the completions request."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: Object | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    user: str | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    add_special_tokens: bool | None = None
    response_format: Object | None = None
    structured_outputs: Object | None = None
    priority: int | None = None
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool | None = None
    routed_experts_prompt_start: int | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    cache_salt: str | None = None
    kv_transfer_params: Object | None = None
    ec_transfer_params: Object | None = None
    vllm_xargs: dict[str, Scalar | list[Scalar]] | None = None
    repetition_detection: Object | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    watermarking: bool | None = None


class ChatFields(_Common):
    # messages are checked by body.validate_chat, part by part, with better messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Object] | None = None
    tool_choice: str | Object | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: Object | None = None
    media_io_kwargs: dict[str, Object] | None = None
    mm_processor_kwargs: Object | None = None
    return_prompt_text: bool | None = None


class CompletionFields(_Common):
    # the prompt is checked by body.validate_completion
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None  # base64 tensors


class BatchChatFields(ChatFields):
    """POST /v1/chat/completions/batch: a list of conversations under one set of parameters."""

    messages: list[list[Object | str]] | None = None


class ResponsesFields(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """POST /v1/responses, as vLLM 0.32's ResponsesRequest reads it."""

    model: str | None = None
    input: str | list[Object] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    background: bool | None = None
    include: list[str] | None = None
    metadata: Object | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: Object | None = None
    reasoning: Object | None = None
    include_reasoning: bool | None = None
    service_tier: str | None = None
    store: bool | None = None
    stream: bool | None = None
    temperature: float | None = None
    text: Object | None = None
    tool_choice: str | Object | None = None
    tools: list[Object] | None = None
    top_logprobs: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    prompt_cache_key: str | None = None
    request_id: str | None = None
    session_id: str | None = None
    priority: int | None = None
    cache_salt: str | None = None
    enable_response_messages: bool | None = None
    previous_input_messages: list[Object] | None = None
    structured_outputs: Object | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    watermarking: bool | None = None
    media_io_kwargs: dict[str, Object] | None = None
    mm_processor_kwargs: Object | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None
    kv_transfer_params: Object | None = None
    ec_transfer_params: Object | None = None
    vllm_xargs: dict[str, Scalar | list[Scalar]] | None = None
    chat_template_kwargs: Object | None = None


class CountTokensFields(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """POST /v1/messages/count_tokens (Anthropic protocol)."""

    model: str | None = None
    messages: list[Object] | None = None
    system: str | list[Object] | None = None
    tools: list[Object] | None = None
    tool_choice: Object | None = None
    thinking: Object | None = None
    output_config: Object | None = None
    chat_template_kwargs: Object | None = None


class MessagesFields(CountTokensFields):
    """POST /v1/messages (Anthropic protocol), as vLLM 0.32's AnthropicMessagesRequest reads it."""

    max_tokens: int | None = None
    metadata: Object | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cache_salt: str | None = None
    watermarking: bool | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None
    kv_transfer_params: Object | None = None
    ec_transfer_params: Object | None = None
    vllm_xargs: dict[str, Scalar | list[Scalar]] | None = None


class TokenizeFields(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """POST /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Object | str] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: Object | None = None
    tools: list[Object] | None = None
    media_io_kwargs: dict[str, Object] | None = None
    mm_processor_kwargs: Object | None = None


class DetokenizeFields(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] | None = None


_WHERE = re.compile(r" - at `\$\.?(.*)`$")


def check_fields(body: Object, fields: type[msgspec.Struct]) -> None:
    """BadRequest (code invalid_type) naming the first field whose JSON type is wrong."""
    try:
        msgspec.convert(body, fields)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _WHERE.search(text)
        param = match.group(1) if match else None
        reason = text[:match.start()] if match else text
        where = f"'{param}': " if param else ""
        raise BadRequest(f"{where}{reason[0].lower()}{reason[1:]}.", param=param,
                         code="invalid_type") from exc


class NoFields(msgspec.Struct, forbid_unknown_fields=False):
    """A route whose request carries no body the appliance reads."""
