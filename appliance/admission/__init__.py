"""Who may have the engine's time: clients by key, their limits, the slots and the fair queue."""
