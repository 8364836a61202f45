"""The API's Prometheus metrics."""
