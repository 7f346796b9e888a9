"""Acceptance: schemathesis fuzzes the served /openapi.json of a live `tandem serve` (tiny model).

No 5xx, and no schema violation: every answer's status, content type, headers and JSON body are
the documented ones, values outside the schema are refused (negative data), a wrong method gets 405
with ``Allow``. Generation requests reach 200 (counted on the server's /metrics). Not checked:
that every schema-valid body is accepted, since some rules span fields and the schema cannot state
them (a prompt plus max_tokens within the context, a tool_choice naming one of the tools).

Bounded: the schema's examples and the fuzzing phase, a fixed number of examples per operation (about 20 operations),
a fixed seed and a wall-clock limit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from test_cli_serve import served  # noqa: F401 -- the module's one `tandem serve` (tiny random Llama)

EXAMPLES_PER_OPERATION = 3
# Every check but positive_data_acceptance (above) and max_response_time (speed is never asserted).
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_headers_conformance",
          "response_schema_conformance", "negative_data_rejection", "missing_required_header", "unsupported_method",
          "allow_header_conformance", "use_after_free", "ensure_resource_availability")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def answers_by_route(base_url: str) -> dict[tuple[str, str], float]:
    """(route, status) -> the server's count of HTTP answers (tandem:http_requests)."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tandem:http_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["route"], sample.labels["status"])
                    counts[key] = counts.get(key, 0) + sample.value
    return counts


def test_the_served_schema_holds_under_fuzzing(served, tmp_path):  # noqa: F811
    before = answers_by_route(served.base_url)
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{served.base_url}/openapi.json",
               "--checks", ",".join(CHECKS),
               "--phases", "examples,fuzzing", "--max-examples", str(EXAMPLES_PER_OPERATION),
               "--request-timeout", "120", "--exclude-path", "/metrics", "--suppress-health-check", "filter_too_much",
               "--seed", "1", "--workers", "1", "--no-color"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    generated = re.search(r"(\d+) generated", report)
    assert generated and int(generated.group(1)) >= 50, report

    after = answers_by_route(served.base_url)
    for route in GENERATION_ROUTES:
        assert after.get((route, "200"), 0) > before.get((route, "200"), 0), f"{route}: {sorted(after.items())}"
    assert not any(status.startswith("5") for _, status in after), after
