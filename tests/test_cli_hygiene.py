"""Command-line manners of `tandem serve`, `tandem backend` and `tandem frontend`: a bad port is one
line naming its flag (no traceback), a bad host is blamed on the host, and every --help shows the
defaults. Each command runs as a real subprocess, bounded by a timeout."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.server.main import build_parser as backend_parser
from frontend.entrypoints.cli import build_parser as tandem_parser
from frontend.server import build_parser as frontend_parser
from helpers import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMAND_TIMEOUT_S = 120  # `tandem backend` imports torch before it reads its arguments


def tandem(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          env={**os.environ, **(env or {})})


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, flag, value", [
    (["serve", "--port", "99999"], "--port", "99999"),
    (["serve", "--grpc-port", "0"], "--grpc-port", "0"),
    (["serve", "--metrics-port", "http"], "--metrics-port", "http"),
    (["frontend", "--backend", "127.0.0.1:1", "--port", "65536"], "--port", "65536"),
    (["backend", "--port", "70000"], "--port", "70000"),
    (["backend", "--metrics-port", "-1"], "--metrics-port", "-1"),
])
def test_a_port_out_of_range_is_one_line_naming_the_flag(args, flag, value):
    result = tandem(*args)
    assert result.returncode == 2
    line = one_line_error(result)
    assert f"argument {flag}: '{value}' is not a port number" in line
    assert line.startswith(f"tandem {args[0]}: error:") and f"`tandem {args[0]} --help`" in line


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, flag", [
    (["serve", "--host", "no-such-host.invalid"], "--host"),
    (["frontend", "--backend", "127.0.0.1:1", "--host", "no-such-host.invalid"], "--host"),
    (["backend", "/no/model/needed", "--host", "no-such-host.invalid"], "--host"),
    (["backend", "/no/model/needed", "--port", "0", "--metrics-host", "no-such-host.invalid"], "--metrics-host"),
    (["serve", "--host", "192.0.2.1"], "--host"),  # TEST-NET-1: an address no machine here has
])
def test_a_bad_host_is_blamed_on_the_host_not_the_port(args, flag):
    """A host that does not resolve, or is not this machine's, names the host's flag; before any
    model loads (the backend's model path does not even exist)."""
    if args[0] != "backend" or "--port" not in args:
        args = [*args, "--port", str(free_port())]
    if args[0] == "serve":
        args += ["--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    result = tandem(*args)
    assert result.returncode == 1
    line = one_line_error(result)
    host = args[args.index(flag) + 1]
    assert line.startswith(f"error: Cannot serve on {flag} {host}:"), line
    assert "choose another with --port" not in line and "--port " not in line


def help_text(command: str, env: dict) -> str:
    result = tandem(command, "--help", env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.timeout(300)
def test_help_shows_the_defaults_and_never_a_secret():
    env = {"TANDEM_API_KEY": "sk-secret-in-env", "TANDEM_GRPC_TOKEN": "grpc-secret-in-env"}
    flat = {command: " ".join(help_text(command, env).split()) for command in ("serve", "backend", "frontend",
                                                                                 "generate")}
    for expected in ("--host HOST address of the HTTP API (default: 127.0.0.1)",
                     "--port PORT port of the HTTP API (default: 8000)", "(default: 50051)", "(default: 8001)",
                     "SIGINT/SIGTERM (default: 30.0)", "(default: $TANDEM_API_KEY)", "--max-n MAX_N",
                     "(default: 128)"):
        assert expected in flat["serve"], expected
    assert "gRPC port (0: any free port) (default: 50051)" in flat["backend"]
    assert "Prometheus /metrics port (0: any free port) (default: 8001)" in flat["backend"]
    assert "HTTP port (default: 8000)" in flat["frontend"] and "(default: info)" in flat["frontend"]
    assert "tokens to generate at most (default: 16)" in flat["generate"]
    for text in flat.values():
        assert "secret-in-env" not in text


@pytest.mark.parametrize("parser", [
    tandem_parser()._subparsers._group_actions[0].choices["serve"],
    tandem_parser()._subparsers._group_actions[0].choices["generate"],
    backend_parser(), frontend_parser()], ids=["serve", "generate", "backend", "frontend"])
def test_every_option_with_a_value_states_its_default(parser: argparse.ArgumentParser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
            continue  # nothing to show: no value by default, or an on/off switch
        assert action.help and "(default" in formatter._expand_help(action), action.option_strings
