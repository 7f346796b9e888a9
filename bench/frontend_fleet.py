"""Several frontends behind the load balancer, on one stand-in backend: do they scale?

    python bench/frontend_fleet.py [--frontends 2] [--concurrency 64] [--workloads chat-stream]
                                   [--max-tokens 64] [--tokens-per-run 16384] [--stream-interval 1]
                                   [--repeats 2] [--json out.json]

Three layouts, each driven by the same clients (``frontend_capacity.drive``) against the stand-in
backend (``tests/stand_in_backend.py``), alternated ``--repeats`` times:

- ``direct``: one frontend, the clients connect to it;
- ``lb-1``: the same behind nginx;
- ``lb-N``: N frontends behind nginx, which takes them in turn.

nginx runs with the proxy settings of compose's load balancer (``deploy/nginx.conf``'s
``location /`` block: no buffering, HTTP/1.1 upstream), its upstream the frontends' ports instead
of Docker's DNS name. Per run: the frontends' CPU per streamed token (summed over them), nginx's,
tokens/s and the inter-event latency p50/p99 as the clients see it; ``lb-1`` minus ``direct`` is
what the balancer adds. Needs ``nginx`` on the PATH (Debian: ``apt-get install nginx``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from frontend_capacity import (DEFAULT_TOKENIZER, REPO_ROOT, WORKLOADS, drive, format_row, free_port,
                               requests_for, start_frontend, start_stand_in, stop, tiny_tokenizer, wait_healthy)

COMPOSE_NGINX_CONF = REPO_ROOT / "deploy" / "nginx.conf"


def compose_proxy_settings(conf: Path = COMPOSE_NGINX_CONF) -> list[str]:
    """The directives of the compose balancer's ``location /`` block, but where it proxies to."""
    block = re.search(r"location / \{(.*?)\n    \}", conf.read_text(), re.S)
    if block is None:
        raise RuntimeError(f"no `location /` block in {conf}")
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith(("set ", "proxy_pass "))]


def start_nginx(upstream_ports: list[int], directory: Path, timeout: float = 20.0) -> tuple[subprocess.Popen, str]:
    """nginx in the foreground, balancing over 127.0.0.1:``upstream_ports``; it and its base URL."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    port = free_port()
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstream_ports)
    settings = "\n".join(f"            {line}" for line in compose_proxy_settings())
    directory.chmod(0o755)  # nginx's workers drop root's rights, and read their files here
    temp = {name: directory / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    (directory / "nginx.conf").write_text(f"""daemon off;
worker_processes auto;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {temp['body']};
    proxy_temp_path {temp['proxy']};
    fastcgi_temp_path {temp['fastcgi']};
    uwsgi_temp_path {temp['uwsgi']};
    scgi_temp_path {temp['scgi']};
    upstream frontends {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 64m;
        location / {{
            proxy_pass http://frontends;
{settings}
        }}
    }}
}}
""")
    proc = subprocess.Popen([nginx, "-p", str(directory), "-c", str(directory / "nginx.conf")])
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", timeout, "nginx", log=directory / "error.log")


def nginx_pids(master: subprocess.Popen) -> list[int]:
    """The master and its workers."""
    children = Path(f"/proc/{master.pid}/task/{master.pid}/children")
    return [master.pid, *map(int, children.read_text().split())] if children.exists() else [master.pid]


def run_layouts(tokenizer_dir: str, num_frontends: int, workloads, concurrency: int, max_tokens: int,
                tokens_per_run: int, stream_interval: int, repeats: int, report=print) -> list[dict]:
    stand_in, backend_port = start_stand_in(tokenizer_dir, stream_interval=stream_interval)
    frontends, balancers = [], []
    rows = []
    try:
        for _ in range(num_frontends):
            frontends.append(start_frontend(backend_port, tokenizer_dir))
        with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as all_dir:
            balancers.append(start_nginx([int(frontends[0][1].rsplit(":", 1)[1])], Path(one_dir)))
            balancers.append(start_nginx([int(url.rsplit(":", 1)[1]) for _, url in frontends], Path(all_dir)))
            layouts = [("direct", frontends[0][1], [frontends[0][0].pid], []),
                       ("lb-1", balancers[0][1], [frontends[0][0].pid], nginx_pids(balancers[0][0])),
                       (f"lb-{num_frontends}", balancers[1][1], [proc.pid for proc, _ in frontends],
                        nginx_pids(balancers[1][0]))]
            for repeat in range(repeats):
                for layout, url, pids, lb_pids in layouts:
                    for workload in workloads:
                        num_requests = requests_for(workload, concurrency, tokens_per_run, max_tokens)
                        result = asyncio.run(drive(url, "stand-in", workload, concurrency, num_requests, max_tokens,
                                                   pids, stand_in.pid, lb_pids))
                        rows.append({"layout": layout, "repeat": repeat, "rpc": "GenerateStream",
                                     "stream_interval": stream_interval, **result.row()})
                        report(f"{layout:<7} {format_row(rows[-1])} "
                               f"{rows[-1].get('balancer_us_per_token', '-'):>8}")
    finally:
        for proc, _ in balancers:
            stop(proc)
        for proc, _ in frontends:
            stop(proc)
        stop(stand_in)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None,
                        help=f"tokenizer directory (default: {DEFAULT_TOKENIZER} if present, else the tests' tiny BPE)")
    parser.add_argument("--frontends", type=int, default=2, help="frontends behind the balancer in the lb-N layout")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent clients")
    parser.add_argument("--workloads", default="chat-stream", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    parser.add_argument("--tokens-per-run", type=int, default=16384)
    parser.add_argument("--stream-interval", type=int, default=1, help="the stand-in's tokens per response")
    parser.add_argument("--repeats", type=int, default=2, help="times the three layouts run, alternated")
    parser.add_argument("--json", default=None, help="write the rows and the conditions here")
    args = parser.parse_args(argv)
    if args.frontends < 1:
        parser.error("--frontends must be at least 1")
    workloads = [WORKLOADS[name] for name in args.workloads.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None:
            tokenizer_dir = str(DEFAULT_TOKENIZER) if DEFAULT_TOKENIZER.is_dir() else tiny_tokenizer(Path(scratch))
        print(f"tokenizer {tokenizer_dir}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        print("layout  (frontend_capacity's columns)  nginx µs/tok")
        rows = run_layouts(tokenizer_dir, args.frontends, workloads, args.concurrency, args.max_tokens,
                           args.tokens_per_run, args.stream_interval, args.repeats)
    if args.json:
        conditions = {"tokenizer": tokenizer_dir, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                      "max_tokens": args.max_tokens, "frontends": args.frontends, "concurrency": args.concurrency}
        Path(args.json).write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
