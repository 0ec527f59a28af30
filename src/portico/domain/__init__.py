"""The ground floor: the domain's typed, immutable records (sessions, messages, turns,
tool calls, memory entries), their state machines and the pure rules on them.

Every layer may import this package; it imports nothing of Portico but `errors`, so no
import runs upward: core/ (the engine) sits on it with the ports below the engine
(store/, runtime/, media/, bus/, sessionstate/), and protocols/ and server/ above."""
