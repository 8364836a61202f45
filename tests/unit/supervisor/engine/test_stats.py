"""The worker's counters read from its /metrics page: the wanted series only, summed over
engines, wherever they sit on the page."""

from __future__ import annotations

from supervisor.engine.stats import parse_engine_stats

PAGE = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 50.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 9.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 12.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 400.0
vllm:generation_tokens_total 1.5e+03
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25"""


def test_the_wanted_series_are_read_and_summed_over_engines() -> None:
    stats = parse_engine_stats(PAGE)
    assert stats.running == 2.0  # on the page's first line
    assert stats.waiting == 4.0  # two engines; not the _by_reason series, nor the HELP line
    assert stats.iterations == 12.0  # the _count sample, not the buckets or the _sum
    assert stats.generation_tokens == 1500.0  # no labels, exponent notation
    assert stats.kv_cache_usage == 0.25  # the last line, no newline after it
    assert stats.prompt_tokens == 0.0 and stats.preemptions == 0.0  # absent: zero
    assert stats.busy


def test_a_page_without_the_series_reads_idle() -> None:
    assert not parse_engine_stats("# nothing\nother_total 5\n").busy
