"""Which of vLLM's own tests the compatibility suite runs, which it leaves out and why.

The selection: vLLM 0.32.0's tests of the OpenAI-compatible server's routes that a user of the
OpenAI SDK or of vLLM's docs calls on a text-only chat model: chat and text completions,
logprobs, structured output, chunked prompts, the batch chat route, tokenization and the basic
routes. Out of it by design: LoRA, multimodal, pooling, speech, tool-call and reasoning
parsers, Responses/Anthropic (their own models and flags), metrics (the appliance's
/metrics is its own), and every test that runs in-process without a server (the plugin
deselects those: they cannot tell two endpoints apart).

Each exclusion skips the test in both runs, with its reason; none is allowed to hide a
difference between the runs. The one allowed difference is the appliance's deliberate n cap.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"

_CHAT = "tests/entrypoints/openai/chat_completion/"
_COMPLETION = "tests/entrypoints/openai/completion/"
_TOKENIZE = "tests/entrypoints/serve/tokenize/test_tokenization.py"
_BASIC = "tests/entrypoints/serve/instrumentator/test_basic.py"

FILES: tuple[str, ...] = (
    f"{_CHAT}test_chat.py",
    f"{_CHAT}test_chat_completion.py",
    f"{_CHAT}test_chat_echo.py",
    f"{_CHAT}test_chat_logit_bias_validation.py",
    f"{_CHAT}test_logprob_token_ids.py",
    f"{_CHAT}test_batched_chat_completions.py",
    f"{_COMPLETION}test_completion.py",
    f"{_COMPLETION}test_prompt_validation.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    _TOKENIZE,
    _BASIC,
)

# Flags the selection needs of the worker beyond the appliance's own; `--serve` starts it so.
WORKER_FLAGS: tuple[str, ...] = ("--enable-tokenizer-info-endpoint",)

_LORA = "uses the LoRA adapter its server loads (--enable-lora): the appliance serves one base model"
_ZEPHYR = "asserts on zephyr-7b-beta's own answer; a 135M model answers otherwise"
_OPT = "asserts on facebook/opt-125m's own output"
_NO_LIMIT = ("sends no max_tokens, trusting the model to end its answer soon: SmolLM2-135M goes on "
             "for hundreds of tokens (it timed out at 240 s on a 2-core CPU)")

EXCLUDED: dict[str, str] = {
    **{f"{_CHAT}test_chat.py::{name}[zephyr-lora]": _LORA for name in (
        "test_no_logprobs_chat", "test_zero_logprobs_chat", "test_some_logprobs_chat",
        "test_too_many_chat_logprobs", "test_single_chat_session", "test_chat_streaming",
        "test_chat_completion_stream_options")},
    f"{_CHAT}test_chat.py::test_single_chat_session":
        f"{_ZEPHYR} (prompt_tokens=37 is zephyr's chat template)",
    f"{_CHAT}test_chat.py::test_more_than_one_prompt_logprobs_chat":
        f"{_ZEPHYR} (its top-1 guess of the 4th prompt token is that token)",
    f"{_CHAT}test_chat.py::test_structured_outputs_choice_chat":
        f"{_ZEPHYR} (another pick when told 'I disagree', sampled at temperature 0.7: a 135M "
        "model may well repeat its pick)",
    f"{_CHAT}test_chat.py::test_structured_outputs_regex_chat":
        f"{_ZEPHYR} (a different IP address on request: SmolLM2 repeated 172.57.55.65 in one "
        "of three runs)",
    f"{_CHAT}test_chat.py::test_structured_outputs_json_chat":
        f"{_ZEPHYR} (a different name and age on request, in up to 2x1000 tokens)",
    f"{_CHAT}test_chat.py::test_complex_message_content": f"{_ZEPHYR} (content == '2')",
    f"{_CHAT}test_chat.py::test_response_format_json_object": f"{_ZEPHYR} ({{'result': 2}})",
    f"{_CHAT}test_chat.py::test_response_format_json_schema": f"{_ZEPHYR} ({{'result': 2}})",
    f"{_CHAT}test_chat.py::test_custom_role": _NO_LIMIT,
    **{f"{_CHAT}test_batched_chat_completions.py::{name}": f"{_NO_LIMIT}; its client gives up "
       "after 60 s (timed out in one of three runs)" for name in (
        "test_batched_chat_completions", "test_batched_chat_completions_return_tokens_as_token_ids")},
    **{f"{_CHAT}test_chat_echo.py::{name}": "needs --max-logprobs at the vocabulary's size (vLLM's "
       "default is 20): logprobs of every token in the vocabulary, per token, are a memory and "
       "bandwidth hazard on a shared endpoint" for name in ("test_prompt_logprobs", "test_top_logprobs")},
    "tests/entrypoints/openai/test_return_token_ids.py::test_chat_completion_with_tool_use":
        "needs --enable-auto-tool-choice --tool-call-parser hermes (engine.tool_call_parser; "
        "the bundled model has no tool-call format)",
    "tests/entrypoints/openai/test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs":
        "asserts on Qwen2.5's own output (20 greedy tokens without its end token; SmolLM2 ends "
        "sooner and the decoded ids then carry <|im_end|>)",
    f"{_COMPLETION}test_completion.py::test_single_completion":
        f"{_OPT} (prompt_tokens=6 with OPT's BOS) and needs --enable-prompt-tokens-details",
    f"{_COMPLETION}test_completion.py::test_completion_streaming":
        f"{_OPT} (5 greedy tokens for 'What is an LLM?'; SmolLM2 stops sooner)",
    **{f"{_COMPLETION}test_completion.py::{name}":
        f"{_OPT} (3 distinct seeded samples for 'What is an LLM?'; two of SmolLM2's are empty)"
       for name in ("test_parallel_no_streaming", "test_parallel_streaming")},
    f"{_BASIC}::test_request_cancellation":
        "needs --max-model-len 10100, above SmolLM2's 8192-token window, and 200 requests of "
        "10000 tokens each: through the appliance the admission limit (policy.max_inflight) "
        "answers 429 by design",
    f"{_BASIC}::test_server_load":
        "needs --enable-server-load-tracking and vLLM's /load route (operational, not served "
        "by the appliance: /health and /metrics are its own)",
}

# Tests that pass against the worker and fail through the appliance, on purpose, and the text
# that the appliance's refusal must carry for the difference to count as this one.
N_CAP = ("policy.max_n", "n=3 is above the appliance's n cap (policy.max_n, default 2): "
         "refused with 400 by design")
ALLOWED_DIFFERENCES: dict[str, tuple[str, str]] = {
    f"{_CHAT}test_chat.py::test_chat_completion_n_parameter_non_streaming": N_CAP,
}


def bare(nodeid: str) -> str:
    """The node id without its parameters: `path::test[param]` -> `path::test`."""
    return nodeid.split("[", 1)[0]
