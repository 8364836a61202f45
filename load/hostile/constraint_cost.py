"""What one costly output constraint does to another client's request, side by side.

Run: python -m load.hostile.constraint_cost --url http://127.0.0.1:8000 [--victim-key K --attacker-key K]

The victim's short chat request is timed alone, then while the attacker's request with a short
regex of nested quantifiers runs (the attack of issue 20 #1). Against an appliance that vets
constraints, the attacker gets 400 at once and the ratio stays near 1; without the vetting
(constraints.max_quantifier_nesting raised) the engine checks the regex at every token of
every request and the victim waits. Prints both times, the ratio and the attacker's status.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence

import httpx

from load.kit import results

VICTIM = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 10,
          "ignore_eos": True}
ATTACK_REGEX = r"(a+)+(b+)+(c+)+$"


def timed_chat(client: httpx.Client, key: str | None, body: dict[str, object]) -> tuple[float,
                                                                                       int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    started = time.perf_counter()
    status = client.post("/v1/chat/completions", json=body, headers=headers).status_code
    return time.perf_counter() - started, status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--victim-key", default=None)
    parser.add_argument("--attacker-key", default=None)
    parser.add_argument("--regex", default=ATTACK_REGEX, help="the attacker's regex")
    parser.add_argument("--attack-tokens", type=int, default=8,
                        help="the attacker's max_tokens (each may take seconds unvetted)")
    results.add_option(parser)
    args = parser.parse_args(argv)
    attack = {"messages": [{"role": "user", "content": "Write letters."}],
              "max_tokens": args.attack_tokens, "structured_outputs": {"regex": args.regex}}
    with httpx.Client(base_url=args.url, timeout=900) as client:
        timed_chat(client, args.victim_key, VICTIM)  # warm: the first request pays for more
        alone, _ = timed_chat(client, args.victim_key, VICTIM)
        outcome: list[tuple[float, int]] = []
        attacker = threading.Thread(target=lambda: outcome.append(
            timed_chat(client, args.attacker_key, attack)))
        attacker.start()
        time.sleep(0.5)  # the attacker's request is with the engine (or already refused)
        beside, status = timed_chat(client, args.victim_key, VICTIM)
        attacker.join()
    attack_s, attack_status = outcome[0]
    with results.Printed() as printed:
        print(f"victim alone {alone:.2f} s; beside the attack {beside:.2f} s "
              f"({beside / alone:.1f}x, status {status}); attacker {attack_status} "
              f"in {attack_s:.2f} s")
    results.save(__spec__.name, argv, printed.text(), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
