"""Acceptance: schemathesis fuzzes the served /openapi.json of a live `tandem serve` (tiny model): no 5xx.

Bounded: a fixed number of examples per operation (about 20 operations) and a wall-clock limit.
"""

from __future__ import annotations

import re
import subprocess
import sys

from test_cli_serve import served  # noqa: F401 -- the module's one `tandem serve` (tiny random Llama)

EXAMPLES_PER_OPERATION = 25


def test_no_server_error_on_the_served_schema(served, tmp_path):  # noqa: F811
    schema_url = f"{served.base_url}/openapi.json"
    command = [sys.executable, "-m", "schemathesis.cli", "run", schema_url, "--checks", "not_a_server_error",
               "--max-examples", str(EXAMPLES_PER_OPERATION), "--request-timeout", "120",
               "--exclude-path", "/metrics", "--seed", "1", "--no-color"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated.group(1)) >= 200, report  # the acceptance's floor
