"""Hostile clients and costly requests against the edge, with an honest client alongside."""
