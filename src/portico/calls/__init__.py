"""Live voice calls (spec/realtime-audio.md): the call service that runs a duplex
runtime's call for a connection, its limits, its parking lot, and the rules that
turn a call's events into archived text turns."""
