"""The gRPC runtime contract (`omnia.runtime.v1.RuntimeService`), shared by the facade
side (`runtime: grpc`) and the agent SDK (`portico.agent`).

`runtime.proto` is the source; the `runtime_pb2*` modules are generated from it (the
command is in the proto's header) and checked in, so installing Portico needs no
protoc. Importing this package needs the `grpc` extra (grpcio, protobuf).
"""
