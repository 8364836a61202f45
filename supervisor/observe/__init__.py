"""Supervisor facts for Prometheus, and the logging setup."""
