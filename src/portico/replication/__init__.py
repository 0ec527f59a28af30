"""Several replicas behaving as one process: turn output over the bus, control to the
replica running the turn, one turn per session (docs/replicas.md)."""
