"""Client mistakes are never a 5xx (issue 9 #6, #10): lone surrogates, numbers JSON cannot carry
(1e999), `prompt: null` with `prompt_embeds`, a 400-digit budget; each is a 400 in the OpenAI
shape naming the field, also where the worker's refusal sends the gate to count the prompt."""

from __future__ import annotations

import httpx
import pytest

from tests.support.stack import Stack
from tests.unit.appliance.edge.shapes import assert_openai_error, names

HI = '[{"role": "user", "content": "hi"}]'
HUGE = "1000000"  # over the window: the worker refuses it, and the gate counts the prompt
DIGITS = "9" * 400
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _post(stack: Stack, path: str, raw: str) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", content=raw.encode(), timeout=30,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "raw", "param"), [
    pytest.param(CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": '
                 + HUGE + "}", "messages", id="surrogate-in-message"),
    pytest.param(COMPLETIONS, '{"prompt": "a\\udc00b", "max_tokens": ' + HUGE + "}", "prompt",
                 id="surrogate-in-prompt"),
    pytest.param(CHAT, '{"messages": ' + HI + ', "max_tokens": ' + HUGE
                 + ', "chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs",
                 id="surrogate-in-a-key"),
    pytest.param(CHAT, '{"messages": ' + HI + ', "max_tokens": ' + HUGE
                 + ', "chat_template_kwargs": {"x": 1e999}}', "chat_template_kwargs",
                 id="1e999-in-chat_template_kwargs"),
    pytest.param(COMPLETIONS, '{"prompt": null, "prompt_embeds": "AAAA", "max_tokens": ' + HUGE
                 + "}", "prompt_embeds", id="null-prompt-with-embeds"),
    pytest.param(CHAT, '{"messages": ' + HI + ', "max_tokens": 4, "logit_bias": {"5": 1e999}}',
                 "logit_bias", id="1e999-in-logit_bias"),
    pytest.param(COMPLETIONS, '{"prompt": "x", "max_tokens": 4, "presence_penalty": 1e999}',
                 "presence_penalty", id="1e999-in-presence_penalty"),
    pytest.param(CHAT, '{"messages": ' + HI + ', "max_tokens": 4, "temperature": 1e999}',
                 "temperature", id="1e999-in-temperature"),
    pytest.param(CHAT, '{"messages": ' + HI + ', "max_tokens": 4, "top_p": -1e999}',
                 "top_p", id="-1e999-in-top_p"),
])
def test_a_client_mistake_is_a_400_naming_the_field(stack: Stack, path: str, raw: str,
                                                    param: str) -> None:
    """#6/#10: 400, the OpenAI error shape, the field at fault named (in `param` or the
    message). The null prompt with prompt_embeds: the worker refuses prompt_embeds (vLLM does
    without --enable-prompt-embeds) and the gate's recount after that refusal must not crash."""
    response = _post(stack, path, raw)
    assert response.status_code == 400, response.text[:300]
    error = assert_openai_error(response)
    assert names(error, param), error


@pytest.mark.parametrize(("path", "raw"), [
    (CHAT, '{"messages": ' + HI + ', "max_tokens": ' + DIGITS + "}"),
    (COMPLETIONS, '{"prompt": "x", "max_tokens": ' + DIGITS + "}"),
], ids=["chat", "completions"])
def test_a_400_digit_max_tokens_is_not_echoed_in_a_header(stack: Stack, path: str,
                                                          raw: str) -> None:
    """#10: clamped or refused (400 naming max_tokens), never a 5xx, and the digits are not
    copied into a response header."""
    response = _post(stack, path, raw)
    assert response.status_code < 500, response.text[:300]
    echoed = [name for name, value in response.headers.items() if DIGITS[:50] in value]
    assert not echoed, f"the 400 digits came back in {echoed}"
    if response.status_code == 400:
        assert assert_openai_error(response)["param"] == "max_tokens"
