"""schemathesis against the frontend's served /openapi.json: hundreds of generated requests, valid
and invalid, on every operation; none may get a 5xx (bad input is a 4xx with OpenAI error JSON).

The app runs in process over the tests' fake engine (test_api_server.FakeEngine), reached through
its ASGI interface; examples per operation are bounded, and so is each request's time.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from backend.limits import Limits
from backend.request import ModelInfo
from conftest import TINY_VOCAB, build_tokenizer
from frontend.api_server import create_app
from frontend.tokenizer import load_tokenizer
from test_api_server import MAX_MODEL_LEN, MODEL, FakeEngine

EXAMPLES_PER_OPERATION = 40
MIN_EXAMPLES = 200
examples: dict[str, int] = {}


def make_app():
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(prefix="tandem-fuzz-"))
    build_tokenizer(directory)
    tokenizer = load_tokenizer(str(directory))
    engine = FakeEngine(tokenizer)
    return create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]),
                      limits=Limits(max_request_body_bytes=1 << 20))


schema = schemathesis.openapi.from_asgi("/openapi.json", make_app())


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case):
    response = case.call(timeout=30)
    examples[case.operation.label] = examples.get(case.operation.label, 0) + 1
    case.validate_response(response, checks=(not_a_server_error,))
    if response.status_code >= 400 and case.operation.path.startswith(("/v1", "/tokenize", "/detokenize")):
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]


def test_enough_examples_ran():
    if not examples:
        pytest.fail("the fuzz tests did not run")
    print(f"\nschemathesis: {sum(examples.values())} requests: {examples}")
    assert sum(examples.values()) >= MIN_EXAMPLES, examples
