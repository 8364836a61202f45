"""Amplification (issue 9 #8): every per-request fan-out is bounded. A batch of 10,000 one-token
prompts is refused or answered within QUICK_S, never counted with 10,000 /tokenize calls."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.stack import Stack
from tests.unit.appliance.edge.limits import QUICK_S
from tests.unit.appliance.edge.shapes import assert_openai_error

PROMPTS = 10_000
MAX_TOKENIZE_CALLS = 2  # a batch is counted in one call, or refused before any


@pytest.mark.parametrize("prompt", [["abcd"] * PROMPTS, [[17]] * PROMPTS],
                         ids=["strings", "token-ids"])
def test_a_ten_thousand_prompt_batch_is_settled_quickly_with_bounded_tokenize_calls(
        stack: Stack, prompt: list[object]) -> None:
    """#8: a budget over the window makes the worker refuse and the gate count the prompts:
    the answer (a clamp, or a 400 in the OpenAI shape) comes within QUICK_S and costs at most
    MAX_TOKENIZE_CALLS calls to the worker's /tokenize. (Its own module: on 64a2e0c the gate kept
    calling /tokenize after this client had given up.)"""
    before = stack.engine_counter("synthetic_tokenize_calls_total")
    started = time.monotonic()
    try:
        response = httpx.post(f"{stack.url}/v1/completions", timeout=2 * QUICK_S,
                              json={"prompt": prompt, "max_tokens": 1_000_000})
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {2 * QUICK_S}s")
    elapsed = time.monotonic() - started
    calls = stack.engine_counter("synthetic_tokenize_calls_total") - before
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert_openai_error(response)
    assert elapsed < QUICK_S, f"answered after {elapsed:.1f}s"
    assert calls <= MAX_TOKENIZE_CALLS, f"{calls:.0f} /tokenize calls for one request"
