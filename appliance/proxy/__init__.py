"""One request from admission to its last byte, and what it sends the worker."""
