"""The relay on its own, over a fake worker client: what a request holds, when it lets go, and
how each outcome is answered (the worker's answer, its refusal, a bug, a lost engine, a client
that left)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from appliance.admission.slots import Admission
from appliance.apis.anthropic.api import MESSAGES
from appliance.apis.openai.api import CHAT
from appliance.apis.tokenizer.api import VERSION
from appliance.core.engine import EngineState
from appliance.core.errors import ApiError, NotFound, engine_lost
from appliance.core.sections import ConstraintSettings, ResumeSettings
from appliance.core.settings import Settings
from appliance.gate.gate import Vetted
from appliance.observe.metrics import RequestMetrics
from appliance.policy.constraints import check_constraints
from appliance.policy.cost_watch import CostWatch
from appliance.proxy.outbound import PassThrough
from appliance.proxy.relay import Relay, RelayDeps
from appliance.recovery.quarantine import Quarantine
from tests.metrics_text import value
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.anyio
ROUTE = "/v1/chat/completions"


class Reply:
    """The worker's answer as the fake client hands it over."""

    def __init__(self, status: int, chunks: list[bytes], on_chunk: Any = None) -> None:
        self.status, self.headers = status, [(b"content-type", b"application/json")]
        self._chunks, self._on_chunk = chunks, on_chunk
        self.complete = False
        self.closed: bool | None = None  # None: never opened

    async def read(self) -> bytes:
        self.complete = True
        return b"".join(self._chunks)

    def forward(self, sink: Any) -> None:
        pass

    def close(self) -> None:
        assert not self.closed, "an exchange is closed once"
        self.closed = True

    async def chunks(self) -> AsyncIterator[bytes]:
        for index, chunk in enumerate(self._chunks):
            if self._on_chunk is not None:
                await self._on_chunk(index)
            self.complete = index == len(self._chunks) - 1
            yield chunk


class Worker:
    """The worker client's `exchange`, answering `reply` and noting what it was sent."""

    def __init__(self, reply: Reply | None = None, fail: Exception | None = None) -> None:
        self.reply, self.fail = reply, fail
        self.sent: list[tuple[str, str, bytes | None]] = []
        self.in_flight_during: list[int] = []
        self.opened: list[Reply] = []
        self.admission: Admission | None = None
        self.asked = []

    async def open(self, method: str, path: str, body: bytes | None,
                   headers: dict[str, str]) -> Reply:
        self.sent.append((method, path, body))
        assert self.admission is not None
        self.in_flight_during.append(self.admission.in_flight)
        reply = self.answer()
        reply.closed = False
        self.opened.append(reply)
        return reply

    def answer(self) -> Reply:
        """This exchange's answer, or the failure it raises."""
        if self.fail is not None:
            raise self.fail
        assert self.reply is not None
        return self.reply

    async def fetch(self, method: str, path: str, body: bytes | None = None,
                    timeout_s: float = 30.0) -> tuple[int, bytes]:
        """A small question to the worker (the relay's diagnosis): `asked` answers it."""
        self.asked.append((path, json.loads(body or b"null")))
        return self.asked_answer

    asked: list[tuple[str, Any]]
    asked_answer: tuple[int, bytes] = (200, b"{}")


class Gate:
    def __init__(self, admission: Admission) -> None:
        self.fitted_holding: list[int] = []
        self._admission = admission

    async def fit_budget(self, vetted: Vetted) -> None:
        self.fitted_holding.append(self._admission.in_flight)


class Client:
    """The ASGI side: what the relay sent, and a disconnect on demand."""

    def __init__(self, admission: Admission) -> None:
        self.messages: list[dict[str, Any]] = []
        self.in_flight_at_end: int | None = None
        self.gone = asyncio.Event()
        self._admission = admission

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.in_flight_at_end = self._admission.in_flight

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.messages if m["type"] == "http.response.start"))

    @property
    def headers(self) -> dict[bytes, bytes]:
        start = next(m for m in self.messages if m["type"] == "http.response.start")
        return dict(start["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.messages if m["type"] == "http.response.body")


class Setup:
    def __init__(self, worker: Worker, resume: bool = False,
                 engine: FakeEngine | None = None, cost_clock: Any = None,
                 isolation_s: float = 5.0) -> None:
        self.engine = engine or FakeEngine("http://127.0.0.1:9")
        self.admission = Admission(1)
        self.metrics = RequestMetrics(CollectorRegistry())
        self.worker = worker
        worker.admission = self.admission
        self.gate = Gate(self.admission)
        self.client = Client(self.admission)
        self.quarantine = Quarantine(ResumeSettings())
        self.quarantine.listeners.append(self.metrics.quarantined)  # as the app wires it
        self.cost = CostWatch(ConstraintSettings(), self.metrics.too_costly,
                              *([cost_clock] if cost_clock is not None else []))
        self.deps = RelayDeps(self.engine, self.admission, self.gate, worker,  # type: ignore[arg-type]
                              self.metrics, ResumeSettings(enabled=resume, max_wait_s=5,
                                                           isolation_s=isolation_s),
                              self.quarantine, self.cost)

    async def run(self, outbound: Any) -> None:
        scope = {"type": "http", "path": ROUTE, "path_template": ROUTE, "headers": []}
        relay = Relay(outbound, self.deps, "rid-1", {})
        try:
            await relay(scope, self.client.receive, self.client.send)  # type: ignore[arg-type]
        finally:
            # Whatever the outcome, every exchange the relay opened is closed by its end.
            assert [reply.closed for reply in self.worker.opened] == [True] * len(self.worker.opened)

    def count(self, name: str, **labels: str) -> float | None:
        from prometheus_client import generate_latest
        return value(generate_latest(self.metrics.registry).decode(), name, **labels)


def chat(stream: bool = False, api: Any = CHAT, **extra: Any) -> Vetted:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}
    # Named by its constraint as the gate names it (test_gate: the gate sets it).
    return Vetted(api, body, json.dumps(body).encode(),
                  constraint=check_constraints(body, ConstraintSettings()))


GRAMMAR = {"structured_outputs": {"grammar": "root ::= s\ns ::= s s s | s s | [a-z ]"}}


class Slow:
    """A clock for the cost watch whose every reading is a second after the last: every token
    the watch sees took a second, far above its norm."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


async def test_a_vetted_request_holds_its_slot_through_the_exchange_and_lets_go_before_the_end(
) -> None:
    setup = Setup(Worker(Reply(200, [b'{"ok": true}'])))
    await setup.run(chat())
    assert setup.gate.fitted_holding == [1]  # the budget is fitted once the slot is held
    assert setup.worker.in_flight_during == [1]
    assert setup.client.in_flight_at_end == 0  # given back before the client saw the end
    assert setup.client.status == 200 and setup.client.body == b'{"ok": true}'
    method, path, body = setup.worker.sent[0]
    assert (method, path) == ("POST", ROUTE) and body == chat().raw
    assert setup.client.headers[b"x-request-id"] == b"rid-1"


async def test_a_stream_owes_its_first_byte_until_it_comes() -> None:
    """What the supervisor's progress watch reads: a request with no byte of its answer yet is
    work the engine owes, whatever its gauges say; once bytes flow, it is not."""
    seen: list[int] = []
    reply = Reply(200, [b"data: {}\n\n", b"data: {}\n\n", b"data: [DONE]\n\n"],
                  on_chunk=lambda _: _note(seen, setup.engine.waiting.unanswered()))
    setup = Setup(Worker(reply))
    await setup.run(chat(stream=True))
    assert seen == [1, 0, 0]


async def _note(seen: list[int], unanswered: int) -> None:
    seen.append(unanswered)


async def test_a_pass_through_takes_no_slot_fits_no_budget_and_sends_no_body() -> None:
    setup = Setup(Worker(Reply(200, [b'{"version": "x"}'])))
    await setup.run(PassThrough(VERSION, "GET", "/version"))
    assert setup.worker.sent == [("GET", "/version", None)]
    assert setup.worker.in_flight_during == [0] and setup.gate.fitted_holding == []
    assert setup.client.status == 200


async def test_a_workers_refusal_is_answered_in_the_routes_shape_and_refined() -> None:
    setup = Setup(Worker(Reply(404, [b'{"error": {"message": "no such thing"}}'])))

    def refine(error: ApiError) -> ApiError:
        return NotFound(f"refined: {error.message}", code="refined")

    await setup.run(PassThrough(VERSION, "GET", "/version", refine=refine))
    assert setup.client.status == 404
    assert json.loads(setup.client.body)["error"]["code"] == "refined"
    anthropic = Setup(Worker(Reply(400, [b'{"error": {"message": "bad"}}'])))
    await anthropic.run(chat(api=MESSAGES))
    assert json.loads(anthropic.client.body) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}


async def test_a_bug_is_a_500_with_the_request_id_logged_once_and_counted_once() -> None:
    setup = Setup(Worker(fail=ZeroDivisionError("boom")))
    with capture_logs() as logs:
        await setup.run(chat())
    assert setup.client.status == 500
    assert json.loads(setup.client.body)["error"]["request_id"] == "rid-1"
    assert [entry["event"] for entry in logs] == ["request.unhandled_exception"]
    assert isinstance(logs[0]["exc_info"], ZeroDivisionError)
    assert setup.count("appliance_unhandled_exceptions_total", route=ROUTE) == 1
    assert setup.count("appliance_rejections_total", reason="internal_error", client="none") == 1
    assert setup.admission.in_flight == 0


async def test_an_engine_lost_mid_stream_ends_the_stream_in_its_protocol_and_frees_the_slot(
) -> None:
    async def lose_after_first(index: int) -> None:
        if index == 1:
            setup.engine.fire_lost()
            await asyncio.sleep(0)  # the cancellation lands here, mid-stream

    setup = Setup(Worker(Reply(200, [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"],
                               lose_after_first)))
    with capture_logs() as logs:
        await setup.run(chat(stream=True))
    assert setup.client.status == 200
    body = setup.client.body
    assert body.startswith(b"data: 1\n\n") and b"data: 2" not in body
    assert b'"code":"engine_lost"' in body and body.endswith(b"data: [DONE]\n\n")
    assert [(e["event"], e.get("streaming")) for e in logs] == [("request.failed", True)]
    assert setup.admission.in_flight == 0 and setup.engine.watchers == 0


async def test_a_client_that_left_gets_nothing_more_and_is_counted_as_a_disconnect() -> None:
    async def leave(index: int) -> None:
        if index == 1:
            setup.client.gone.set()
            await asyncio.Event().wait()  # the worker still streams when the watch hears it

    setup = Setup(Worker(Reply(200, [b"data: 1\n\n", b"data: 2\n\n"], leave)))
    await setup.run(chat(stream=True))
    assert setup.client.body == b"data: 1\n\n"
    assert setup.count("appliance_client_disconnects_total", stream="true") == 1
    assert setup.admission.in_flight == 0



async def killed_twice(setup: Setup, outbound: Any) -> list[str]:
    """Sends `outbound` twice; each time the engine dies with it in flight, and the quarantine
    is told what the forensics see in flight then. Returns those fingerprints."""
    seen: list[str] = []

    async def die(index: int) -> None:
        [entry] = setup.engine.waiting.describe()
        seen.append(entry["fingerprint"])
        setup.quarantine.died(seen[-1:])

    setup.worker.reply = Reply(200, [b'{"ok": true}'], die)
    for _ in range(2):
        await setup.run(outbound)
    return seen


async def test_a_request_in_flight_at_two_engine_deaths_is_refused_in_its_routes_shape() -> None:
    setup = Setup(Worker())
    seen = await killed_twice(setup, chat(stream=True))
    assert len(seen) == 2 and seen[0] == seen[1]  # what the relay checks is what was in flight
    sent = len(setup.worker.sent)
    with capture_logs() as logs:
        await setup.run(chat(stream=True))
    assert len(setup.worker.sent) == sent  # not sent to the worker again
    assert setup.client.messages[-2]["status"] == 422
    error = json.loads(setup.client.messages[-1]["body"])["error"]
    assert error["code"] == "request_quarantined" and seen[0] in error["message"]
    assert ("request.quarantined", seen[0]) in [(e["event"], e.get("fingerprint")) for e in logs]
    assert setup.count("appliance_requests_quarantined_total") == 1
    assert setup.admission.in_flight == 0 and len(setup.engine.waiting) == 0
    other = {"messages": [{"role": "user", "content": "something else"}]}
    await setup.run(Vetted(CHAT, other, json.dumps(other).encode()))
    assert setup.client.messages[-2]["status"] == 200  # another body, another fingerprint


async def test_a_quarantined_anthropic_request_gets_anthropics_error_shape() -> None:
    setup = Setup(Worker())
    assert len(await killed_twice(setup, chat(stream=True, api=MESSAGES))) == 2
    await setup.run(chat(stream=True, api=MESSAGES))
    assert setup.client.messages[-2]["status"] == 422
    body = json.loads(setup.client.messages[-1]["body"])
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


# --- outliving an engine fault (resume on) -------------------------------------------------


class Broken(Reply):
    """An answer whose connection breaks after `good` chunks, as a killed worker's does."""

    def __init__(self, chunks: list[bytes], good: int) -> None:
        super().__init__(200, chunks)
        self._good = good
        self.engine: FakeEngine | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks[:self._good]:
            yield chunk
        if self.engine is not None:
            restart(self.engine)
        raise engine_lost(1)

    def abort(self) -> None:
        pass


class Workers(Worker):
    """One answer (or failure) per exchange, in order, as successive workers give them."""

    def __init__(self, engine: FakeEngine, *answers: Reply | Exception) -> None:
        super().__init__()
        self.answers, self.engine = list(answers), engine

    def answer(self) -> Reply:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            restart(self.engine)
            raise answer
        if isinstance(answer, Broken):
            answer.engine = self.engine
        return answer


def restart(engine: FakeEngine) -> None:
    """The worker dies (its health probe fails at once), the supervisor declares it lost, then
    a new one serves."""
    loop = asyncio.get_running_loop()
    engine.healthy = False
    loop.call_soon(engine.set_state, EngineState.STOPPING)
    loop.call_later(0.02, engine.set_state, EngineState.STARTING, engine.serial + 1)
    loop.call_later(0.04, serves_again, engine)


def serves_again(engine: FakeEngine) -> None:
    engine.healthy = True
    engine.set_state(EngineState.READY)


def resuming(*answers: Reply | Exception) -> Setup:
    engine = FakeEngine("http://127.0.0.1:9")
    return Setup(Workers(engine, *answers), resume=True, engine=engine)


async def test_a_request_the_client_had_nothing_of_is_sent_again_holding_its_slot() -> None:
    setup = resuming(engine_lost(1), Reply(200, [b'{"ok": true}']))
    with capture_logs() as logs:
        await setup.run(chat())
    assert setup.client.status == 200 and setup.client.body == b'{"ok": true}'
    assert [body for _, _, body in setup.worker.sent] == [chat().raw] * 2
    assert setup.worker.in_flight_during == [1, 1]  # the same slot, never given back between
    assert setup.count("appliance_engine_faults_outlived_total", route=ROUTE, how="replayed") == 1
    assert "request.outlived_engine_fault" in [e["event"] for e in logs]
    assert setup.admission.in_flight == 0 and len(setup.engine.waiting) == 0


async def test_a_stream_goes_on_from_its_token_ids_without_a_seam() -> None:
    from tests.unit.appliance.apis.test_openai_resume import CHAT as BODY
    from tests.unit.appliance.apis.test_openai_resume import ROLE, ROLE_IDS, completion_event, content

    asked = {k: v for k, v in BODY.items() if k != "return_token_ids"}  # as the client sent it
    vetted = Vetted(CHAT, asked, json.dumps(asked).encode())
    vetted.record = CHAT.stream_record(vetted.payload, Settings())
    first = Broken([ROLE_IDS, content("Hello", b"19556")], good=2)
    rest = Reply(200, [completion_event(" there", [665], prompt=[1, 9690, 198, 19556]),
                       completion_event("", [2], finish="stop"), b"data: [DONE]\n\n"])
    setup = resuming(first, rest)
    await setup.run(vetted)
    assert setup.client.body == (ROLE + content("Hello", b"19556") + content(" there", b"665")
                                 + content("", b"2", finish="stop") + b"data: [DONE]\n\n")
    (_, path, body) = setup.worker.sent[1]
    assert path == "/v1/completions"
    assert json.loads(body or b"")["prompt"] == [1, 9690, 198, 19556]
    assert setup.count("appliance_engine_faults_outlived_total", route=ROUTE, how="resumed") == 1


async def test_a_stream_without_a_record_ends_as_before_once_the_client_has_some() -> None:
    setup = resuming(Broken([b"data: 1\n\n", b"data: 2\n\n"], good=1))
    await setup.run(chat(stream=True))
    body = setup.client.body
    assert body.startswith(b"data: 1\n\n") and b'"code":"engine_lost"' in body
    assert len(setup.worker.sent) == 1  # never sent again: the client has part of it


async def test_a_client_gone_during_the_wait_is_not_sent_again() -> None:
    setup = resuming(engine_lost(1), Reply(200, [b'{"ok": true}']))
    setup.engine.set_state = lambda *_: setup.client.gone.set()  # type: ignore[method-assign]
    await setup.run(chat())
    assert len(setup.worker.sent) == 1 and setup.client.messages == []
    assert setup.count("appliance_client_disconnects_total", stream="false") == 1


async def test_with_resume_off_a_fault_is_the_clients_error() -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    setup = Setup(Workers(engine, engine_lost(1), Reply(200, [b'{"ok": true}'])), engine=engine)
    await setup.run(chat())
    assert setup.client.status == 503 and len(setup.worker.sent) == 1


async def test_a_too_costly_stream_is_ended_with_request_too_costly_logged_and_counted() -> None:
    """A constrained stream whose tokens come far slower than the norm while another request
    is at the engine: cut where it stands, in the protocol's ending, with the numbers logged."""
    async def pause(index: int) -> None:
        await asyncio.sleep(0)  # where a cancellation lands, as on a real socket

    events = [b"data: %d\n\n" % i for i in range(8)] + [b"data: [DONE]\n\n"]
    setup = Setup(Worker(Reply(200, events, pause)), cost_clock=Slow())
    with capture_logs() as logs, setup.cost.follow(None, lambda: None):  # the other request
        await setup.run(chat(stream=True, **GRAMMAR))
    body = setup.client.body
    assert setup.client.status == 200 and b"data: 3\n\n" in body and b"data: 7" not in body
    assert b'"code":"request_too_costly"' in body and body.endswith(b"data: [DONE]\n\n")
    costly = [entry for entry in logs if entry["event"] == "request.too_costly"]
    assert costly and costly[0]["param"] == "structured_outputs.grammar" and costly[0]["peers"] == 1
    assert costly[0]["step_s"] > costly[0]["bound_s"] and costly[0]["streamed"] >= 3
    assert setup.count("appliance_requests_too_costly_total") == 1
    assert setup.admission.in_flight == 0 and setup.engine.watchers == 0


async def test_a_too_costly_answer_not_yet_begun_is_a_400_in_the_routes_shape() -> None:
    """A non-streamed constrained request, caught through a streamed peer's slow tokens."""
    class Waiting(Reply):
        async def read(self) -> bytes:
            peer_tokens.set()
            await asyncio.Event().wait()  # the answer never comes in time
            return b""

    peer_tokens = asyncio.Event()
    setup = Setup(Worker(Waiting(200, [])), cost_clock=Slow())

    async def peer() -> None:
        with setup.cost.follow(None, lambda: None) as followed:
            await peer_tokens.wait()
            for _ in range(4):
                followed.progressed(b"data: {}\n\n")

    streamed = asyncio.create_task(peer())
    await setup.run(chat(api=MESSAGES, **GRAMMAR))
    await streamed
    assert setup.client.status == 400
    error = json.loads(setup.client.body)["error"]  # Anthropic's shape: no code, a type
    assert error["type"] == "invalid_request_error" and "too costly" in error["message"]
    assert setup.count("appliance_requests_too_costly_total") == 1
    assert setup.admission.in_flight == 0


async def test_a_suspect_is_sent_again_alone_until_its_answer_begins() -> None:
    """In flight at a death: sent to the next worker holding the quarantine's isolation, so
    that no other suspect is in flight beside it if it kills the engine again."""
    locked_at_first_chunk: list[bool] = []

    async def first_chunk(index: int) -> None:
        if index == 0:
            locked_at_first_chunk.append(setup.quarantine.isolation.locked())

    class Dying(Workers):
        async def open(self, method: str, path: str, body: bytes | None,
                       headers: dict[str, str]) -> Reply:
            if len(self.sent) == 0:  # the forensics tell the quarantine what was in flight
                setup.quarantine.died(e["fingerprint"] for e in self.engine.waiting.describe())
            return await super().open(method, path, body, headers)

    engine = FakeEngine("http://127.0.0.1:9")
    setup = Setup(Dying(engine, engine_lost(1), Reply(200, [b"data: 1\n\n", b"data: [DONE]\n\n"],
                                                     first_chunk)), resume=True, engine=engine)
    await setup.run(chat(stream=True))
    assert setup.client.status == 200 and len(setup.worker.sent) == 2
    assert locked_at_first_chunk == [True]
    assert not setup.quarantine.isolation.locked()  # let go once its answer began


async def test_an_engine_lost_while_the_budget_is_counted_is_waited_out_too() -> None:
    """The worker's /tokenize failed with it (never sent yet): counted again on the next one."""
    setup = resuming(Reply(200, [b'{"ok": true}']))
    fits = setup.gate.fitted_holding

    async def fit_once_lost(vetted: Vetted) -> None:
        fits.append(setup.admission.in_flight)
        if len(fits) == 1:
            restart(setup.engine)
            raise engine_lost(1)

    setup.gate.fit_budget = fit_once_lost  # type: ignore[method-assign]
    await setup.run(chat())
    assert setup.client.status == 200 and fits == [1, 1] and len(setup.worker.sent) == 1


async def test_a_suspects_isolation_ends_after_its_window_though_its_answer_has_not_begun(
) -> None:
    """A non-streamed suspect shows no beginning until its end: the window bounds its turn."""
    seen: list[bool] = []

    class Slow(Reply):
        async def read(self) -> bytes:
            await asyncio.sleep(0.3)
            seen.append(setup.quarantine.isolation.locked())
            return await super().read()

    class Dying(Workers):
        def answer(self) -> Reply:
            if not self.sent[1:]:
                setup.quarantine.died(e["fingerprint"] for e in self.engine.waiting.describe())
            return super().answer()

    engine = FakeEngine("http://127.0.0.1:9")
    setup = Setup(Dying(engine, engine_lost(1), Slow(200, [b'{"ok": true}'])), resume=True,
                  engine=engine, isolation_s=0.05)
    await setup.run(chat())
    assert setup.client.status == 200 and seen == [False]


class Preparing(Workers):
    """Successive workers; the next one also answers what a record asks before continuing."""

    def __init__(self, engine: FakeEngine, asked: Any, *answers: Reply | Exception) -> None:
        super().__init__(engine, *answers)
        self.asked = asked

    async def fetch(self, method: str, path: str, body: bytes | None = None,
                    timeout_s: float = 30.0) -> tuple[int, bytes]:
        return await self.asked(path, json.loads(body or b"{}"))  # type: ignore[no-any-return]


async def test_a_responses_stream_goes_on_from_its_text_as_the_same_stream() -> None:
    """Its worker killed: the new one renders the prompt and tokenizes the text sent."""
    from appliance.apis.responses.api import RESPONSES_CREATE
    from tests.unit.appliance.apis.test_responses_resume import STREAM, rest_of
    from tests.unit.appliance.recovery.test_text import BODY, GREEDY, PROMPT
    from tests.unit.appliance.recovery.test_text import Worker as Asked

    vetted = Vetted(RESPONSES_CREATE, dict(BODY), json.dumps(BODY).encode())
    vetted.record = RESPONSES_CREATE.stream_record(vetted.payload, Settings())
    engine = FakeEngine("http://127.0.0.1:9")
    asked = Asked(PROMPT, GREEDY, tokens=[7] * 10)
    setup = Setup(Preparing(engine, asked, Broken(STREAM[:14], good=14),
                            Reply(200, rest_of(10))), resume=True, engine=engine)
    await setup.run(vetted)
    assert setup.client.body == b"".join(STREAM)
    assert [path for path, _ in asked.asked] == ["/v1/responses/render", "/tokenize"]
    (_, path, body) = setup.worker.sent[1]
    assert path == "/v1/completions" and json.loads(body or b"")["prompt"] == PROMPT + [7] * 10
    assert setup.count("appliance_engine_faults_outlived_total", route=ROUTE, how="resumed") == 1


async def test_an_anthropic_streams_word_of_its_dead_engine_is_a_fault_never_relayed() -> None:
    """vLLM's converter writes its own internal_error event (captured) and ends the stream."""
    from tests.unit.appliance.apis.test_anthropic_resume import BODY, PROMPT, STREAM, rest_of
    from tests.unit.appliance.recovery.test_text import GREEDY
    from tests.unit.appliance.recovery.test_text import Worker as Asked

    dead = (b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":'
            b'"2 validation errors for ChatCompletionStreamResponse\\nmodel\\n  Field required '
            b"[type=missing, input_value={'error': {'message': 'En...am': None, 'code': 500}}, "
            b'input_type=dict]"}}\n\n')

    async def dying(index: int) -> None:
        if index == 12:
            restart(engine)

    vetted = Vetted(MESSAGES, dict(BODY), json.dumps(BODY).encode())
    vetted.record = MESSAGES.stream_record(vetted.payload, Settings())
    engine = FakeEngine("http://127.0.0.1:9")
    first = Reply(200, [*STREAM[:12], dead], dying)
    setup = Setup(Preparing(engine, Asked(PROMPT, GREEDY, tokens=[7] * 10), first,
                            Reply(200, rest_of(10))), resume=True, engine=engine)
    await setup.run(vetted)
    assert setup.client.body == b"".join(STREAM)  # no error event, no seam


# --- a fault is the supervisor's fact, never a guess from bytes ----------------------------

DEATH = (b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) '
         b'for the root cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n')
QUOTED = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class Probed(FakeEngine):
    """An engine that notes, at each question whether the worker still serves, what the ledger
    counted as work the engine owes."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.owed_when_asked: list[tuple[int, int]] = []

    async def answers(self, serial: int) -> bool:
        self.owed_when_asked.append((len(self.waiting), self.waiting.unanswered()))
        return await super().answers(serial)


@pytest.mark.parametrize("resume", [True, False])
async def test_the_deaths_words_a_client_put_in_a_stream_are_relayed_as_they_came(
        resume: bool) -> None:
    """Echoed text (a prompt, instructions, a stop string) that quotes vLLM's death is a token
    like any other: no fault, no question to the supervisor, nothing sent again."""
    from appliance.apis.responses.api import RESPONSES_CREATE
    token = json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": QUOTED}, "finish_reason": None}]})
    chat_chunks = [f"data: {token}\n\n".encode(), b"data: [DONE]\n\n"]
    created = json.dumps({"type": "response.created", "sequence_number": 0,
                          "response": {"id": "resp_1", "instructions": QUOTED}})
    responses_chunks = [f"event: response.created\ndata: {created}\n\n".encode()]
    quoted_error = json.dumps({"error": {"message": QUOTED, "code": 500}, "echo": "client"})
    for outbound, chunks in ((chat(stream=True), chat_chunks),
                             (chat(stream=True, api=RESPONSES_CREATE, input="x"), responses_chunks),
                             (chat(stream=True), [f"data: {quoted_error}\n\n".encode()])):
        engine = Probed()
        setup = Setup(Worker(Reply(200, chunks)), resume=resume, engine=engine)
        await setup.run(outbound)
        assert setup.client.body == b"".join(chunks)
        assert engine.owed_when_asked == [] and len(setup.worker.sent) == 1


async def test_a_stream_a_serving_worker_cut_is_that_requests_failure_and_never_owed() -> None:
    """A dropped connection from a worker that still answers its probe: the request fails at
    once in the route's shape (not after resume.confirm_s), is never sent again, and while the
    supervisor is asked it is not work the engine owes (no hang verdict can come of it)."""
    engine = Probed()
    setup = Setup(Worker(Broken([b'data: {"choices": []}\n\n'], good=1)), resume=True,
                  engine=engine)
    await setup.run(chat(stream=True))
    assert b'"code":"request_failed"' in setup.client.body
    assert setup.client.body.endswith(b"data: [DONE]\n\n")
    assert engine.owed_when_asked == [(0, 0)] and len(setup.worker.sent) == 1
    assert len(engine.waiting) == 0 and engine.waiting.describe() == []  # no victim of a death


async def test_a_responses_stream_a_serving_worker_cut_ends_with_the_workers_refusal() -> None:
    """vLLM cuts a Responses stream it refuses after its first events (a logit_bias outside
    the vocabulary): the relay reads the refusal from the same body asked not streamed for one
    token, and ends the stream with it as a 400's error event."""
    from appliance.apis.responses.api import RESPONSES_CREATE
    created = b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    worker = Worker(Broken([created], good=1))
    refusal = {"error": {"message": "token_id(s) [-1] in logit_bias contain out-of-vocab token "
                         "ids.", "type": "BadRequestError", "param": "logit_bias", "code": 400}}
    worker.asked_answer = (400, json.dumps(refusal).encode())
    setup = Setup(worker, resume=True)
    await setup.run(chat(stream=True, api=RESPONSES_CREATE, input="x", logit_bias={"-1": 1},
                         max_output_tokens=50, request_id="resp_1"))
    body = setup.client.body
    assert body.startswith(created) and b"event: error" in body and b"response.failed" in body
    error = json.loads(body.split(b"event: error\ndata: ")[1].split(b"\n\n")[0])
    assert error["code"] == "invalid_request" and error["param"] == "logit_bias"
    (path, asked), = worker.asked
    assert path == "/v1/responses" and asked["stream"] is False
    assert asked["max_output_tokens"] == 1 and asked["store"] is False
    assert "request_id" not in asked and len(worker.sent) == 1


async def test_vllms_death_event_is_a_hint_the_supervisor_confirms() -> None:
    """The death's own event, where vLLM writes it: sent again once the worker is lost; the
    same event from a worker that still serves is that request's failure."""
    lost = resuming(Reply(200, [DEATH, b"data: [DONE]\n\n"]), Reply(200, [b'{"ok": 1}']))
    lost.worker.answers[0]._on_chunk = lambda index: _restart_once(lost.engine, index)  # type: ignore[union-attr]
    await lost.run(chat(stream=True))
    assert lost.count("appliance_engine_faults_outlived_total", route=ROUTE, how="replayed") == 1
    serving = Setup(Worker(Reply(200, [DEATH, b"data: [DONE]\n\n"])), resume=True)
    await serving.run(chat(stream=True))
    assert b'"code":"request_failed"' in serving.client.body and len(serving.worker.sent) == 1


async def _restart_once(engine: FakeEngine, index: int) -> None:
    if index == 0:
        restart(engine)


async def test_a_messages_refusal_the_stream_lost_the_reason_of_ends_with_that_reason() -> None:
    """vLLM's Anthropic stream writes its refusal as an internal_error quoting an excerpt: the
    relay asks the same body not streamed and ends the stream with the 400's reason, in
    Anthropic's error event."""
    said = ("2 validation errors for ChatCompletionStreamResponse\\nmodel\\n  Field required "
            "[type=missing, input_value={'error': {'message': 'Gr...am': None, 'code': 400}}, "
            "input_type=dict]")
    converted = json.dumps({"type": "error", "error": {"type": "internal_error", "message": said}})
    worker = Worker(Reply(200, [f"event: error\ndata: {converted}\n\n".encode()]))
    refusal = {"type": "error", "error": {"type": "invalid_request_error",
                                          "message": "Grammar error: unclosed group"}}
    worker.asked_answer = (400, json.dumps(refusal).encode())
    setup = Setup(worker, resume=True)
    await setup.run(chat(stream=True, api=MESSAGES, max_tokens=50))
    error = json.loads(setup.client.body.split(b"data: ")[-1])
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == "Grammar error: unclosed group"
    (path, asked), = worker.asked
    assert path == "/v1/messages" and asked["stream"] is False and asked["max_tokens"] == 1


class Exchange:
    """What the watch may break: a worker's answer being read."""

    aborted = False

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("resume", [True, False])
async def test_an_engine_loss_breaks_the_exchange_where_it_may_be_outlived(resume: bool) -> None:
    """With resume the watch aborts the exchange under way (its reader hears the fault and
    recovers) and leaves its owner running; without, it cancels the owner as engine_lost."""
    from appliance.proxy.watch import Watch

    engine, exchange, never = FakeEngine("http://127.0.0.1:9"), Exchange(), asyncio.Event()
    watch = Watch(lambda: never.wait(), engine, None, breaks_exchange=resume)  # type: ignore[arg-type, return-value]
    watch.exchange = exchange  # type: ignore[assignment]

    async def owner() -> None:
        with watch:
            await asyncio.sleep(0.05)
            engine.fire_lost()
            await asyncio.sleep(0.05)

    task = asyncio.create_task(owner())
    if resume:
        await task
        assert exchange.aborted and watch.reason is None
    else:
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not exchange.aborted and watch.reason == "engine_lost"
    assert watch.exchange is None  # left: the watch keeps nothing of the request
