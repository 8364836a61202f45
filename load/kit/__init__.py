"""What the load runs, the benches and the tests share: the appliance and the synthetic worker
they boot, raw and measured clients, process readings, ports, certificates, dated results."""
