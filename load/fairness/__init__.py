"""Fair sharing of one engine between clients and priorities, on the real worker."""
