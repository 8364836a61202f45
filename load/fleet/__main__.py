"""`python -m load.fleet`: the fleet's scenarios, one after another (see load/fleet/__init__.py)."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

from load.fleet.boxes import KEY, Box, wait_all_ready
from load.fleet.router import CB_OPEN_S, DEFAULT_BIN, Router, running_router
from load.fleet.traffic import Tally, Traffic

SCENARIOS = ("kill", "rolling", "affinity", "gone")
GROUPS = 5  # odd: round robin then sends each group to both boxes in turn
PER_GROUP = 4
PREFIX_WORDS = 200  # ~1,000 tokens (a word "w1234" is ~5): several KV blocks, in the window


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.fleet", description=__doc__)
    parser.add_argument("--router", default=DEFAULT_BIN, help="the vllm-router executable")
    parser.add_argument("--clients", type=int, default=4, help="client threads under load")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, in this order: {','.join(SCENARIOS)}")
    parser.add_argument("--workdir", type=Path, help="logs of the boxes and the router")
    parser.add_argument("--synthetic", action="store_true", help="the synthetic upstream as "
                        "each box's worker: the plumbing in seconds, no vLLM (no prefix cache)")
    args = parser.parse_args(argv)
    wanted = [s for s in SCENARIOS if s in args.scenarios.split(",")]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleet-"))
    boxes = [Box("box0", 0, workdir / "box0", synthetic=args.synthetic),
             Box("box1", 1, workdir / "box1", synthetic=args.synthetic)]
    fleet = Fleet(boxes, args.router, workdir / "router.log", args.clients)
    print(f"fleet: 2 boxes (taskset -c 0 and -c 1), vllm-router {args.router}; logs {workdir}",
          flush=True)
    try:
        for box in boxes:
            box.start()
        print(f"boxes ready in {wait_all_ready(boxes):.0f} s", flush=True)
        fleet.keys()
        for name in wanted:
            getattr(fleet, name)()
    finally:
        for box in boxes:
            box.stop()
    return 0


class Fleet:
    def __init__(self, boxes: list[Box], binary: str, log: Path, clients: int) -> None:
        self.boxes = boxes
        self._binary = binary
        self._log = log
        self._clients = clients

    def router(self, policy: str = "cache_aware") -> AbstractContextManager[Router]:
        return running_router(self._binary, [b.url for b in self.boxes if b.appliance],
                              policy, self._log)

    def keys(self) -> None:
        """The router passes each client's Authorization through; every box checks it."""
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        seen = {}
        with self.router() as router:
            for label, headers in (("right key", {"Authorization": f"Bearer {KEY}"}),
                                   ("wrong key", {"Authorization": "Bearer sk-not-a-client"}),
                                   ("no key", {})):
                statuses = {httpx.post(f"{router.url}/v1/chat/completions", json=body,
                                       headers=headers, timeout=120).status_code
                            for _ in range(4)}  # four: both boxes answer under cache_aware
                seen[label] = sorted(statuses)
        print(f"keys through the router: {seen}", flush=True)
        assert seen == {"right key": [200], "wrong key": [401], "no key": [401]}, seen

    def kill(self) -> None:
        box = self.boxes[0]
        with self.router() as router, Traffic(router.url, self._clients) as traffic:
            traffic.wait_for(10)
            killed = time.monotonic()
            box.kill_engine()
            _wait(lambda: _readyz(box) != 200, 10)
            _wait(lambda: _readyz(box) == 200, 300)
            router.wait_until(box.url, True, 60)
            healed = time.monotonic() - killed
            traffic.wait_for(10)
        report("kill -9 of box0's engine under load", traffic.tally, healed,
               "kill -9 -> box0 ready and back in the router's rotation")

    def rolling(self) -> None:
        with self.router() as router, Traffic(router.url, self._clients) as traffic:
            traffic.wait_for(10)
            began = time.monotonic()
            for box in self.boxes:
                drained = box.drain(wait=True)
                assert drained.returncode == 0, drained.stderr
                code = box.live.proc.wait(60)
                stopped = time.monotonic()
                assert code == 0, f"{box.name} exited {code}"
                box.stop()
                box.start().wait_ready(600)
                router.wait_until(box.url, True, 60)
                # Healthy again is not yet taken again: the router's circuit breaker, opened by
                # the refusals of the drain, skips the box for CB_OPEN_S after them. The next
                # box may go only once this one can take its share.
                time.sleep(max(0.0, stopped + CB_OPEN_S + 1 - time.monotonic()))
            healed = time.monotonic() - began
        report("rolling restart (drain box0, start it, then box1) under load", traffic.tally,
               healed, "first drain -> both boxes back in rotation")

    def gone(self) -> None:
        box = self.boxes[1]
        with self.router() as router, Traffic(router.url, self._clients) as traffic:
            traffic.wait_for(10)
            killed = time.monotonic()
            box.kill_supervisor()
            out = router.wait_until(box.url, False, 60)
            traffic.wait_for(30)
        tally = traffic.tally
        last = max((f.at for f in tally.failures), default=killed) - killed
        report("box1's supervisor SIGKILLed (the box gone) under load", tally, out,
               "SIGKILL -> box1 out of the router's rotation")
        print(f"  last client failure {max(last, 0.0):.1f} s after the kill", flush=True)
        box.stop()

    def affinity(self) -> None:
        rates = {}
        for seed, policy in enumerate(("cache_aware", "round_robin")):
            with self.router(policy) as router:
                rates[policy] = self._shared_prefixes(router, seed)
        print("prefix-cache hit rate (vllm:prefix_cache_hits / queries, both workers, "
              f"{GROUPS} prefixes x {PER_GROUP} requests each, fresh prefixes per policy):",
              flush=True)
        for policy, (rate, per_box) in rates.items():
            print(f"  {policy:<12} {rate:6.1%}   queried tokens per box {per_box}", flush=True)

    def _shared_prefixes(self, router: Router, seed: int) -> tuple[float, list[int]]:
        rng = random.Random(1000 + seed)
        words = [f"w{rng.randrange(10_000)}" for _ in range(GROUPS * PREFIX_WORDS)]
        prefixes = [f"Reference document {seed}-{g}: " + " ".join(
            words[g * PREFIX_WORDS:(g + 1) * PREFIX_WORDS]) for g in range(GROUPS)]
        before = [box.prefix_cache() for box in self.boxes]
        with httpx.Client(timeout=300) as client:
            for i in range(PER_GROUP):
                for prefix in prefixes:
                    body = {"messages": [{"role": "system", "content": prefix},
                                         {"role": "user", "content": f"Question {i}?"}],
                            "max_tokens": 1}
                    response = client.post(f"{router.url}/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {KEY}"})
                    assert response.status_code == 200, response.text
        after = [box.prefix_cache() for box in self.boxes]
        hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        per_box = [int(a[1] - b[1]) for a, b in zip(after, before, strict=True)]
        return (hits / queries if queries else 0.0), per_box


def _readyz(box: Box) -> int:
    try:
        return httpx.get(f"{box.url}/readyz", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _wait(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the fleet never got there"
        time.sleep(0.05)


def report(title: str, tally: Tally, healed_s: float, healed_what: str) -> None:
    print(f"{title}:\n  requests sent {tally.sent}, client-visible failures "
          f"{len(tally.failures)}, healed in {healed_s:.1f} s ({healed_what})", flush=True)
    for failure in tally.failures[:5]:
        print(f"    failure: {failure.what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
