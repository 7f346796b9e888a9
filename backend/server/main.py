"""The backend's command line: ``python -m backend.server`` (and ``tandem backend``).

    python -m backend.server [MODEL] [--host 127.0.0.1] [--port 50051] [--metrics-port 8001]
        [--auth-token TOKEN] [--ssl-certfile F --ssl-keyfile F [--ssl-ca-certs F]] [--insecure] [engine flags]
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Optional

from backend.server.auth import ServerSecurity
from backend.server.grpc_server import DEFAULT_MAX_CONNECTION_AGE_S, serve
from backend.types.command_line import CommandLineParser
from backend.types.config import EngineConfig
from backend.types.errors import TandemError
from backend.types.limits import BACKEND_LIMITS, Limits
from backend.types.ports import port_number_or_zero
from backend.types.wire import TOKEN_ENV


def build_parser(prog: str = "python -m backend.server") -> CommandLineParser:
    parser = CommandLineParser(prog=prog, description="The gRPC backend: EngineService over "
                               "an in-process engine, plus health, reflection, metrics.")
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve gRPC on; anything but loopback needs --auth-token or mTLS "
                             "(--ssl-ca-certs), or --insecure")
    parser.add_argument("--port", type=port_number_or_zero, default=50051, help="gRPC port (0: any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address to serve Prometheus /metrics on")
    parser.add_argument("--metrics-port", type=port_number_or_zero, default=8001,
                        help="Prometheus /metrics port (0: any free port)")
    security = parser.add_argument_group("security (health stays open; everything else needs the token)")
    security.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV),
                          help=f"require 'authorization: Bearer TOKEN' metadata on every call (default: ${TOKEN_ENV})")
    security.add_argument("--ssl-certfile", default=None, help="serve TLS with this certificate (PEM)")
    security.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    security.add_argument("--ssl-ca-certs", default=None,
                          help="require client certificates signed by this CA (mutual TLS)")
    security.add_argument("--insecure", action="store_true",
                          help="allow a non-loopback --host with neither a token nor mutual TLS")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running streams get to finish after SIGTERM")
    parser.add_argument("--max-connection-age", type=float, default=DEFAULT_MAX_CONNECTION_AGE_S,
                        help="seconds before a client connection is asked to reconnect, so new replicas "
                             "behind a balancer get traffic (running streams finish first; 0: never)")
    Limits.add_cli_args(parser, BACKEND_LIMITS)
    return parser


def main(argv: Optional[list[str]] = None, prog: str = "python -m backend.server") -> int:
    """Serve until SIGTERM/SIGINT (0) or the engine's death (1); 1 with the reason on stderr when it
    cannot start, 2 for a bad argument."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        security = ServerSecurity(args.auth_token or None, args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                                  args.insecure)  # an empty $TANDEM_GRPC_TOKEN is no token
        return asyncio.run(serve(EngineConfig.from_cli_args(args), args.host, args.port, args.metrics_port,
                                 args.shutdown_timeout, Limits.from_cli_args(args), args.max_connection_age,
                                 security, args.metrics_host))
    except TandemError as error:  # a bad flag or model: say what, without a traceback
        print(f"error: {error}", file=sys.stderr)
        return 1
