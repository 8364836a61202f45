"""Load tests and benchmarks for chat-appliance."""
