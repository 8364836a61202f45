"""Load runs and benchmarks for chat-appliance, by what each is for.

bench/     what the appliance costs: CPU, instructions, throughput beside vLLM and LiteLLM,
           reaction and restart times
faults/    engine faults under load, and what a client sees of them (seams, resume identity)
fairness/  fair sharing of one engine between clients and priorities
hostile/   hostile clients and costly requests against the edge
locust/    the locust suite and its headless run
kit/       what the benches and the tests share: the appliance and synthetic worker they boot,
           raw and measured clients, process readings, dated result files

Nothing here imports tests/ (tests/unit/test_load_imports.py): the tests import the kit.
"""
