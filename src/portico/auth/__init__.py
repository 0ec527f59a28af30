"""The auth port: turns a credential into the principal that owns sessions."""
