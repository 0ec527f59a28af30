"""Test harness shared by the suites: real server processes and real clients."""
