"""Read Prometheus text exposition into {(name, labels): value} for exact assertions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(text: str, name: str, **labels: str) -> float:
    """The sum over every series of `name` with these labels (labels not named: any value)."""
    wanted = frozenset(labels.items())
    return sum(v for (n, series), v in samples(text).items() if n == name and wanted <= series)
