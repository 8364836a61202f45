"""The prober against a real HTTP server on loopback or a Unix socket: answers, failures that never raise,
a kept-alive connection the worker closed while idle, which is sent again, not a failed probe, and
the worker's /metrics read only for the series progress needs."""

from __future__ import annotations

import asyncio
import gc
import http.server
import shutil
import socketserver
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import pytest
import uvloop

from appliance.fences.vllm import Metric
from load.kit.net import free_port
from supervisor.engine.probe import HttpProber, _settle

pytestmark = pytest.mark.anyio

METRICS = b'vllm:num_requests_running{engine="0"} 1.0\nvllm:generation_tokens_total 42.0\n'
# What else a worker's page holds: histogram buckets, most of its ~65 KB.
BUCKETS = b"".join(b'vllm:e2e_request_latency_seconds_bucket{le="%d"} 7.0\n' % n
                   for n in range(200))


def metrics_page(target: str) -> bytes | None:
    """As vLLM serves it: the whole page at /metrics, and at /metrics/ (prometheus_client's
    own app) only the samples named by `name[]`, if any are."""
    split = urlsplit(target)
    if split.path not in ("/metrics", "/metrics/"):
        return None
    page = METRICS + BUCKETS
    names = parse_qs(split.query).get("name[]") if split.path == "/metrics/" else None
    if names is None:
        return page
    return b"".join(line + b"\n" for line in page.splitlines()
                    if line.split(b"{")[0].split(b" ")[0].decode() in names)


class Worker(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn
    drop_idle = False  # close each connection after answering, without saying so
    chunked = False  # answer in chunked encoding, a few bytes at a time
    stall_s = 0.0  # wait this long before answering
    connections = 0
    on_request: Callable[[], None] | None = None  # called as each request arrives
    answered: list[tuple[str, int]] = []  # (path, body length) of each GET answered

    def setup(self) -> None:
        super().setup()
        type(self).connections += 1

    def do_GET(self) -> None:
        if Worker.on_request is not None:
            Worker.on_request()
        body = b"" if self.path == "/health" else metrics_page(self.path)
        Worker.answered.append((self.path, len(body or b"")))
        self._answer(200 if body is not None else 404, body or b"")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(200, b'{"choices": [{"text": "!"}]}')

    def _answer(self, status: int, body: bytes) -> None:
        time.sleep(self.stall_s)
        self.send_response(status)
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(body), 7):
                piece = body[start:start + 7]
                self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        self.close_connection = self.drop_idle

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def worker() -> Iterator[tuple[http.server.ThreadingHTTPServer, str]]:
    Worker.connections, Worker.drop_idle, Worker.chunked, Worker.stall_s = 0, False, False, 0.0
    Worker.answered = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Worker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_probes_read_the_worker_over_one_kept_alive_connection(worker) -> None:  # type: ignore[no-untyped-def]
    _, url = worker
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        assert await prober.healthy()
        stats = await prober.engine_stats()
        assert stats is not None and stats.running == 1.0 and stats.generation_tokens == 42.0
        assert await prober.canary(5)
        assert not await prober.serving()  # /v1/models is a 404 here
        assert Worker.connections == 1
    finally:
        await prober.aclose()


async def test_a_connection_the_worker_closed_while_idle_is_not_a_failed_probe(worker) -> None:  # type: ignore[no-untyped-def]
    _, url = worker
    Worker.drop_idle = True
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        for _ in range(5):
            assert await prober.healthy()
        assert Worker.connections == 5
    finally:
        await prober.aclose()


async def test_a_worker_that_is_gone_fails_the_probe_without_raising(worker) -> None:  # type: ignore[no-untyped-def]
    server, url = worker
    Worker.drop_idle = True  # a dead worker leaves no connection open
    prober = HttpProber(url, "m", timeout_s=2)
    try:
        assert await prober.healthy()
        server.shutdown()
        server.server_close()
        assert not await prober.healthy()
        assert await prober.engine_stats() is None
        assert not await prober.canary(1)
    finally:
        await prober.aclose()


async def test_a_chunked_answer_in_small_pieces_is_read_whole(worker) -> None:  # type: ignore[no-untyped-def]
    _, url = worker
    Worker.chunked = True
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        stats = await prober.engine_stats()
        assert stats is not None and stats.running == 1.0 and stats.generation_tokens == 42.0
        assert await prober.healthy() and Worker.connections == 1
    finally:
        await prober.aclose()


async def test_a_worker_slower_than_the_timeout_fails_the_probe_and_its_connection_goes(  # type: ignore[no-untyped-def]
        worker) -> None:
    _, url = worker
    prober = HttpProber(url, "m", timeout_s=0.3)
    try:
        Worker.stall_s = 1.0
        assert not await prober.healthy()
        Worker.stall_s = 0.0
        assert await prober.healthy()  # on a fresh connection: the late answer is not read
        assert Worker.connections == 2
    finally:
        await prober.aclose()


class UnixWorkerServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


async def test_probes_reach_a_worker_on_its_unix_socket(tmp_path: Path) -> None:
    Worker.connections, Worker.drop_idle, Worker.chunked, Worker.stall_s = 0, False, False, 0.0
    path = Path(tempfile.mkdtemp(prefix="ca-probe-")) / "worker.sock"
    server = UnixWorkerServer(str(path), Worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prober = HttpProber(f"http+unix://{quote(str(path), safe='')}", "m", timeout_s=5)
    try:
        assert await prober.healthy()
        stats = await prober.engine_stats()
        assert stats is not None and stats.generation_tokens == 42.0
        assert Worker.connections == 1
    finally:
        await prober.aclose()
        server.shutdown()
        server.server_close()
        shutil.rmtree(path.parent)


async def test_a_probe_reaches_the_worker_while_the_calling_loop_is_blocked(worker) -> None:  # type: ignore[no-untyped-def]
    """The probes' isolation: their exchange runs on their own thread and loop, so a serving
    loop stalled by request load cannot keep a probe from the worker."""
    _, url = worker
    asked = threading.Event()
    Worker.on_request = asked.set
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        probe = asyncio.create_task(prober.healthy())
        await asyncio.sleep(0)  # the probe is handed to its thread...
        assert asked.wait(timeout=30)  # ...and reaches the worker while this loop is blocked
        assert await probe
    finally:
        Worker.on_request = None
        await prober.aclose()


async def test_progress_reads_only_its_series_not_the_whole_metrics_page(worker) -> None:  # type: ignore[no-untyped-def]
    """The worker renders, and the appliance reads and parses, a few hundred bytes each second
    of work instead of the whole page (~65 KB on vLLM 0.32)."""
    _, url = worker
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        stats = await prober.engine_stats()
        assert stats is not None and stats.running == 1.0 and stats.generation_tokens == 42.0
        [(path, length)] = Worker.answered
        split = urlsplit(path)
        assert split.path == "/metrics/"
        assert sorted(parse_qs(split.query)["name[]"]) == sorted(Metric)
        assert length == len(METRICS)  # no bucket: nothing beyond what was asked for
    finally:
        await prober.aclose()


async def test_the_probes_loop_is_uvloops(worker) -> None:  # type: ignore[no-untyped-def]
    """Most of a probe's CPU is its thread waking and its loop turning: uvloop's turn costs a
    fraction of asyncio's own (the serving loop is uvloop's too, supervisor/main.py)."""
    _, url = worker
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        assert await prober.healthy()
        assert isinstance(prober._loop, uvloop.Loop)
    finally:
        await prober.aclose()


async def test_a_caller_cancelled_mid_probe_cancels_the_exchange_on_the_probe_thread(worker) -> None:  # type: ignore[no-untyped-def]
    """The hop back to the caller is one call; cancelling the caller still reaches across: the
    probe loop's task ends, and its connection is not kept (its answer was never read)."""
    _, url = worker
    asked = threading.Event()
    Worker.on_request, Worker.stall_s = asked.set, 0.5
    prober = HttpProber(url, "m", timeout_s=5)
    try:
        probe = asyncio.create_task(prober.healthy())
        assert await asyncio.to_thread(asked.wait, 30)
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        ended = asyncio.run_coroutine_threadsafe(_outcomes_of_the_others(), prober._loop)
        outcomes = await asyncio.wait_for(asyncio.wrap_future(ended), 10)
        assert not [o for o in outcomes if isinstance(o, tuple)]  # none ran on to its answer
        Worker.on_request, Worker.stall_s = None, 0.0
        assert await prober.healthy()
        assert Worker.connections == 2  # the cancelled exchange's connection was closed
    finally:
        Worker.on_request = None
        await prober.aclose()


async def _outcomes_of_the_others() -> list[object]:
    """On the probe loop: how every other task still there ends (an exchange, with its answer)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    return list(await asyncio.gather(*others, return_exceptions=True))


async def test_an_exchange_that_failed_after_its_caller_left_is_not_logged_as_unread() -> None:
    """A probe's task can end with an error just as its caller is cancelled: the hand-back
    still reads that error, else asyncio logs 'Task exception was never retrieved'."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        async def fails() -> None:
            raise RuntimeError("the worker went away")

        task = loop.create_task(fails())
        await asyncio.wait([task])
        outcome: asyncio.Future[None] = loop.create_future()
        outcome.cancel()  # the caller left first
        _settle(outcome, task)
        del task
        gc.collect()
        assert reported == []
    finally:
        loop.set_exception_handler(previous)
