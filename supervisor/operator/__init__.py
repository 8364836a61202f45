"""The operator's interfaces: control socket, reload, systemd notifications, TLS, private files."""
