"""grpc.reflection.*: gRPC server reflection protocols."""
