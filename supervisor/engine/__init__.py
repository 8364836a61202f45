"""The engine's lifecycle: the worker process, its exits, the manager's state machine, backoff,
the probes that ask it questions, and the stats it reports."""
