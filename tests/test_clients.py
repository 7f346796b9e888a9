"""Acceptance: clients from PyPI against one live `tandem serve` (a tiny random Llama, fp32).

openai (structured outputs, tool calls), LangChain's ChatOpenAI, LlamaIndex's OpenAILike and
lm-eval's local-completions with the remote tokenizer. The model's weights are random, so every
well-formed structured reply is the constraint's doing; schemas are bounded (string lengths,
number ranges, item counts) so greedy replies end. Every generation is bounded (max_tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest

from test_cli_serve import REPO_ROOT, stop, wait_until_serving
from helpers import free_port

MAX_MODEL_LEN = 4096  # the tools' system prompt is long in the tiny vocabulary
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "1024"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "integer", "minimum": -99,
                                                                     "maximum": 99}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"]}}, "required": ["user"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "done": {"type": "boolean"},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["title", "done", "priority"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny Llama, with room for a 4k context (rotary positions: nothing learned per position)."""
    target = tmp_path_factory.mktemp("tiny-llama-4k")
    shutil.copytree(tiny_checkpoint("llama"), target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("clients")
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log = work_dir / "serve.log"
    command = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), *ENGINE_FLAGS]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(process, log)
        yield f"http://127.0.0.1:{port}", str(model_dir), log
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server[1]


# Sampled, seeded: greedy decoding of random weights can loop on a token (a JSON whitespace);
# a seeded draw among the allowed tokens ends and is still reproducible.
SAMPLED = {"temperature": 1.0, "seed": 7}


def ask(client, model, content: str, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=kwargs.pop("max_tokens", 300), **SAMPLED, **kwargs)


# ---- openai -------------------------------------------------------------------------------------


def test_json_schema_outputs_parse_and_validate(client, model):
    for i, schema in enumerate(SCHEMAS):
        response = ask(client, model, f"Give an example as JSON ({', '.join(schema['required'])}).",
                       response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        document = json.loads(response.choices[0].message.content)
        jsonschema.validate(document, schema)


def test_regex_and_choice_are_obeyed(client, model):
    text = ask(client, model, "A US zip code?", extra_body={"structured_outputs": {"regex": r"[0-9]{5}"}}
               ).choices[0].message.content
    assert len(text) == 5 and text.isdigit()
    choice = ask(client, model, "Is the sky blue?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
                 ).choices[0].message.content
    assert choice in ("yes", "no")


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": "(unclosed"}},
                                   {"response_format": {"type": "json_schema", "json_schema": {
                                       "name": "bad", "schema": {"type": "nonsense"}}}}])
def test_invalid_schema_or_regex_is_a_400(client, model, extra):
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, "Hi", extra_body=extra)
    assert "structured_outputs" in str(error.value) or "response_format" in str(error.value)


def test_forced_tool_call_streamed_and_followed_up(client, model):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[WEATHER],
                                              tool_choice=forced, max_tokens=300, **SAMPLED)
    (call,) = response.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert call.function.name == "get_weather"

    required = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[WEATHER],
                                              tool_choice="required", max_tokens=300, **SAMPLED)
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"

    name, pieces = None, ""
    for chunk in client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[WEATHER],
                                                tool_choice=forced, max_tokens=300, stream=True, **SAMPLED):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name = delta_call.function.name or name
            pieces += delta_call.function.arguments or ""
    assert name == "get_weather" and json.loads(pieces) == arguments

    follow_up = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model=model, messages=follow_up, tools=[WEATHER], max_tokens=30,
                                            **SAMPLED)
    assert answer.choices[0].message.content is not None or answer.choices[0].message.tool_calls


# ---- LangChain ----------------------------------------------------------------------------------


def test_langchain_chat_openai(server, model):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(base_url=server[0] + "/v1", api_key="unused", model=model, temperature=1.0, seed=7,
                     max_tokens=300, max_retries=0, stream_usage=True)
    assert isinstance(llm.invoke("Say hello.").content, str)
    chunks = list(llm.stream("Count to three."))
    assert "".join(c.content for c in chunks)
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] > 0

    @tool
    def get_weather(city: Literal["Paris", "London", "Rome"]) -> str:
        """The current weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "London", "Rome")

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Invent a person.")
        assert isinstance(person, Person), method


# ---- LlamaIndex ---------------------------------------------------------------------------------


@pytest.mark.parametrize("is_chat_model", [False, True])
def test_llama_index_openai_like(server, model, is_chat_model):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=model, api_base=server[0] + "/v1", api_key="unused", is_chat_model=is_chat_model,
                     max_tokens=20, temperature=0, max_retries=0, context_window=2048)
    assert isinstance(llm.complete("The capital of France is").text, str)
    messages = [ChatMessage(role="user", content="Say hi.")]
    assert isinstance(llm.chat(messages).message.content, str)
    assert "".join(piece.delta or "" for piece in llm.stream_chat(messages))


# ---- lm-eval ------------------------------------------------------------------------------------

TASK = """task: tandem_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
{extra}
metric_list:
  - metric: {metric}
"""


def test_lm_eval_remote_tokenizer_matches_hf(server, model, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "The capital of France is", "answer": " Paris"}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_ll.yaml").write_text(TASK.format(data=data, output_type="loglikelihood", extra="",
                                                    metric="acc").replace("tandem_tiny", "tandem_ll"))
    (tasks / "tiny_gen.yaml").write_text(TASK.format(
        data=data, output_type="generate_until", metric="exact_match",
        extra='generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false').replace(
        "tandem_tiny", "tandem_gen"))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", "tandem_ll,tandem_gen",
         "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
         "--model_args", f"model={model},base_url={server[0]}/v1/completions,tokenizer_backend=remote,"
                         "num_concurrent=1,max_retries=1,tokenized_requests=True"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"})  # no network here
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert "acc,none" in results["tandem_ll"] and "exact_match,none" in results["tandem_gen"]
    samples = [json.loads(line) for line in next(out.rglob("samples_tandem_ll_*.jsonl")).read_text().splitlines()]
    served = float(samples[0]["filtered_resps"][0][0])  # [logprob, is_greedy], logged as strings
    assert abs(served - hf_loglikelihood(model, "The capital of France is", " Paris")) < 1e-2


def hf_loglikelihood(model_dir: str, context: str, continuation: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    whole = tokenizer.encode(context + continuation)
    num_context = len(tokenizer.encode(context))
    with torch.no_grad():
        logprobs = hf(torch.tensor([whole])).logits[0].log_softmax(-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(num_context, len(whole)))
