"""The served /openapi.json says what the routes accept and answer (frontend/openapi.py, frontend/protocol/).

Ranges come from the request models and the app's settings, refused fields are left out, errors
are documented as the app gives them (400, never FastAPI's 422), and 200 bodies are described.
tests/test_schemathesis.py fuzzes the live server against this schema.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from conftest import TINY_VOCAB
from fake_engine import MAX_MODEL_LEN, MODEL, assert_openai_error, engine, tokenizer, tokenizer_dir  # noqa: F401

from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.protocol import UNSUPPORTED_FIELDS

LIMITS = Limits(max_n=7, max_logprobs=5, max_logit_bias=9)
REF = "#/components/schemas/"


@pytest.fixture
def client(engine, tokenizer):  # noqa: F811
    app = create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]), limits=LIMITS)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def schema(client) -> dict:
    return client.get("/openapi.json").json()


def test_sampling_ranges_come_from_the_models_and_the_settings(schema):
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schema["components"]["schemas"][name]["properties"]
        assert (fields["n"]["minimum"], fields["n"]["maximum"]) == (1, LIMITS.max_n)
        assert fields["temperature"]["minimum"] == 0
        assert (fields["top_p"]["exclusiveMinimum"], fields["top_p"]["maximum"]) == (0, 1)
        assert (fields["presence_penalty"]["minimum"], fields["presence_penalty"]["maximum"]) == (-2, 2)
        assert fields["max_tokens"]["maximum"] == MAX_MODEL_LEN
        assert fields["prompt_logprobs"]["maximum"] == LIMITS.max_logprobs
        assert fields["logit_bias"]["maxProperties"] == LIMITS.max_logit_bias
        assert fields["logit_bias"]["additionalProperties"]["maximum"] == 100
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert (completion["logprobs"]["minimum"], completion["logprobs"]["maximum"]) == (-1, LIMITS.max_logprobs)
    assert schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["top_logprobs"]["maximum"] == 5


@pytest.mark.parametrize("field, value", [("n", 8), ("n", 0), ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5),
                                          ("presence_penalty", 2.5), ("max_tokens", MAX_MODEL_LEN + 1),
                                          ("logprobs", 6), ("stream", 0), ("n", "2"), ("echo", "true")])
def test_values_outside_the_schema_are_400s_naming_the_field(client, engine, field, value):  # noqa: F811
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
    assert_openai_error(response, 400, "BadRequestError", field)
    assert engine.requests == []


def test_refused_fields_are_not_listed(schema):
    for name in ("CompletionRequest", "ChatCompletionRequest", "ScoreRequest", "RerankRequest"):
        properties = schema["components"]["schemas"][name]["properties"]
        assert "model" in properties
        refused = set(UNSUPPORTED_FIELDS) - ({"documents"} if name == "RerankRequest" else set())  # rerank's own
        assert set(properties).isdisjoint(refused), name
        assert set(properties).isdisjoint({"use_activation", "softmax", "activation"}), name


def test_errors_are_documented_as_answered(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            answers = operation["responses"]
            assert "422" not in answers, (method, path)
            if "requestBody" in operation:
                assert {"400", "413"} <= set(answers), (method, path)
                error = answers["400"]["content"]["application/json"]["schema"]["$ref"]
                shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
                assert error == REF + shape, (method, path)
    assert {"429", "503"} <= set(schema["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_200_bodies_are_described(schema):
    for path, model in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionResponse")):
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": REF + model}
        assert "text/event-stream" in content  # with stream
    invocations = schema["paths"]["/invocations"]["post"]
    assert len(invocations["requestBody"]["content"]["application/json"]["schema"]["anyOf"]) == 2
    assert "content" not in schema["paths"]["/health"]["get"]["responses"]["200"]  # no body


def test_a_wrong_method_lists_every_allowed_one(client):
    response = client.request("OPTIONS", "/v1/responses/resp_1")
    assert response.status_code == 405
    assert response.headers["Allow"] == "DELETE, GET"
