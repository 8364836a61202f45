"""The GPU through NVML: the monitor (`nvml`), what one poll found (`readings`), and the
manager's off-loop view of it (`watch`)."""
