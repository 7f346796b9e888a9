"""/pooling, /score and /rerank (frontend/serving/scoring.py, frontend/serving/embeddings.py) against a fake
engine whose vectors are bags of tokens: texts that share tokens score higher.

Every score is checked against the cosine of the vectors /v1/embeddings returns for the same texts,
so the endpoints cannot drift from the embeddings they are built on.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fake_engine import (MAX_MODEL_LEN, MODEL, FakeEngine, assert_openai_error, make_client, tokenizer,  # noqa: F401
                             tokenizer_dir)

from backend.types.limits import Limits

DIMENSIONS = 16
TEXTS = ["The capital of France is Paris.", "Paris is in France.", "The largest ocean is the Pacific Ocean.",
         "hello"]
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")


class BagOfTokensEngine(FakeEngine):
    """Embeds a prompt as the counts of its token IDs modulo ``DIMENSIONS`` (no two texts here alike)."""

    async def embed(self, request_id, prompt_token_ids, pooling, *, deadline=None):
        self.requests.append((request_id, list(prompt_token_ids), pooling))
        if self.fail_before_first is not None:
            raise self.fail_before_first
        vector = [0.0] * DIMENSIONS
        for token in prompt_token_ids:
            vector[token % DIMENSIONS] += 1.0
        return vector


@pytest.fixture
def engine(tokenizer) -> BagOfTokensEngine:
    return BagOfTokensEngine(tokenizer)


@pytest.fixture
def client(engine, tokenizer):
    with make_client(engine, tokenizer) as test_client:
        yield test_client


def embeddings(client, texts: list[str]) -> list[np.ndarray]:
    response = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
    assert response.status_code == 200, response.text
    return [np.array(item["embedding"]) for item in response.json()["data"]]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def num_tokens(tokenizer, texts: list[str]) -> int:
    return sum(len(tokenizer(text)["input_ids"]) for text in texts)


# ---- /pooling -----------------------------------------------------------------------------------


def test_pooling_returns_the_embeddings_vectors(client, tokenizer):
    token_ids = tokenizer(TEXTS[1])["input_ids"]
    for body in ({"input": TEXTS}, {"input": TEXTS[0]}, {"input": token_ids}, {"input": [token_ids, token_ids[:3]]},
                 {"input": TEXTS, "pooling_type": "mean", "normalize": False}):
        expected = client.post("/v1/embeddings", json=body).json()
        pooled = client.post("/pooling", json={**body, "task": "embed"})
        assert pooled.status_code == 200, pooled.text
        answer = pooled.json()
        assert answer["id"].startswith("pool-") and answer["object"] == "list" and answer["model"] == expected["model"]
        assert [item["object"] for item in answer["data"]] == ["pooling"] * len(expected["data"])
        assert [item["index"] for item in answer["data"]] == list(range(len(expected["data"])))
        assert [item["data"] for item in answer["data"]] == [item["embedding"] for item in expected["data"]]
        assert answer["usage"] == expected["usage"]
    encoded = client.post("/pooling", json={"input": "hello", "encoding_format": "base64"}).json()
    floats = client.post("/pooling", json={"input": "hello"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["data"], dtype=np.float32))


# ---- /score -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize("text_1, text_2, pairs", [
    (TEXTS[0], TEXTS[1], [(0, 0)]),  # 1:1
    (TEXTS[0], TEXTS[1:], [(0, 0), (0, 1), (0, 2)]),  # 1:N
    ([TEXTS[0]], TEXTS[1:], [(0, 0), (0, 1), (0, 2)]),  # a list of one is one
    (TEXTS[:3], TEXTS[1:], [(0, 0), (1, 1), (2, 2)]),  # N:N, in order
    ([TEXTS[3]], TEXTS[3], [(0, 0)]),
])
def test_score_is_the_cosine_of_the_embeddings(client, engine, tokenizer, path, text_1, text_2, pairs):
    left = [text_1] if isinstance(text_1, str) else text_1
    right = [text_2] if isinstance(text_2, str) else text_2
    left_vectors, right_vectors = embeddings(client, left), embeddings(client, right)
    engine.requests.clear()
    response = client.post(path, json={"text_1": text_1, "text_2": text_2, "model": MODEL})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"].startswith("score-") and answer["object"] == "list" and answer["model"] == MODEL
    assert [item["index"] for item in answer["data"]] == list(range(len(pairs)))
    assert {item["object"] for item in answer["data"]} == {"score"}
    for item, (i, j) in zip(answer["data"], pairs):
        assert item["score"] == pytest.approx(cosine(left_vectors[i], right_vectors[j]), abs=1e-9)
    # Each text is pooled once (a shared text_1 too), normalized, with the default last-token pooling.
    assert len(engine.requests) == len(left) + len(right)
    assert {(pooling.type, pooling.normalize) for _, _, pooling in engine.requests} == {("last", True)}
    tokens = num_tokens(tokenizer, left + right)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_score_takes_the_pooling_type_and_truncation(client, engine):
    response = client.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[2], "pooling_type": "mean",
                                           "truncate_prompt_tokens": 3})
    assert response.status_code == 200, response.text
    assert [pooling.type for _, _, pooling in engine.requests] == ["mean", "mean"]
    assert [len(ids) for _, ids, _ in engine.requests] == [3, 3]
    # -1: as many tokens as an input may have (one fewer than the model's length: the engine adds one).
    engine.requests.clear()
    long_text = "Paris " * MAX_MODEL_LEN
    response = client.post("/score", json={"text_1": long_text, "text_2": "Paris", "truncate_prompt_tokens": -1})
    assert response.status_code == 200, response.text
    assert len(engine.requests[0][1]) == MAX_MODEL_LEN - 1


def test_truncation_side_right_keeps_the_first_tokens(client, engine, tokenizer):
    """vLLM's truncation_side, on /score and on /v1/embeddings (the same pooled prompts)."""
    response = client.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[2], "truncate_prompt_tokens": 3,
                                           "truncation_side": "right"})
    assert response.status_code == 200, response.text
    assert [ids for _, ids, _ in engine.requests] == [tokenizer.encode(TEXTS[0])[:3], tokenizer.encode(TEXTS[2])[:3]]
    engine.requests.clear()
    for side, kept in (("right", slice(None, 2)), ("left", slice(-2, None))):
        response = client.post("/v1/embeddings", json={"input": TEXTS[1], "truncate_prompt_tokens": 2,
                                                       "truncation_side": side})
        assert response.status_code == 200, response.text
        assert engine.requests[-1][1] == tokenizer.encode(TEXTS[1])[kept]


def test_identical_texts_score_one(client):
    answer = client.post("/score", json={"text_1": TEXTS[2], "text_2": [TEXTS[2], TEXTS[3]]}).json()
    assert answer["data"][0]["score"] == pytest.approx(1.0)
    assert answer["data"][1]["score"] < 0.99


# ---- /rerank ------------------------------------------------------------------------------------


def test_rerank_orders_documents_by_the_cosine_with_the_query(client, tokenizer):
    query, documents = TEXTS[0], TEXTS[1:] + [TEXTS[0]]
    vectors = embeddings(client, [query] + documents)
    expected = [cosine(vectors[0], vector) for vector in vectors[1:]]
    order = sorted(range(len(documents)), key=lambda j: -expected[j])
    assert order[0] == len(documents) - 1  # the query itself first, then the rest by their overlap
    answers = [client.post(path, json={"query": query, "documents": documents}) for path in RERANK_ROUTES]
    for response in answers:
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["id"].startswith("rerank-") and answer["model"] == MODEL
        assert [result["index"] for result in answer["results"]] == order
        for result in answer["results"]:
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-9)
            assert result["document"] == {"text": documents[result["index"]]}  # vLLM returns them by default
        tokens = num_tokens(tokenizer, [query] + documents)
        assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert len({tuple(r["index"] for r in a.json()["results"]) for a in answers}) == 1


@pytest.mark.parametrize("top_n, count", [(None, 4), (0, 4), (1, 1), (2, 2), (4, 4), (10, 4)])
def test_rerank_top_n(client, top_n, count):
    body = {"query": TEXTS[0], "documents": TEXTS, "return_documents": False}
    every = client.post("/rerank", json=body).json()["results"]
    response = client.post("/v1/rerank", json={**body, "top_n": top_n})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert results == every[:count]
    assert all(set(result) == {"index", "relevance_score"} for result in results)  # no document key at all
    scores = [result["relevance_score"] for result in results]
    assert scores == sorted(scores, reverse=True)


def test_rerank_ties_keep_the_documents_order(client):
    results = client.post("/rerank", json={"query": "hello", "documents": ["Paris", "hello", "Paris", "hello"]}).json()
    assert [result["index"] for result in results["results"]] == [1, 3, 0, 2]


# ---- refusals: 400s naming the field, before anything reaches the engine ------------------------

LIMIT = Limits().max_prompts_per_request
TOO_LONG = "Paris " * MAX_MODEL_LEN

REFUSALS = [
    ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": "a"}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": [1, 2], "text_2": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": [["a"]]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ["a"] * (LIMIT + 1)}, "text_2"),
    ("/score", {"text_1": ["a"] * (LIMIT + 1), "text_2": ["a"] * (LIMIT + 1)}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["a", TOO_LONG]}, "text_2"),
    ("/score", {"text_1": "", "text_2": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": True}, "use_activation"),
    ("/score", {"text_1": "a", "text_2": "b", "activation": False}, "activation"),
    ("/score", {"text_1": "a", "text_2": "b", "softmax": True}, "softmax"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority"),
    ("/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    ("/score", {"text_1": "a", "text_2": "b", "pooling_type": "step"}, "pooling_type"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/score", {"text_1": "a", "text_2": "b", "data_1": "a"}, "data_1"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "no-such-model"}, None),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"] * (LIMIT + 1)}, "documents"),
    ("/rerank", {"query": "q", "documents": "a"}, "documents"),
    ("/rerank", {"query": "q", "documents": [{"text": "a"}]}, "documents"),
    ("/rerank", {"documents": ["a"]}, "query"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": TOO_LONG, "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": ["a", TOO_LONG]}, "documents"),
    ("/v2/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v2/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 10}, "max_tokens_per_doc"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "use_activation": False}, "use_activation"),
    ("/pooling", {"input": []}, "input"),
    ("/pooling", {"input": ["a"] * (LIMIT + 1)}, "input"),
    ("/pooling", {"input": TOO_LONG}, "input"),
    ("/pooling", {"input": "a", "task": "classify"}, "task"),
    ("/pooling", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/pooling", {"input": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
]


@pytest.mark.parametrize("path, body, param", REFUSALS,
                         ids=[f"{i}-{case[0].strip('/').replace('/', '_')}" for i, case in enumerate(REFUSALS)])
def test_refusals_are_400s_naming_the_field(client, engine, path, body, param):
    response = client.post(path, json=body)
    if param is None:
        assert_openai_error(response, 404, "NotFoundError")
    else:
        assert_openai_error(response, 400, "BadRequestError", param)
    assert engine.requests == []  # refused before any engine request


def test_an_engine_error_fails_the_whole_request(client, engine):
    from backend.types.errors import InvalidRequestError

    engine.fail_before_first = InvalidRequestError("refused by the engine", param="input")
    assert_openai_error(client.post("/score", json={"text_1": "a", "text_2": ["b", "c"]}), 400, "BadRequestError")
    assert_openai_error(client.post("/rerank", json={"query": "a", "documents": ["b"]}), 400, "BadRequestError")


def test_the_schema_describes_the_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/pooling", "/score", "/v1/score", *RERANK_ROUTES):
        assert "post" in paths[path], path
    score = paths["/v1/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert score.endswith("/ScoreRequest")
