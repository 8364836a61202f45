"""A synthetic vLLM-shaped OpenAI server: no model, tokens as fast as asked (bench and tests).

Run: python -m tests.support.synthetic_upstream --port 8100 [--tokens 64] [--token-delay 0]
It answers /health, /v1/models, /tokenize (4 characters a token), /metrics (the running
count, as vLLM names it) and /v1/chat/completions, /v1/completions, streamed or not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import uvicorn

Scope = dict[str, Any]
MAX_MODEL_LEN = 2048


class Upstream:
    def __init__(self, tokens: int, token_delay_s: float, model: str) -> None:
        self.tokens = tokens
        self.delay = token_delay_s
        self.model = model
        self.running = 0
        self.tokenized = 0
        self.counted: list[dict[str, Any]] = []  # /tokenize payloads, in order

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            await _until_disconnect(receive, self._generate(json.loads(body or b"{}"), path, send))
        elif path == "/health":
            await _json(send, 200, {})
        elif path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": self.model,
                                                               "object": "model",
                                                               "max_model_len": MAX_MODEL_LEN}]})
        elif path == "/tokenize":
            self.tokenized += 1
            self.counted.append(json.loads(body or b"{}"))
            count = _prompt_tokens(self.counted[-1])
            await _json(send, 200, {"count": count, "max_model_len": MAX_MODEL_LEN, "tokens": []})
        elif path == "/metrics":
            text = f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
            await _raw(send, 200, text.encode(), b"text/plain")
        else:
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found",
                                              "param": None, "code": None}})

    async def _generate(self, request: dict[str, Any], path: str, send: Any) -> None:
        chat = path.endswith("chat/completions")
        budget = request.get("max_completion_tokens") or request.get("max_tokens")
        prompt = _prompt_tokens(request)
        # As vLLM 0.32: a budget above the window is refused; one the room cannot hold is
        # silently cut to the room.
        if isinstance(budget, int) and (budget > MAX_MODEL_LEN or prompt >= MAX_MODEL_LEN):
            await _json(send, 400, {"error": {
                "message": f"max_tokens={budget} cannot be greater than "
                           f"max_model_len={MAX_MODEL_LEN}. Please request fewer output tokens.",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}})
            return
        if isinstance(budget, int):
            budget = min(budget, MAX_MODEL_LEN - prompt)
        count = min(self.tokens, budget if isinstance(budget, int) and budget > 0 else self.tokens)
        self.running += 1
        try:
            if request.get("stream"):
                await self._stream(send, chat, count)
            else:
                if self.delay:
                    await asyncio.sleep(self.delay * count)
                text = "tok " * count
                choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": "length"} if chat else
                          {"index": 0, "text": text, "finish_reason": "length"})
                await _json(send, 200, {"id": "cmpl-synthetic", "object": "chat.completion",
                                        "created": int(time.time()), "model": self.model,
                                        "choices": [choice],
                                        "usage": {"prompt_tokens": 1, "completion_tokens": count,
                                                  "total_tokens": count + 1}})
        finally:
            self.running -= 1

    async def _stream(self, send: Any, chat: bool, count: int) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(count):
            delta = ({"index": 0, "delta": {"content": "tok "}, "finish_reason": None} if chat
                     else {"index": 0, "text": "tok ", "finish_reason": None})
            chunk = {"id": "cmpl-synthetic", "object": "chat.completion.chunk",
                     "created": 0, "model": self.model, "choices": [delta], "n": i}
            await send({"type": "http.response.body",
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
            if self.delay:
                await asyncio.sleep(self.delay)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


def _prompt_tokens(request: dict[str, Any]) -> int:
    """Four characters a token: a stand-in for the worker's own tokenizer."""
    text = request.get("prompt") or json.dumps(request.get("messages", ""))
    return max(1, len(str(text)) // 4)


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
    args = parser.parse_args()
    app = Upstream(args.tokens, args.token_delay, args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
