"""Tandem's protobuf contracts and their generated Python stubs (see protos/README.md)."""
