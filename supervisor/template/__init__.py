"""The worker template: a process of the engine venv that has imported vLLM once and forks each
new worker (`process` is the supervisor's side, `engine_side` and `engine_fork` run in the engine
venv and are loaded there by path, never imported by the supervisor)."""
