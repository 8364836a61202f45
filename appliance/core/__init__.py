"""What both processes share: settings, errors, the engine contract, the worker client."""
