"""Protobuf packages under grpc.* that grpcio does not ship (see protos/generate.py).

Imported as ``protos.grpc``; never put protos/ itself on sys.path, where this would hide grpcio."""
