"""Whether a Responses or Anthropic stream continued from its text reads as an uninterrupted one,
on the real CPU worker, at many seams.

    python -m load.faults.resume_identity [--max-tokens 60] [--cuts 1,5,10,20,40]

Those streams carry no token ids: a resumed one goes on from its text, tokenized again on the
new worker (appliance/recovery/text.py), and the tokenizer may split the text otherwise than
the engine generated it. For each prompt and protocol, at temperature 0, one uninterrupted
stream straight from the worker; then for each cut (the number of text deltas the client had),
the protocol's record is fed the stream up to the cut, prepares its continuation on the same
worker (render, tokenize), and the continuation's events, read back through the record, end
the stream. Printed per protocol: the seams whose whole text equals the uninterrupted run's,
whose every event does (ids and times aside), and whose usage does (the sent text's tokens
counted as tokenized again). What the engine's death adds (the kill, the wait, the new
worker) the integration tests show (tests/integration/test_resume.py); the seam is measured
here. A benchmark, not a test: it exits 0 whatever it measured. Under the shared lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from appliance.apis.anthropic.resume import MessagesRecord
from appliance.apis.responses.resume import ResponsesRecord
from appliance.recovery.text import TextRecord
from load.kit import results
from load.kit.appliance import Appliance, running_appliance
from load.kit.stream_events import normalized

PROMPTS = ("Write a short story about a lighthouse keeper.",
           "Explain how a bicycle stays upright.",
           "List some facts about the moon.",
           "Describe a walk through a forest in autumn.")
PROTOCOLS: dict[str, tuple[str, type[TextRecord]]] = {
    "responses": ("/v1/responses", ResponsesRecord), "messages": ("/v1/messages", MessagesRecord)}


def body(protocol: str, prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
    common = {"model": model, "temperature": 0, "stream": True}
    if protocol == "responses":
        return common | {"input": prompt, "max_output_tokens": max_tokens, "store": False}
    return common | {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


def events(raw: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def decoded(stream: list[bytes]) -> list[dict[str, Any] | str]:
    return [json.loads(e.split(b"data: ", 1)[1]) for e in stream if b"data: " in e]


class Seams:
    """One protocol's tally."""

    def __init__(self) -> None:
        self.seams = self.text = self.events = self.usage = 0


async def seam(worker: httpx.AsyncClient, protocol: str, sent: dict[str, Any],
               whole: list[bytes], cut: int, tally: Seams) -> None:
    """The stream cut after `cut` text deltas, continued through its record on the worker."""
    kind = PROTOCOLS[protocol][1]
    deltas = [i for i, e in enumerate(whole) if e.startswith(kind.delta_prefix)]
    if cut > len(deltas):
        return
    end = deltas[cut - 1] + 1
    record = kind(sent)
    for event in whole[:end]:
        record.take(event)

    async def ask(route: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        answer = await worker.post(route, json=payload)
        return answer.status_code, answer.content

    await record.prepare(ask)
    continuation = record.continuation()
    rest = b""
    async with worker.stream("POST", continuation.target, content=continuation.body,
                             headers={"content-type": "application/json"}) as answer:
        async for chunk in answer.aiter_raw():
            rest += record.take(chunk)
    tally.seams += 1
    resumed, plain = decoded(whole[:end] + events(rest)), decoded(whole)
    tally.text += record.text == "".join(_text(e) for e in plain)
    tally.events += normalized(resumed, {}) == normalized(plain, {})
    tally.usage += _usage(resumed) == _usage(plain)


def _text(event: dict[str, Any] | str) -> str:
    if not isinstance(event, dict):
        return ""
    if event.get("type") == "response.output_text.delta":
        return str(event["delta"])
    return str(event.get("delta", {}).get("text") or "") \
        if event.get("type") == "content_block_delta" else ""


def _usage(stream: list[dict[str, Any] | str]) -> Any:
    last = [e for e in stream if isinstance(e, dict) and e.get("type") in (
        "response.completed", "message_delta")]
    if not last:
        return None
    return last[-1]["response"]["usage"] if "response" in last[-1] else last[-1]["usage"]


async def measure(appliance: Appliance, max_tokens: int, cuts: list[int]) -> None:
    assert appliance.engine_socket is not None
    transport = httpx.AsyncHTTPTransport(uds=str(appliance.engine_socket))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker",
                                 timeout=300) as worker:
        model = (await worker.get("/v1/models")).json()["data"][0]["id"]
        for protocol, (path, _) in PROTOCOLS.items():
            tally = Seams()
            for prompt in PROMPTS:
                sent = body(protocol, prompt, model, max_tokens)
                whole = events((await worker.post(path, json=sent)).content)
                for cut in cuts:
                    await seam(worker, protocol, sent, whole, cut, tally)
            print(json.dumps({"protocol": protocol, **tally.__dict__}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--cuts", default="1,5,10,20,40")
    results.add_option(parser)
    args = parser.parse_args(argv)
    cuts = [int(cut) for cut in args.cuts.split(",")]
    with (tempfile.TemporaryDirectory() as tmp, running_appliance(Path(tmp)) as appliance,
          results.Printed() as printed):
        appliance.wait_ready()
        asyncio.run(measure(appliance, args.max_tokens, cuts))
    results.save(__spec__.name, argv, printed.text(), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
