"""Resumable sessions (`GET /v1/session`): exactly-once control messages across reconnects."""
