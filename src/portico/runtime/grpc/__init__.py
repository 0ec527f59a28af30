"""The `grpc` runtime (Portico as the facade of an agent runtime); needs the `grpc` extra,
so it is imported only when an agent is configured with it."""
