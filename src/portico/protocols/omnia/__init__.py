"""The Omnia agent-facade protocol (`GET /ws`)."""
