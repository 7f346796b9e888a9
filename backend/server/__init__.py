"""The backend's entry point: the gRPC server around an ``AsyncLLMEngine`` (``python -m backend.server``).

servicer.py (EngineService), status_codes.py (errors -> status codes), proto_convert.py (proto <->
types), grpc_server.py (BackendServer, health, drain), reflection.py (reflection v1 and v1alpha), main.py
(command line), auth.py, metrics.py, grpc_logs.py. Imports: backend.engine and below.
"""
