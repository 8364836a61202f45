"""Faults under load, resume off and on side by side, on the real CPU worker, in one run.

    python -m load.faults.run [--faults 3] [--interval 20] [--users 8] [--max-tokens 40]

Per configuration (`resume.enabled` false, then true: CHAT_APPLIANCE_RESUME__ENABLED), one
appliance on the real CPU worker: first every route and prompt is asked once with no fault (the
reference: greedy answers an uninterrupted run gives), then `--users` users ask in turn chat
and completions, streamed and not, and Responses and Anthropic Messages streams, at
temperature 0, while EngineCore is killed (-9) or frozen (SIGSTOP), alternately, `--interval`
seconds after the engine was last ready, `--faults` times. Printed per fault and in total, the
two configurations next to each other: the requests that met the fault, their client-visible
failures (HTTP errors, 503s, broken connections, streams cut short or ended on an error event;
a 503 is first asked again after its Retry-After, up to --sdk-retries times, as the OpenAI and
Anthropic SDKs do by default: what still fails is what an application sees),
the seams in the answers that succeeded (a second role chunk, a second id, text that differs
from the reference), and their time to first text and total time.

Every request carries a tag of its own (`user`, or Anthropic's `metadata.user_id`) that leaves
the answer as it is: a client's requests differ, and byte-identical bodies in flight at two
faults would be quarantined (resume.quarantine_after), which is not what this measures.
A benchmark, not a test: it exits 0 whatever it measured (2 if an appliance never came up).
Under the shared lock on a shared machine: flock /tmp/ca-integration.lock python -m ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from load.bench.restart import CRASH_LOOP_OFF, engine_core
from load.faults.chaos import Chaos
from load.faults.report import References, Run, account, side_by_side
from load.faults.seams import (
    Event,
    Facts,
    Result,
    anthropic_events,
    failure,
    json_answer,
    openai_events,
    responses_events,
)
from load.kit import results
from load.kit.appliance import running_appliance

ROUTES: dict[str, tuple[str, str, bool]] = {  # name: (path, protocol, streamed)
    "chat": ("/v1/chat/completions", "chat", False),
    "chat-stream": ("/v1/chat/completions", "chat", True),
    "completions": ("/v1/completions", "completions", False),
    "completions-stream": ("/v1/completions", "completions", True),
    "responses-stream": ("/v1/responses", "responses", True),
    "messages-stream": ("/v1/messages", "messages", True),
}
PROMPTS = ("Write a short story about a lighthouse keeper.",
           "Explain how a bicycle stays upright.",
           "List some facts about the moon.",
           "Describe a walk through a forest in autumn.")
STREAMS: dict[str, Callable[[list[Event]], Facts]] = {
    "chat": lambda events: openai_events(events, chat=True),
    "completions": lambda events: openai_events(events, chat=False),
    "responses": responses_events,
    "messages": anthropic_events,
}


def request_body(route: str, prompt: str, model: str, max_tokens: int, tag: str) -> dict[str, Any]:
    _, protocol, stream = ROUTES[route]
    body: dict[str, Any] = {"model": model, "temperature": 0, "stream": stream}
    if protocol == "completions":  # vLLM's ignore_eos: every answer as long as its budget
        return body | {"prompt": prompt, "max_tokens": max_tokens, "user": tag,
                       "ignore_eos": True}
    if protocol == "responses":
        return body | {"input": prompt, "max_output_tokens": max_tokens, "user": tag,
                       "store": False}
    body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if protocol == "messages":
        return body | {"metadata": {"user_id": tag}}
    return body | {"user": tag, "ignore_eos": True}


async def ask(client: httpx.AsyncClient, route: str, prompt: str, body: dict[str, Any],
              clock: Callable[[], float], retries: int = 0) -> Result:
    """One request read to its end (or its failure), as a client lives it: a 503 asked again
    after its Retry-After up to `retries` times, as the OpenAI and Anthropic SDKs do by default
    (max_retries=2; they honour a Retry-After of up to 60 s)."""
    result = Result(route, prompt, clock(), clock())
    while True:
        wait_s = await _attempt(client, route, body, result, clock)
        if wait_s is None or result.retries >= retries:
            break
        result.retries += 1
        await asyncio.sleep(wait_s)
    result.ended = clock()
    return result


async def _attempt(client: httpx.AsyncClient, route: str, body: dict[str, Any], result: Result,
                   clock: Callable[[], float]) -> float | None:
    """One try into `result`; the Retry-After to honour if it was a 503 that gave one."""
    path, protocol, stream = ROUTES[route]
    result.status, result.transport, result.facts = None, None, None
    result.retry_after_s = None
    try:
        if stream:
            await _read_stream(client, path, protocol, body, result, clock)
        else:
            response = await client.post(path, json=body)
            result.status = response.status_code
            if response.status_code < 400:
                result.facts = json_answer(response.json(), protocol)
            elif response.status_code == 503:
                return _retry_after(response)
    except httpx.HTTPError as exc:
        result.transport = type(exc).__name__
    except (ValueError, KeyError, IndexError, TypeError):
        result.facts = None  # an answer no client could read: counted as unreadable
    return result.retry_after_s


def _retry_after(response: httpx.Response) -> float | None:
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if 0 < seconds <= 60 else None


async def _read_stream(client: httpx.AsyncClient, path: str, protocol: str,
                       body: dict[str, Any], result: Result, clock: Callable[[], float]) -> None:
    parse, events = STREAMS[protocol], []
    async with client.stream("POST", path, json=body) as response:
        result.status = response.status_code
        if response.status_code >= 400:
            await response.aread()
            if response.status_code == 503:
                result.retry_after_s = _retry_after(response)
            return
        name: str | None = None
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                event = (name, line[5:].strip())
                events.append(event)
                name = None
                if result.ttft_s is None and event[1] != "[DONE]" and parse([event]).text:
                    result.ttft_s = clock() - result.started
    result.facts = parse(events)


def core_of(worker: int) -> int | None:
    """EngineCore's pid under the worker /health names; None while it is not there."""
    try:
        return int(engine_core(worker).pid)
    except (StopIteration, OSError):
        return None


class Load:
    """`users` users asking in turn until stopped; every answer kept."""

    def __init__(self, client: httpx.AsyncClient, model: str, args: argparse.Namespace,
                 clock: Callable[[], float]) -> None:
        self._client, self._model, self._clock = client, model, clock
        self._max_tokens, self._backoff_s = args.max_tokens, args.backoff
        self._retries = args.sdk_retries
        self.results: list[Result] = []
        self.stop = asyncio.Event()

    async def user(self, number: int) -> None:
        turn = 0
        while not self.stop.is_set():
            route = list(ROUTES)[(number + turn) % len(ROUTES)]
            prompt = PROMPTS[(number + 3 * turn) % len(PROMPTS)]
            body = request_body(route, prompt, self._model, self._max_tokens, f"u{number}-{turn}")
            result = await ask(self._client, route, prompt, body, self._clock, self._retries)
            self.results.append(result)
            turn += 1
            if failure(result) is not None:  # as a client backs off: one failure, not a flood
                await asyncio.sleep(self._backoff_s)

    async def references(self, users: int) -> References:
        """Each route and prompt once, `users` at a time, with no fault: the texts to match."""
        gate = asyncio.Semaphore(users)

        async def one(route: str, prompt: str) -> Result:
            async with gate:
                body = request_body(route, prompt, self._model, self._max_tokens, "reference")
                return await ask(self._client, route, prompt, body, self._clock)

        done = await asyncio.gather(*(one(r, p) for r in ROUTES for p in PROMPTS))
        return {(r.route, r.prompt): r.facts.text for r in done
                if r.facts is not None and r.facts.complete}


async def strike(chaos: Chaos, faults: int, settle_s: float, limit_s: float) -> None:
    """`faults` strikes, each once the engine was ready for the interval; then `settle_s` more."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not (len(chaos.strikes) >= faults and chaos.settle()):
        if len(chaos.strikes) < faults or chaos.strikes[-1].recovered_s is None:
            await asyncio.to_thread(chaos.tick, float("inf"))
        await asyncio.sleep(0.5)
    await asyncio.sleep(settle_s)


async def drive(url: str, name: str, args: argparse.Namespace) -> Run:
    limits = httpx.Limits(max_connections=args.users + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits,
                                 trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        chaos = Chaos(url, args.interval, {}, victim=core_of)
        load = Load(client, model, args, chaos.elapsed)
        references = await load.references(args.users)
        chaos.begin()
        users = [asyncio.create_task(load.user(n)) for n in range(args.users)]
        try:
            await strike(chaos, args.faults, args.settle,
                         limit_s=args.faults * (args.interval + args.timeout) + 60)
        finally:
            load.stop.set()
            await asyncio.gather(*users)
            chaos.release_hung()
            chaos.close()
    print(f"{name}: {len(references)} of {len(ROUTES) * len(PROMPTS)} references, "
          f"{len(load.results)} requests, {len(chaos.strikes)} faults", flush=True)
    return account(name, load.results, chaos.strikes, references)


def configuration(resume: bool, args: argparse.Namespace) -> Run:
    """One appliance on the real CPU worker with resume on or off, driven to its end."""
    name = f"resume {'on' if resume else 'off'}"
    with tempfile.TemporaryDirectory(prefix="fault-load-") as tmp, \
            running_appliance(Path(tmp), None, resume__enabled=str(resume).lower(),
                              supervisor__crash_loop_restarts=str(CRASH_LOOP_OFF)) as appliance:
        appliance.wait_ready()
        run = asyncio.run(drive(appliance.url, name, args))
        bugs = [e for e in appliance.log_events() if e.get("event") == "request.unhandled_exception"]
    for bug in bugs[:1]:  # the appliance's own 500s: the first traceback, for whoever fixes it
        print(f"{name}: {len(bugs)} unhandled exception(s) in the appliance; the first:\n"
              f"{bug.get('exception', bug)}", flush=True)
    return run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=3, help="per configuration")
    parser.add_argument("--interval", type=float, default=20.0,
                        help="s of a ready engine under load before each fault")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--settle", type=float, default=10.0,
                        help="s of load after the last recovery")
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout, s")
    parser.add_argument("--sdk-retries", type=int, default=2,
                        help="a 503 asked again after its Retry-After, as the SDKs do (0: raw)")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help="s a user waits after a failed request before its next one")
    parser.add_argument("--json", type=Path, help="also write the tallies here")
    results.add_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return results.recorded(__spec__.name, argv, args.results, lambda: _measure(args))


def _measure(args: argparse.Namespace) -> int:
    try:
        runs = [configuration(resume, args) for resume in (False, True)]
    except AssertionError as exc:  # the harness's word for an appliance that never came up
        print(f"fault_load: {exc}", file=sys.stderr)
        return 2
    print(side_by_side(runs))
    if args.json is not None:
        args.json.write_text(json.dumps([_tallies(run) for run in runs], indent=1))
    return 0


def _tallies(run: Run) -> dict[str, Any]:
    def tally(t: Any) -> dict[str, Any]:
        return {"requests": t.requests, "failures": dict(t.failures), "seams": dict(t.seams),
                "ttft_s": t.ttft_s, "total_s": t.total_s}

    return {"name": run.name, "faults": [vars(s) for s in run.strikes],
            "per_fault": [tally(t) for t in run.per_fault], "met_none": tally(run.met_none),
            "total": tally(run.total)}


if __name__ == "__main__":
    sys.exit(main())
