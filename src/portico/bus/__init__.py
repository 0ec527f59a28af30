"""The bus port: state that must be shared between replicas (in-process by default)."""
