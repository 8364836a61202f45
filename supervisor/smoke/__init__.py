"""The GPU smoke check (python -m supervisor.smoke.check); importable without pydantic."""
