"""Protobuf packages under tandem.engine.*."""
