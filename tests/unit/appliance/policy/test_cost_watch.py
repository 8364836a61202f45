"""The run-time cost watch's decision, on a fake clock: which request is aborted, when, and when
none is (a request alone, an unconstrained batch, steps within the bound, the setting off)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from appliance.core.sections import ConstraintSettings
from appliance.policy.constraints import check_constraints
from appliance.policy.cost_watch import CostWatch, Followed, tokens_in, tokens_per_event

# Each request as the watch follows it: by its constraint's parameter, as the gate names it.
GRAMMAR = check_constraints(
    {"structured_outputs": {"grammar": "root ::= s\ns ::= s s s | s s | [a-z ]"}},
    ConstraintSettings())
SCHEMA = check_constraints(
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    ConstraintSettings())
PLAIN = check_constraints({"messages": [{"role": "user", "content": "hi"}]}, ConstraintSettings())
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'  # one token, no ids


def with_ids(count: int) -> bytes:
    """A chat event as vLLM 0.32 writes it with return_token_ids: `count` tokens at once."""
    ids = ",".join(str(100 + i) for i in range(count))
    return (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
            b'"model":"m","choices":[{"index":0,"delta":{"content":"' + b"a" * count +
            b'"},"logprobs":null,"finish_reason":null,"token_ids":[' + ids.encode() +
            b']}]}\n\n')


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Bench:
    """A watch, its clock, and which of the followed requests were aborted."""

    def __init__(self, **limits: Any) -> None:
        self.clock = Clock()
        self.counter = Counter("too_costly", "", registry=CollectorRegistry())
        self.watch = CostWatch(ConstraintSettings(**limits), self.counter, self.clock)
        self.aborted: list[str] = []
        self.stack = contextlib.ExitStack()

    def follow(self, name: str, constraint: str | None, per_event: int = 1) -> Followed:
        return self.stack.enter_context(
            self.watch.follow(constraint, lambda: self.aborted.append(name), per_event=per_event))

    def tokens(self, followed: list[Followed], count: int, step_s: float) -> None:
        """`count` engine steps of `step_s`, each giving every streamed request a token."""
        for _ in range(count):
            self.clock.now += step_s
            for one in followed:
                one.progressed(EVENT)


@contextlib.contextmanager
def bench(**limits: Any) -> Iterator[Bench]:
    made = Bench(**limits)
    with made.stack:
        yield made


def test_a_constrained_request_slowing_a_peer_is_aborted_with_its_numbers() -> None:
    with bench() as b:
        victim = b.follow("victim", PLAIN)
        b.tokens([victim], 20, 0.05)  # the norm: 0.05 s a token
        costly = b.follow("costly", GRAMMAR)
        b.tokens([victim, costly], 3, 0.1)  # 2x the norm: within the bound
        assert b.aborted == []
        b.tokens([victim, costly], 4, 0.5)
        assert b.aborted == ["costly"]
        verdict = costly.verdict
        assert verdict is not None and verdict.param == "structured_outputs.grammar"
        assert (verdict.norm_s, verdict.bound_s, verdict.step_s) == pytest.approx((0.05, 0.2, 0.5))
        assert verdict.peers == 1 and b.counter._value.get() == 1
        error = verdict.logged()
        assert (error.status, error.code, error.param) == (400, "request_too_costly",
                                                           "structured_outputs.grammar")


def test_a_peer_arriving_while_the_engine_is_slow_gets_the_costly_one_aborted_at_once() -> None:
    """A costly request alone costs only itself; the moment another request shares the engine,
    the costly one (already seen slow) goes, before the newcomer waits a single step."""
    with bench() as b:
        costly = b.follow("costly", GRAMMAR)
        b.tokens([costly], 10, 1.0)
        assert b.aborted == []
        b.follow("victim", PLAIN)
        assert b.aborted == ["costly"]


def test_a_non_streamed_costly_request_is_caught_through_a_streamed_peer() -> None:
    with bench() as b:
        b.follow("costly", SCHEMA)  # no events: its progress is not seen
        victim = b.follow("victim", PLAIN)
        b.tokens([victim], 4, 0.5)
        assert b.aborted == ["costly"]


def test_the_constrained_request_whose_stay_is_slowest_goes_not_the_oldest() -> None:
    """Issue 35 #6: a cheap constrained request ran at the norm before a costly one came; the
    costly one is aborted, and the cheap one finishes once the steps are back at the norm."""
    with bench() as b:
        victim = b.follow("victim", PLAIN)
        b.tokens([victim], 10, 0.05)  # the norm
        cheap = b.follow("cheap", SCHEMA)
        b.tokens([victim, cheap], 20, 0.05)
        costly = b.follow("costly", GRAMMAR)
        b.tokens([victim, cheap, costly], 4, 0.5)
        assert b.aborted == ["costly"]
        assert b.watch.paced(cheap) < 0.5  # its stay ran mostly at the norm
        b.tokens([victim, cheap], 20, 0.05)
        assert b.aborted == ["costly"]


def test_of_two_that_came_together_the_later_goes_first_then_the_next_if_steps_stay_slow(
) -> None:
    with bench() as b:
        first, second = b.follow("first", GRAMMAR), b.follow("second", SCHEMA)
        b.tokens([first, second], 4, 0.5)
        assert b.aborted == ["second"]  # the same pace since each came: the later one's coming
        b.tokens([first], 4, 0.5)  # alone now: nobody else waits
        assert b.aborted == ["second"]
        victim = b.follow("victim", PLAIN)
        b.tokens([first, victim], 2, 0.5)  # judged on steps after the abort: a fresh window
        assert b.aborted == ["second", "first"]


def test_an_event_of_many_tokens_is_that_many_steps_not_one_slow_one() -> None:
    """Issue 35 #6: a client streaming with stream_interval 12 gets an event each 12 steps; its
    gaps are divided by the tokens the event carries (its ids, else its stream_interval), so a
    constrained request beside it at the norm is left alone."""
    for per_event, event in ((1, with_ids(12)), (12, EVENT)):
        with bench() as b:
            plain = b.follow("plain", PLAIN)
            b.tokens([plain], 10, 0.05)  # the norm
            interval = b.follow("interval", PLAIN, per_event=per_event)
            constrained = b.follow("constrained", SCHEMA)
            for _ in range(10):
                for _ in range(12):
                    b.clock.now += 0.05
                    constrained.progressed(EVENT)
                interval.progressed(event)
            assert b.aborted == [], per_event
            assert interval.gaps is not None
            assert list(interval.gaps) == pytest.approx([0.05] * 3)
            assert interval.tokens == 120


def test_the_tokens_of_a_read_are_its_generated_ids_else_its_events_times_the_interval(
) -> None:
    two_events = with_ids(3) + with_ids(1)
    assert tokens_in(two_events, 12) == 4  # the ids decide, whatever the interval
    first = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
             b'"token_ids":null}],"prompt_token_ids":[1,2,3,4,5]}\n\n')
    assert tokens_in(first, 1) == 1  # no generated ids to count: one event
    assert tokens_in(first.replace(b"null", b"[]"), 1) == 0  # a role event: no token
    assert tokens_in(b"data: [DONE]\n\n" + EVENT, 12) == 24
    assert tokens_per_event({"stream_interval": 12}) == 12
    assert tokens_per_event({"stream_interval": "12"}) == tokens_per_event({}) == 1


def test_no_abort_without_a_constraint_within_the_bound_or_with_the_setting_off() -> None:
    with bench() as b:
        plain = [b.follow("a", PLAIN), b.follow("b", PLAIN)]
        b.tokens(plain, 10, 5.0)  # slow, but no request of the costly class is there
        assert b.aborted == []
    with bench() as b:
        pair = [b.follow("costly", GRAMMAR), b.follow("victim", PLAIN)]
        b.tokens(pair, 10, 0.07)  # under 4x the floor that stands in for the norm (0.08 s)
        assert b.aborted == []
    with bench(abort_when_slow=False) as b:
        pair = [b.follow("costly", GRAMMAR), b.follow("victim", PLAIN)]
        b.tokens(pair, 10, 5.0)
        assert b.aborted == []


def test_the_norm_is_learnt_only_while_no_constrained_request_runs() -> None:
    """A costly request cannot raise its own bar: its slow steps never enter the norm."""
    with bench() as b:
        victim = b.follow("victim", PLAIN)
        b.tokens([victim], 5, 0.05)
        with b.watch.follow(GRAMMAR, lambda: None) as costly:
            b.tokens([costly], 5, 3.0)
        assert b.watch.norm_s() == pytest.approx(0.05)
        b.tokens([victim], 1, 0.01)  # below the floor: the floor stands
        assert b.watch.norm_s() == pytest.approx(0.05)


def test_a_constrained_request_that_comes_to_an_engine_already_slow_is_not_the_cause() -> None:
    """Slow steps that began before it came (a long prefill, a full batch) are not its doing."""
    with bench() as b:
        plain = [b.follow("a", PLAIN), b.follow("b", PLAIN)]
        b.tokens(plain, 20, 0.05)  # the norm
        b.tokens(plain, 5, 1.0)
        late = b.follow("late", GRAMMAR)
        assert b.aborted == []
        b.tokens([*plain, late], 2, 1.0)  # the window still began before it came
        assert b.aborted == []
        b.tokens([*plain, late], 1, 1.0)  # now slow since it has been there, and still slow
        assert b.aborted == ["late"]


def test_a_pass_through_is_no_peer_and_its_progress_is_not_judged() -> None:
    """Models, tokenize, a stored response: no engine work, so not a request that waits."""
    with bench() as b:
        costly = b.follow("costly", GRAMMAR)
        with b.watch.follow({}, lambda: None, engine_work=False) as passing:
            b.tokens([costly, passing], 10, 5.0)
        assert b.aborted == []


def test_steps_slow_before_a_constrained_request_came_are_not_held_against_it() -> None:
    """Gaps that began before it was at the engine cannot condemn it (while no constrained
    request is there, a token only feeds the norm); the steps it shares can."""
    with bench() as b:
        plain = [b.follow("a", PLAIN), b.follow("b", PLAIN)]
        b.tokens(plain, 30, 0.05)  # the norm
        b.tokens(plain, 10, 1.0)  # slow, with no constrained request at the engine
        costly = b.follow("costly", GRAMMAR)
        b.tokens([*plain, costly], 2, 1.0)  # of a window of 3, the first began before it came
        assert b.aborted == []
        b.tokens([*plain, costly], 1, 1.0)
        assert b.aborted == ["costly"]


def test_a_window_kept_from_an_earlier_constrained_request_hides_no_later_one() -> None:
    """A stream that stalled with a window of slow gaps that condemned nobody (its first gap
    began before the constrained request of its time came) does not stand in the way of the
    next constrained request's judgement."""
    with bench() as b:
        stalled, victim = b.follow("stalled", PLAIN), b.follow("victim", PLAIN)
        b.tokens([stalled, victim], 20, 0.05)
        b.tokens([stalled], 1, 1.0)  # slow, with no constrained request at the engine
        with b.watch.follow(SCHEMA, lambda: b.aborted.append("first")):
            b.tokens([stalled], 2, 1.0)  # then the stream stalls
        assert b.aborted == []
        b.tokens([victim], 5, 0.05)
        costly = b.follow("costly", GRAMMAR)
        # The victim's tokens are timed from now (the stalled stream timed the norm): its
        # first begins no gap, the next three fill its window.
        b.tokens([victim, costly], 4, 1.0)
        assert b.aborted == ["costly"]


def test_one_stream_times_the_steps_while_none_is_constrained_every_stream_while_one_is() -> None:
    """A step gives each request at the engine a token, so the oldest stream's gaps are the norm;
    the others' tokens cost nothing to watch. With a constrained request there, every stream is
    timed (any of them may show the slow steps); the oldest takes over when it leaves."""
    with bench() as b:
        first, second = b.follow("first", PLAIN), b.follow("second", PLAIN)
        assert (first.measuring, second.measuring) == (True, False)
        with b.watch.follow(None, lambda: None, streamed=False) as quiet:
            assert not quiet.measuring  # a non-streamed answer shows no tokens to time
        b.tokens([first, second], 5, 0.05)
        assert len(b.watch.norm) == 4  # the first stream's gaps alone
        with b.watch.follow(GRAMMAR, lambda: None) as costly:
            assert first.measuring and second.measuring and costly.measuring
        assert (first.measuring, second.measuring) == (True, False)
    with bench() as b:
        with b.watch.follow(PLAIN, lambda: None) as first:
            second = b.follow("second", PLAIN)
            b.tokens([first, second], 3, 0.05)
        assert second.measuring  # the oldest left: the next times the steps, from its next token
        b.tokens([second], 1, 9.0)
        assert len(b.watch.norm) == 2  # that token began no gap
        b.tokens([second], 2, 0.05)
        assert b.watch.norm_s() == pytest.approx(0.05)
