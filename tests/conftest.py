"""Settings for every test process, before any test module imports gRPC."""

import os

# The tests start servers and tools with subprocess while gRPC channels of earlier tests
# may be active in the same worker; gRPC's fork handlers can then crash the child before
# its exec (grpc/grpc#43055). Nothing here runs gRPC in a forked child. Portico's CLI sets
# the same (cli._without_grpc_fork_handlers).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
