"""Acceptance: the openai SDK's embeddings.create against a live `tandem serve` (the tiny random
Llama, fp32): vectors equal HF transformers' final hidden states pooled the same way."""

from __future__ import annotations

import base64
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch

from test_cli_serve import REPO_ROOT, stop, wait_until_serving
from helpers import free_port

MAX_MODEL_LEN = 64
HIDDEN_SIZE = 64  # tests/conftest.py's tiny Llama
TEXTS = ["The capital of France is Paris.", "def add(a, b):", "hello"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    model_dir = tiny_checkpoint("llama")
    log = tmp_path_factory.mktemp("embeddings") / "serve.log"
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    # A 16-token step budget: the longer inputs are computed in chunks.
    command = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--dtype", "float32",
               "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--max-num-batched-tokens", "16"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(process, log)
        yield f"http://127.0.0.1:{port}", str(model_dir)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(server):
    """(tokenizer, model): HF's AutoModel, whose last_hidden_state is after the final norm, as the engine's."""
    from transformers import AutoModel, AutoTokenizer

    return (AutoTokenizer.from_pretrained(server[1]),
            AutoModel.from_pretrained(server[1], torch_dtype=torch.float32).eval())


def hf_vector(hf, token_ids: list[int], pooling: str = "last", normalize: bool = True) -> np.ndarray:
    with torch.no_grad():
        hidden = hf[1](torch.tensor([token_ids])).last_hidden_state[0]  # [len, hidden]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.numpy()


@pytest.mark.timeout(300)
def test_sdk_embeddings_equal_hf_pooled_hidden_states(client, server, hf):
    # The SDK asks for base64 and decodes it when encoding_format is not given.
    response = client.embeddings.create(model=server[1], input=TEXTS)
    token_ids = [hf[0](text)["input_ids"] for text in TEXTS]
    assert [d.index for d in response.data] == [0, 1, 2]
    for ids, item in zip(token_ids, response.data):
        assert len(item.embedding) == HIDDEN_SIZE
        np.testing.assert_allclose(item.embedding, hf_vector(hf, ids), atol=1e-3, rtol=0)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, token_ids))

    # Floats; token-ID inputs; one input alone; mean pooling and no normalization (Tandem's/vLLM's fields).
    floats = client.embeddings.create(model=server[1], input=token_ids, encoding_format="float",
                                      dimensions=HIDDEN_SIZE, user="someone")
    for item, encoded in zip(floats.data, response.data):
        np.testing.assert_allclose(item.embedding, encoded.embedding, atol=1e-6, rtol=0)
    single = client.embeddings.create(model=server[1], input=token_ids[1], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, hf_vector(hf, token_ids[1]), atol=1e-3, rtol=0)
    mean = client.embeddings.create(model=server[1], input=TEXTS[0], encoding_format="float",
                                    extra_body={"pooling_type": "mean", "normalize": False})
    np.testing.assert_allclose(mean.data[0].embedding, hf_vector(hf, token_ids[0], "mean", False), atol=1e-3,
                               rtol=0)
    assert abs(np.linalg.norm(mean.data[0].embedding) - 1.0) > 1e-2  # really not normalized
    cls = client.embeddings.create(model=server[1], input=TEXTS, encoding_format="float",
                                   extra_body={"pooling_type": "cls"})
    for ids, item in zip(token_ids, cls.data):
        np.testing.assert_allclose(item.embedding, hf_vector(hf, ids, "cls"), atol=1e-3, rtol=0)


@pytest.mark.timeout(300)
def test_base64_is_little_endian_float32_of_the_float_answer(server):
    url = server[0] + "/v1/embeddings"
    floats = httpx.post(url, json={"input": "hello", "encoding_format": "float"}, timeout=60).json()
    encoded = httpx.post(url, json={"input": "hello", "encoding_format": "base64"}, timeout=60).json()
    assert encoded["object"] == "list" and encoded["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("body, param", [
    ({"input": "hello", "dimensions": 32}, "dimensions"),
    ({"input": "hello", "dimensions": 0}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": list(range(1, MAX_MODEL_LEN + 1))}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hello", "pooling_type": "step"}, "pooling_type"),  # vLLM's, not Tandem's
    ({"input": "hello", "unknown_field": 1}, "unknown_field"),
])
def test_refusals_are_400s_naming_the_field(server, body, param):
    # The backend's model info gives the hidden size: a wrong ``dimensions`` is refused before any work.
    response = httpx.post(server[0] + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "BadRequestError" or error["type"] == "invalid_request_error", error


@pytest.mark.timeout(300)
def test_sdk_errors(client, server):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=server[1], input="hello", dimensions=HIDDEN_SIZE + 1)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hello")


@pytest.mark.timeout(300)
def test_pooling_score_and_rerank_are_built_on_the_same_vectors(server, hf):
    """/pooling gives /v1/embeddings' vectors; /score and /rerank the cosine of HF's pooled vectors."""
    base = server[0]
    embedded = httpx.post(base + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"}, timeout=60).json()
    pooled = httpx.post(base + "/pooling", json={"input": TEXTS}, timeout=60).json()
    for item, expected in zip(pooled["data"], embedded["data"]):
        np.testing.assert_allclose(item["data"], expected["embedding"], atol=1e-6, rtol=0)
    vectors = [hf_vector(hf, hf[0](text)["input_ids"]) for text in TEXTS]  # unit length

    scores = httpx.post(base + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60).json()
    np.testing.assert_allclose([item["score"] for item in scores["data"]],
                               [float(vectors[0] @ vector) for vector in vectors], atol=1e-3, rtol=0)
    assert scores["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)

    reranked = httpx.post(base + "/v1/rerank", json={"query": TEXTS[1], "documents": TEXTS, "top_n": 2},
                          timeout=60).json()
    expected = sorted(range(len(TEXTS)), key=lambda j: -float(vectors[1] @ vectors[j]))[:2]
    assert [result["index"] for result in reranked["results"]] == expected == [1, expected[1]]
    assert [result["document"]["text"] for result in reranked["results"]] == [TEXTS[j] for j in expected]
