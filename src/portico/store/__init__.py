"""The archive port: sessions, messages and turns, kept across restarts."""
