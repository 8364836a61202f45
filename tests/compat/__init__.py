"""vLLM's own OpenAI-server tests, run against the worker and through the appliance (issue 10)."""
