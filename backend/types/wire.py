"""What the two processes agree on besides the proto's messages: gRPC metadata keys and the
environment variable that carries the backend's token."""

AUTH_METADATA_KEY = "authorization"  # value: "Bearer <token>"
TOKEN_ENV = "TANDEM_GRPC_TOKEN"  # read when --auth-token is not given (keeps the token out of `ps`)
ERROR_PARAM_METADATA_KEY = "tandem-error-param"  # trailing metadata: the request field an error names
