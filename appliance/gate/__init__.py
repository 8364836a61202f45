"""What every generation request passes before the engine: the common rules, the budget clamp."""
