"""The runtime port: what executes one turn (a model, a script, the demo agent)."""
