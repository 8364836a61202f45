"""The admission queue's order: priority, then round-robin across clients, FIFO within one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from appliance.admission.fairqueue import FairQueue


def drain(queue: FairQueue[str]) -> list[str]:
    served = []
    while (item := queue.pop()) is not None:
        served.append(item)
    return served


def test_empty_queue_pops_nothing() -> None:
    assert FairQueue[str]().pop() is None


def test_lower_priority_value_is_served_first_whatever_the_arrival() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("late-low", "a", 5)
    queue.push("high", "b", -1)
    queue.push("normal", "c", 0)
    assert drain(queue) == ["high", "normal", "late-low"]


def test_one_client_is_served_in_arrival_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(5):
        queue.push(f"a{i}", "a", 0)
    assert drain(queue) == [f"a{i}" for i in range(5)]


def test_a_client_with_one_waiter_is_not_delayed_by_one_with_a_hundred() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.push(f"flood{i}", "flood", 0)
    queue.push("single", "steady", 0)
    served = drain(queue)
    assert served.index("single") == 1  # after the flood's first, which was already queued


def test_clients_of_one_priority_take_turns() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(3):
        queue.push(f"a{i}", "a", 0)
    for i in range(2):
        queue.push(f"b{i}", "b", 0)
    queue.push("c0", "c", 0)
    assert drain(queue) == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_a_client_arriving_later_joins_the_ring_behind_those_waiting() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a0", "a", 0)
    queue.push("a1", "a", 0)
    queue.push("b0", "b", 0)
    assert queue.pop() == "a0"
    queue.push("c0", "c", 0)
    assert drain(queue) == ["b0", "a1", "c0"]


def test_a_removed_waiter_is_never_served_and_the_rest_keep_their_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for item, client in (("a0", "a"), ("b0", "b"), ("a1", "a")):
        queue.push(item, client, 0)
    assert queue.remove("b0") and not queue.remove("b0")
    assert "b0" not in queue and len(queue) == 2
    assert drain(queue) == ["a0", "a1"]


def test_heaviest_is_the_client_holding_most_places_and_newest_of_its_last_arrival() -> None:
    queue: FairQueue[str] = FairQueue()
    assert queue.heaviest() is None and queue.newest_of("a") is None
    queue.push("a0", "a", 0)
    queue.push("b0", "b", 0)
    queue.push("b1", "b", 3)
    queue.push("b2", "b", 0)
    assert queue.heaviest() == ("b", 3)
    assert queue.count("b") == 3 and queue.count("nobody") == 0
    assert queue.newest_of("b") == "b1"  # the worse priority's newest goes first


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(-1, 1)), max_size=60))
def test_every_waiter_is_served_once_by_priority_and_fifo_per_client(
        arrivals: list[tuple[str, int]]) -> None:
    queue: FairQueue[str] = FairQueue()
    for i, (client, priority) in enumerate(arrivals):
        queue.push(f"{client}:{priority}:{i}", client, priority)
    served = drain(queue)
    assert sorted(served) == sorted(f"{c}:{p}:{i}" for i, (c, p) in enumerate(arrivals))
    priorities = [int(item.split(":")[1]) for item in served]
    assert priorities == sorted(priorities)
    for client in "abcd":
        for priority in (-1, 0, 1):
            mine = [int(s.split(":")[2]) for s in served if s.startswith(f"{client}:{priority}:")]
            assert mine == sorted(mine)


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=60))
def test_within_a_priority_no_client_is_served_twice_while_another_waits_its_turn(
        arrivals: list[str]) -> None:
    """Round-robin: between two services of one client, every other client that was waiting
    all along is served once."""
    queue: FairQueue[str] = FairQueue()
    for i, client in enumerate(arrivals):
        queue.push(f"{client}{i}", client, 0)
    served = [item[0] for item in drain(queue)]
    for position in range(1, len(served)):
        if served[position] == served[position - 1]:
            assert set(served[position:]) == {served[position]}  # only it was left


def test_peek_shows_what_pop_takes_and_its_priority() -> None:
    queue: FairQueue[str] = FairQueue()
    assert queue.peek() is None and queue.best_priority() is None
    queue.push("a0", "a", 2)
    queue.push("b0", "b", -3)
    assert queue.peek() == ("b0", -3) and queue.best_priority() == -3
    assert queue.pop() == "b0" and len(queue) == 1
