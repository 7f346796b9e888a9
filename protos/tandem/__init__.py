"""Protobuf packages under tandem.*."""
