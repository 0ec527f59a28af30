"""Thin adapters: HTTP routes, sockets and timers around the sans-I/O cores."""
