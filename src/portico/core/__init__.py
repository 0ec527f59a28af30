"""The engine: sessions, turns and messages, independent of any wire protocol."""
