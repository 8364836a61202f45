"""A synthetic vLLM-shaped OpenAI server: no model, tokens as fast as asked (bench and tests).

Run: python -m load.kit.synthetic_worker --port 8100 [--tokens 64] [--token-delay 0]
It answers /health, /v1/models, /tokenize (4 characters a token), /metrics (the running
count, as vLLM names it, and how often /tokenize and generation were called) and
/v1/chat/completions, /v1/completions, streamed or not; and, in their protocols' shapes,
/v1/responses (+ /render, retrieve, cancel), /v1/messages (+ /count_tokens),
/v1/chat/completions/batch, /detokenize and /version. A completion's id is made from the
X-Request-Id it was sent, as vLLM makes it.

Options that make it behave like the real worker where tests need it to (the markers and
vLLM's answers are in load/kit/vllm_shapes.py):
  --faults       a prompt or message holding REJECT_MARKER, or a `prompt_embeds` (vLLM refuses it
                 unless started with --enable-prompt-embeds), gets vLLM's own 400 shape (an integer
                 code, type "BadRequestError"); one holding CRASH_MARKER, or a `structured_outputs`
                 that is not an object (vLLM 0.32 crashes on `true`), gets vLLM's 500 and then the
                 connection is dropped without notice, a moment later (CRASH_CLOSE_DELAY_S), as a
                 crashing worker drops it: a client that reuses it at once loses its request.
  --die-on TEXT  a generation request holding TEXT kills the whole worker (SIGKILL to itself),
                 as an input that crashes the engine does (the quarantine's tests).
  --sleep-mode   vLLM's sleep-mode routes (load/kit/synthetic_sleep.py), a step failing on ask.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import uvicorn

from load.kit import vllm_shapes as shapes
from load.kit.synthetic_sleep import SleepRoutes

Scope = dict[str, Any]
MAX_MODEL_LEN = 2048
CRASH_CLOSE_DELAY_S = 0.2


class _Crash(Exception):
    """Raised after a 500 is sent: uvicorn then drops the connection, as a crashing worker does."""
FINGERPRINT = "vllm-synthetic-0000"


class SyntheticWorker:
    def __init__(self, tokens: int, token_delay_s: float, model: str, *, faults: bool = False,
                 root: str | None = None, die_on: str | None = None,
                 sleep: SleepRoutes | None = None) -> None:
        self.tokens = tokens
        self.die_on = die_on
        self.delay = token_delay_s
        self.model = model
        self.faults = faults
        self.root = root or f"/models/{model}"  # vLLM shows the model's directory here
        self.max_model_len = MAX_MODEL_LEN  # its window, as vLLM's --max-model-len
        self.running = 0
        self.tokenized = 0
        self.counted: list[dict[str, Any]] = []  # /tokenize payloads, in order
        self.generated = 0
        self.generated_tokens = 0  # as vLLM's counter: moves with every token, streamed or not
        self.word = "tok "  # each streamed token's text; `{n}` in it: the token's number
        self._dropping: set[object] = set()  # connections (client addresses) about to be dropped
        self.received: list[tuple[str, dict[str, Any]]] = []  # (path, body) of generations
        self.stored: dict[str, dict[str, Any]] = {}  # responses by id, as vLLM's store
        self.headers: list[dict[str, str]] = []  # of the generations, in order
        self.sleep = sleep  # vLLM's sleep-mode routes, as under VLLM_SERVER_DEV_MODE=1

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope.get("client") in self._dropping:
            await asyncio.sleep(2 * CRASH_CLOSE_DELAY_S)  # lost with the connection, unanswered
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path in _GENERATIONS:
            request = json.loads(body or b"{}")
            self.received.append((path, request))
            self.headers.append({k.decode("latin-1"): v.decode("latin-1")
                                 for k, v in scope["headers"]})
            await self._complete(scope, receive, send, request)
        elif path.startswith("/v1/responses/") or path in _SMALL:
            await self._small(path, scope, json.loads(body or b"{}"), send)
        elif self.sleep is not None and (slept := self.sleep.answer(scope)) is not None:
            await _raw(send, slept[0], slept[1], slept[2])
        elif path == "/health":
            await _json(send, 200, {})
        elif path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": self.model,
                                                               "object": "model",
                                                               "root": self.root, "parent": None,
                                                               "max_model_len": self.max_model_len}]})
        elif path == "/tokenize":
            self.tokenized += 1
            self.counted.append(json.loads(body or b"{}"))
            count = _prompt_tokens(self.counted[-1])
            await _json(send, 200, {"count": count, "max_model_len": self.max_model_len,
                                    "tokens": [1000 + i for i in range(count)],
                                    "token_strs": None})
        elif path in ("/metrics", "/metrics/"):
            text = (f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
                    f'vllm:generation_tokens_total{{model_name="{self.model}"}} '
                    f"{self.generated_tokens}\n"
                    f"synthetic_tokenize_calls_total {self.tokenized}\n"
                    f"synthetic_generate_calls_total {self.generated}\n")
            # As vLLM's mount of prometheus_client's app at /metrics/: only the series named.
            named = parse_qs(scope.get("query_string", b"").decode()).get("name[]")
            if named:
                text = "".join(line + "\n" for line in text.splitlines()
                               if line.split("{")[0].split(" ")[0] in named)
            await _raw(send, 200, text.encode(), b"text/plain")
        else:
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found",
                                              "param": None, "code": None}})

    async def _complete(self, scope: Scope, receive: Any, send: Any,
                        request: dict[str, Any]) -> None:
        self.generated += 1
        if self.die_on is not None and self.die_on in json.dumps(request):
            os.kill(os.getpid(), signal.SIGKILL)
        fault = shapes.vllm_fault(request) if self.faults else None
        if fault is not None:
            await _json(send, fault["error"]["code"], fault)
            if fault["error"]["code"] == 500:
                self._dropping.add(scope.get("client"))
                await asyncio.sleep(CRASH_CLOSE_DELAY_S)
                self._dropping.discard(scope.get("client"))
                raise _Crash("synthetic worker crash after its 500")
            return
        path = scope["path"]
        await _until_disconnect(receive, self._generate(request, path, send,
                                                        _completion_id(scope, path)))

    async def _small(self, path: str, scope: Scope, request: dict[str, Any], send: Any) -> None:
        """The routes that generate nothing: renders, counts, stored responses, the version."""
        if path == "/v1/responses/render":  # as vLLM: it checks the budget as generating does
            if (request.get("max_output_tokens") or 0) > self.max_model_len:
                await _json(send, 400, {"error": {"message": "max_output_tokens too large"}})
            else:
                await _json(send, 200, {"token_ids": [1] * _prompt_tokens(request)})
        elif path == "/v1/messages/count_tokens":
            await _json(send, 200, {"input_tokens": _prompt_tokens(request)})
        elif path == "/detokenize":
            await _json(send, 200, {"prompt": " ".join(map(str, request.get("tokens", [])))})
        elif path == "/version":
            await _json(send, 200, {"version": "0.32.0-synthetic"})
        else:
            response_id = path.removeprefix("/v1/responses/").removesuffix("/cancel")
            stored = self.stored.get(response_id)
            if stored is None:
                await _json(send, 404, {"error": {
                    "message": f"Response with id '{response_id}' not found.",
                    "type": "invalid_request_error", "param": "response_id", "code": 404}})
            elif path.endswith("/cancel"):
                await _json(send, 400, {"error": {
                    "message": "Cannot cancel a synchronous response.",
                    "type": "invalid_request_error", "param": "response_id", "code": 400}})
            else:
                await _json(send, 200, stored)

    async def _generate(self, request: dict[str, Any], path: str, send: Any,
                        completion_id: str) -> None:
        chat = path.endswith("chat/completions")
        budget = (request.get("max_completion_tokens") or request.get("max_tokens")
                  or request.get("max_output_tokens"))
        prompt = _prompt_tokens(request)
        # As vLLM 0.32: a budget above the window is refused; one the room cannot hold is
        # silently cut to the room.
        window = self.max_model_len
        if isinstance(budget, int) and (budget > window or prompt >= window):
            await _json(send, 400, {"error": {
                "message": f"max_tokens={budget} cannot be greater than "
                           f"max_model_len={window}. Please request fewer output tokens.",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}})
            return
        if isinstance(budget, int):
            budget = min(budget, window - prompt)
        count = min(self.tokens, budget if isinstance(budget, int) and budget > 0 else self.tokens)
        self.running += 1
        try:
            if not request.get("stream"):
                for _ in range(count):  # tokens are made one at a time, as a real engine does
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    self.generated_tokens += 1
            if path in _PROTOCOLS:
                await _PROTOCOLS[path](self, request, count, send)
            elif request.get("stream"):
                options = request.get("stream_options") or {}
                usage = (prompt, count) if options.get("include_usage") else None
                ids = prompt if request.get("return_token_ids") else None
                await self._stream(send, chat, count, completion_id, usage, ids)
            else:
                text = "tok " * count
                choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": "length"} if chat else
                          {"index": 0, "text": text, "finish_reason": "length"})
                await _json(send, 200, {"id": completion_id,
                                        "object": "chat.completion" if chat else "text_completion",
                                        "created": int(time.time()), "model": self.model,
                                        "choices": [choice],
                                        "system_fingerprint": FINGERPRINT,
                                        "usage": {"prompt_tokens": prompt,
                                                  "completion_tokens": count,
                                                  "total_tokens": count + prompt}})
        finally:
            self.running -= 1

    async def _stream(self, send: Any, chat: bool, count: int, completion_id: str,
                      usage: tuple[int, int] | None, ids: int | None = None) -> None:
        """As vLLM 0.32 writes it (tests/unit/support/test_synthetic_upstream.py compares the
        two): a chat stream opens with the role's event, which carries the prompt's fields
        after its choices (its ids where token ids were asked, `ids` being the prompt's
        length); a completions stream carries them in its first choice. The last token's event
        says why it finished and carries the fingerprint, unless usage was asked, which then
        comes in an event of its own that carries it. Every other token event ends with its
        choices (appliance/fences/vllm.py, TOKEN_EVENT_END), so that the appliance's one-pass
        cut of the ids (appliance/recovery/stream.py) is measured on the bytes it meets."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        head = {"id": completion_id, "object": "chat.completion.chunk" if chat else
                "text_completion", "created": int(time.time()), "model": self.model}
        prompt_ids = [1] * ids if ids is not None else None
        if chat:
            await self._event(send, head | {"choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}], "prompt_token_ids": prompt_ids, "prompt_text": None})
        for i in range(count):
            finish = "length" if i == count - 1 else None
            token_ids = [1000 + i] if ids is not None else None
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": self.text(i)}, "logprobs": None,
                 "finish_reason": finish} if chat else
                {"index": 0, "text": self.text(i), "logprobs": None, "finish_reason": finish,
                 "stop_reason": None, "prompt_token_ids": prompt_ids if i == 0 else None})
            if chat and finish:
                choice["stop_reason"] = None
            choice["token_ids"] = token_ids
            chunk = head | {"choices": [choice]}
            self.generated_tokens += 1
            if finish and usage is None:
                chunk["system_fingerprint"] = FINGERPRINT
            await self._event(send, chunk)
            if self.delay:
                await asyncio.sleep(self.delay)
        if usage is not None:
            prompt, completion = usage
            await self._event(send, head | {"choices": [],
                                            "usage": {"prompt_tokens": prompt,
                                                      "total_tokens": prompt + completion,
                                                      "completion_tokens": completion},
                                            "system_fingerprint": FINGERPRINT})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    def text(self, i: int) -> str:
        """Token `i`'s text: `word`, its `{n}` replaced by the token's number (tests that
        check order and completeness read it back; vLLM's events carry no number)."""
        return self.word.replace("{n}", str(i))

    @staticmethod
    async def _event(send: Any, chunk: dict[str, Any]) -> None:
        body = b"data: " + _compact(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})

    async def _responses(self, request: dict[str, Any], count: int, send: Any) -> None:
        previous = request.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            await _json(send, 404, {"error": {
                "message": f"Response with id '{previous}' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}})
            return
        response_id = request.get("request_id") or "resp_synthetic"
        text = "".join(self.text(i) for i in range(count))
        budget = request.get("max_output_tokens")
        answer = shapes.response(response_id, self.model, request, text,
                                 _prompt_tokens(request), count, cut=count == budget)
        if request.get("store", True):
            self.stored[response_id] = answer
        if not request.get("stream"):
            await _json(send, 200, answer)
            return
        await self._events(send, shapes.response_events(answer, [self.text(i)
                                                                 for i in range(count)]))

    async def _messages(self, request: dict[str, Any], count: int, send: Any) -> None:
        usage = {"input_tokens": _prompt_tokens(request), "output_tokens": count}
        text = "".join(self.text(i) for i in range(count))
        message = {"id": "msg_synthetic", "type": "message", "role": "assistant",
                   "content": [{"type": "text", "text": text}], "model": self.model,
                   "stop_reason": "max_tokens", "stop_sequence": None, "usage": usage}
        if not request.get("stream"):
            await _json(send, 200, message)
            return
        await self._events(send, shapes.message_events(message, [self.text(i)
                                                                for i in range(count)]))

    async def _batch(self, request: dict[str, Any], count: int, send: Any) -> None:
        choices = [{"index": i, "message": {"role": "assistant", "content": "tok " * count},
                    "finish_reason": "length"} for i in range(len(request["messages"]))]
        await _json(send, 200, {"id": "chatcmpl-batch", "object": "chat.completion",
                                "model": self.model, "choices": choices})

    async def _events(self, send: Any, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Named SSE events (the Responses and Anthropic protocols), paced as tokens are."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for name, data in events:
            self.generated_tokens += name in _TOKEN_EVENTS
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"event: {name}\ndata: {_compact(data)}\n\n".encode()})
            if self.delay:
                await asyncio.sleep(self.delay)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


Protocol = Callable[[SyntheticWorker, dict[str, Any], int, Any], Any]
_PROTOCOLS: dict[str, Protocol] = {"/v1/responses": SyntheticWorker._responses,
                                   "/v1/messages": SyntheticWorker._messages,
                                   "/v1/chat/completions/batch": SyntheticWorker._batch}
_GENERATIONS = frozenset({"/v1/chat/completions", "/v1/completions", *_PROTOCOLS})
_TOKEN_EVENTS = frozenset({"response.output_text.delta", "content_block_delta"})
_SMALL = frozenset({"/v1/messages/count_tokens", "/detokenize", "/version"})


def _prompt_tokens(request: dict[str, Any]) -> int:
    """Four characters a token: a stand-in for the worker's own tokenizer. A batch of prompts
    (strings or token ids) counts as its longest, as vLLM checks each prompt of it."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return max(_prompt_tokens({"prompt": p}) for p in prompt)
    if isinstance(prompt, list):
        return max(1, len(prompt))
    text = (prompt or request.get("input")
            or json.dumps([request.get("system"), request.get("messages", "")]
                          if request.get("system") else request.get("messages", "")))
    return max(1, len(str(text)) // 4)


def _compact(data: dict[str, Any]) -> str:
    """JSON as vLLM writes it (pydantic's model_dump_json): no spaces."""
    return json.dumps(data, separators=(",", ":"))


def _completion_id(scope: Scope, path: str) -> str:
    """vLLM's completion id: the X-Request-Id it was sent (latin-1, as Starlette reads it)."""
    sent = dict(scope.get("headers", [])).get(b"x-request-id")
    base = sent.decode("latin-1") if sent else uuid.uuid4().hex
    return f"{'chatcmpl' if path.endswith('chat/completions') else 'cmpl'}-{base}"


async def _until_disconnect(receive: Any, work: Any) -> None:
    """Run `work`, abandoning it when the client disconnects, as vLLM aborts a request."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await task
    except asyncio.CancelledError:
        if not watcher.done():
            raise
    finally:
        watcher.cancel()


async def _json(send: Any, status: int, payload: object) -> None:
    await _raw(send, status, json.dumps(payload).encode(), b"application/json")


async def _raw(send: Any, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--model", default="synthetic")
    parser.add_argument("--faults", action="store_true", help="vLLM's 400s and crashes (see above)")
    parser.add_argument("--die-on", help="a generation request holding this text kills the "
                                         "worker (SIGKILL), as a poison input crashes an engine")
    parser.add_argument("--sleep-mode", choices=("on", "fail-sleep", "fail-wake-up"),
                        help="serve vLLM's /sleep, /wake_up and /is_sleeping (load/kit/"
                             "synthetic_sleep.py); fail-*: that step answers vLLM's 500")
    parser.add_argument("--boot-s", type=float, default=0.0,
                        help="seconds before it listens, as a real engine loads its model")
    parser.add_argument("--uds", help="listen on this Unix socket too, as vLLM's --uds (the "
                                      "appliance's way in; the port stays for direct runs)")
    args = parser.parse_args()
    time.sleep(args.boot_s)
    sleep = None if args.sleep_mode is None else SleepRoutes(
        {"on": None, "fail-sleep": "sleep", "fail-wake-up": "wake_up"}[args.sleep_mode])
    app = SyntheticWorker(args.tokens, args.token_delay, args.model, faults=args.faults,
                          die_on=args.die_on, sleep=sleep)
    if args.uds is None:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
        return
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(args.uds)
    tcp = socket.create_server((args.host, args.port))
    # Inherited by each accepted connection: uvloop sets it only on sockets it bound itself.
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sockets = [tcp, unix]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(server.serve(sockets=sockets))


if __name__ == "__main__":
    main()
