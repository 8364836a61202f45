"""The fleet, proven on one machine: two appliances (each with its own CPU worker, each pinned
to its own core with `taskset -c`) behind a real vllm-router, under load.

    python -m load.fleet [--router PATH] [--clients 4] [--scenarios kill,rolling,affinity,gone]

Per scenario it prints the requests sent, the client-visible failures and the time the fleet
took to heal (docs/fleet.md reads the output):

  kill      kill -9 of one box's engine under load: the box resumes or refuses (503 before any
            byte) what it held, the router retries the refused elsewhere: zero failures
  rolling   a rolling restart under load: `chat-appliance drain --wait` one box, start it again,
            then the other: zero failures
  gone      one box's supervisor SIGKILLed (the box gone for good): failures bounded by the
            router's retries and circuit breaker, counted
  affinity  requests sharing long prefixes through cache_aware, then round_robin (fresh
            prefixes each), vLLM's prefix-cache hit rate from the workers' own counters

Keys: every box holds the same clients table; the router passes each client's Authorization
header through unchanged (checked before the scenarios: right key 200, wrong or none 401).
Needs the real engine and vllm-router in a venv of its own (`bash install.sh --dev` builds
both). Run it alone on the machine: python -m load.fleet.
"""
