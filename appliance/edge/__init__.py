"""Before any route: connection limits, the client socket, the Host check."""
