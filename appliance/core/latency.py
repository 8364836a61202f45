"""One set of histogram buckets for every latency the appliance exports, the API's and the
engine's alike, so that their quantiles line up on one dashboard."""

from __future__ import annotations

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
