"""The gRPC contract (protos/tandem/engine/v1/engine.proto) and its Python stubs.

Checks that the checked-in stubs are fresh, that every element of the contract
is documented and named by buf's conventions, that messages survive a
round trip, and that the proto stays in step with backend/types/ (sampling_params.py, outputs.py).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, ModelInfo
from backend.types.sampling_params import SamplingParams
from protos import generate
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]

# SamplingParams fields the frontend applies on text, so they never cross the wire.
FRONTEND_ONLY_SAMPLING_FIELDS = {"stop", "skip_special_tokens", "spaces_between_special_tokens",
                                 "include_stop_str_in_output"}


@pytest.fixture(scope="module")
def proto_file(tmp_path_factory) -> descriptor_pb2.FileDescriptorProto:
    """engine.proto compiled with its comments (the stubs drop them)."""
    out = tmp_path_factory.mktemp("descriptor") / "engine.binpb"
    assert protoc.main(["protoc", f"--proto_path={generate.PROTO_ROOT}", "--include_source_info",
                        f"--descriptor_set_out={out}", str(generate.PROTO_ROOT / generate.PROTO_FILE)]) == 0
    (compiled,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return compiled


# Source-info paths (descriptor.proto field numbers) of the elements that need a doc comment.
_MESSAGE, _FIELD, _NESTED, _ENUM, _ENUM_VALUE, _SERVICE, _METHOD = 4, 2, 3, 5, 2, 6, 2
_SYNTAX = 12


def _documentable_paths(proto_file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Source path -> readable name of every message, field, enum, enum value, service and method."""
    paths: dict[tuple[int, ...], str] = {}

    def add_message(message: descriptor_pb2.DescriptorProto, path: tuple[int, ...]) -> None:
        paths[path] = f"message {message.name}"
        for i, field in enumerate(message.field):
            paths[path + (_FIELD, i)] = f"field {message.name}.{field.name}"
        for i, nested in enumerate(message.nested_type):
            if not nested.options.map_entry:  # a map field's entry type: protoc's, no source to comment
                add_message(nested, path + (_NESTED, i))
        for i, enum in enumerate(message.enum_type):
            add_enum(enum, path + (_ENUM, i))

    def add_enum(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]) -> None:
        paths[path] = f"enum {enum.name}"
        for i, value in enumerate(enum.value):
            paths[path + (_ENUM_VALUE, i)] = f"enum value {value.name}"

    for i, message in enumerate(proto_file.message_type):
        add_message(message, (_MESSAGE, i))
    for i, enum in enumerate(proto_file.enum_type):
        add_enum(enum, (_ENUM, i))
    for i, service in enumerate(proto_file.service):
        paths[(_SERVICE, i)] = f"service {service.name}"
        for j, method in enumerate(service.method):
            paths[(_SERVICE, i, _METHOD, j)] = f"rpc {service.name}.{method.name}"
    return paths


def test_checked_in_stubs_are_fresh():
    result = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_freshness_check_names_edited_and_missing_stubs(tmp_path):
    for path in generate.all_stub_paths():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(generate.PROTO_ROOT / path, tmp_path / path)
    assert generate.stale_stubs(tmp_path) == []

    with open(tmp_path / "tandem/engine/v1/engine_pb2_grpc.py", "a") as f:
        f.write("# hand edit\n")
    (tmp_path / "grpc/reflection/v1/reflection_pb2.pyi").unlink()
    assert generate.stale_stubs(tmp_path) == ["tandem/engine/v1/engine_pb2_grpc.py",
                                              "grpc/reflection/v1/reflection_pb2.pyi"]


def test_reflection_v1_is_v1alpha_under_a_new_package():
    """Same messages, fields, numbers, types and oneofs: the servicer converts by bytes."""
    from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

    from protos.grpc.reflection.v1 import reflection_pb2 as v1

    def shape(file_descriptor, package):
        proto = descriptor_pb2.FileDescriptorProto()
        file_descriptor.CopyToProto(proto)
        for field_name in ("name", "package", "options"):
            proto.ClearField(field_name)
        for message in proto.message_type:
            for field in message.field:
                field.type_name = field.type_name.removeprefix(package)
        for method in proto.service[0].method:
            method.input_type = method.input_type.removeprefix(package)
            method.output_type = method.output_type.removeprefix(package)
        return proto

    assert v1.DESCRIPTOR.name == "grpc/reflection/v1/reflection.proto"
    assert shape(v1.DESCRIPTOR, ".grpc.reflection.v1.") == shape(v1alpha.DESCRIPTOR, ".grpc.reflection.v1alpha.")


def test_descriptor_file_name_matches_the_package_path():
    # buf, reflection and other languages all know the file by this name.
    assert engine_pb2.DESCRIPTOR.name == "tandem/engine/v1/engine.proto"
    assert engine_pb2.DESCRIPTOR.package == "tandem.engine.v1"


def test_every_element_has_a_leading_doc_comment(proto_file):
    comments = {tuple(loc.path): loc.leading_comments.strip() for loc in proto_file.source_code_info.location}
    paths = _documentable_paths(proto_file)
    assert len(paths) > 60  # the walk really reached the fields
    undocumented = [name for path, name in paths.items() if not comments.get(path)]
    assert undocumented == []


def test_file_comment_states_the_streaming_contract_and_error_codes(proto_file):
    (syntax_location,) = [loc for loc in proto_file.source_code_info.location if list(loc.path) == [_SYNTAX]]
    file_comment = "\n".join(syntax_location.leading_detached_comments) + syntax_location.leading_comments
    for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "CANCELLED"):
        assert code in file_comment
    assert "Streaming contract of Generate" in file_comment


def test_enum_values_are_prefixed_and_zero_is_unspecified():
    for enum in engine_pb2.DESCRIPTOR.enum_types_by_name.values():
        prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum.name).lstrip("_") + "_"
        assert all(value.name.startswith(prefix) for value in enum.values), enum.name
        assert enum.values_by_number[0].name == prefix + "UNSPECIFIED"


def test_finish_reasons_mirror_the_backend():
    proto_names = set(engine_pb2.FinishReason.keys()) - {"FINISH_REASON_UNSPECIFIED"}
    assert proto_names == {f"FINISH_REASON_{reason.name}" for reason in FinishReason}


def test_sampling_params_mirror_the_backend_except_text_only_fields():
    backend_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    proto_fields = set(engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    # pooling is set by the engine's embed path (Embed's EmbedRequest carries it), never by Generate.
    assert proto_fields == backend_fields - FRONTEND_ONLY_SAMPLING_FIELDS - {"pooling"}


def test_optional_marks_exactly_the_fields_whose_unset_differs_from_zero():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for name, field in engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name.items():
        if field.is_repeated:
            continue
        zero = defaults[name] is not None and not defaults[name]
        assert field.has_presence == (not zero), name

    params = engine_pb2.SamplingParams()
    assert not params.HasField("temperature")
    params.temperature = 0.0  # greedy, not "unset"
    assert engine_pb2.SamplingParams.FromString(params.SerializeToString()).HasField("temperature")


def test_outputs_mirror_engine_output_model_info_and_load():
    response_fields = set(engine_pb2.GenerateResponse.DESCRIPTOR.fields_by_name)
    # request_id is the call's; EngineOutput.stop_reason is named for what it holds.
    engine_output_fields = {f.name for f in dataclasses.fields(EngineOutput)} - {"request_id"}
    engine_output_fields = engine_output_fields - {"stop_reason"} | {"stop_token_id"}
    # A request that failed in the engine ends its call with status INTERNAL: no field carries it.
    engine_output_fields -= {"error"}
    # An embedding's pooled vector comes back in EmbedResponse, not in a GenerateResponse.
    engine_output_fields -= {"pooled"}
    # The first schedule's time is the backend's monotonic clock, read by its own metrics only.
    engine_output_fields -= {"scheduled_time"}
    # Marks a response that carries a part of the prompt logprobs; the frontend joins the parts
    # into one EngineOutput (frontend.proto_convert.OutputReader).
    assert response_fields == engine_output_fields | {"num_completion_tokens", "prompt_logprobs_continued"}

    info_fields = set(engine_pb2.GetModelInfoResponse.DESCRIPTOR.fields_by_name)
    # tokenizer_path is local to the backend; GetTokenizer sends the files instead.
    assert {f.name for f in dataclasses.fields(ModelInfo)} - {"tokenizer_path"} <= info_fields

    load_fields = set(engine_pb2.GetLoadResponse.DESCRIPTOR.fields_by_name)
    assert load_fields == {f.name for f in dataclasses.fields(EngineLoad)}


def _set_fields(message) -> set[str]:
    return {field.name for field, _ in message.ListFields()}


def test_generate_request_with_every_field_set_round_trips():
    params = engine_pb2.SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, seed=-(2**40),
        presence_penalty=-0.5, frequency_penalty=1.5, repetition_penalty=1.1,
        max_tokens=128, min_tokens=4, stop_token_ids=[2, 50256], ignore_eos=True,
        logprobs=0, prompt_logprobs=5, logprob_token_ids=[7, 9], use_beam_search=True, length_penalty=0.5,
        logit_bias={7: -100.0, 2**32 - 1: 2.5},
        structured_outputs=engine_pb2.StructuredOutputs(
            choice=engine_pb2.Choice(choices=["yes", "no"]), disable_any_whitespace=True),
    )
    request = engine_pb2.GenerateRequest(request_id="cmpl-1", prompt_token_ids=[1, 4093, 2**32 - 1],
                                         sampling_params=params, cache_salt="tenant-a",
                                         accept_split_prompt_logprobs=True)
    assert _set_fields(params) == set(engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert _set_fields(request) == set(engine_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)

    parsed = engine_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    # Doubles carry Python floats exactly, so the backend validates what the frontend did.
    assert parsed.sampling_params.temperature == 0.7
    assert parsed.sampling_params.HasField("logprobs") and parsed.sampling_params.logprobs == 0


def test_generate_response_with_every_field_set_round_trips():
    def position(token_id: int) -> engine_pb2.PositionLogprobs:
        return engine_pb2.PositionLogprobs(
            token=engine_pb2.Logprob(token_id=token_id, logprob=-0.25, rank=2),
            top_logprobs=[engine_pb2.Logprob(token_id=7, logprob=-0.125, rank=1)],
        )

    response = engine_pb2.GenerateResponse(
        index=1, new_token_ids=[11, 12], new_logprobs=[position(11), position(12)],
        finish_reason=engine_pb2.FINISH_REASON_STOP, stop_token_id=12,
        num_prompt_tokens=3, num_cached_tokens=2, num_completion_tokens=2,
        prompt_logprobs=engine_pb2.PromptLogprobs(positions=[position(4093), position(5)]),
        prompt_logprobs_continued=True,
    )
    assert _set_fields(response) == set(engine_pb2.GenerateResponse.DESCRIPTOR.fields_by_name)
    assert engine_pb2.GenerateResponse.FromString(response.SerializeToString()) == response

    running = engine_pb2.GenerateResponse.FromString(engine_pb2.GenerateResponse(index=0).SerializeToString())
    assert running.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED
    assert not running.HasField("stop_token_id") and not running.HasField("prompt_logprobs")


class _EchoEngine(engine_pb2_grpc.EngineServiceServicer):
    """Streams each prompt token back as one step, to exercise the stubs over a real channel."""

    def Generate(self, request, context):
        for step, token_id in enumerate(request.prompt_token_ids, start=1):
            last = step == len(request.prompt_token_ids)
            yield engine_pb2.GenerateResponse(
                new_token_ids=[token_id], num_completion_tokens=step,
                finish_reason=engine_pb2.FINISH_REASON_LENGTH if last else engine_pb2.FINISH_REASON_UNSPECIFIED)


@pytest.fixture
def echo_server():
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineServiceServicer_to_server(_EchoEngine(), server)
    service_name = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
    health_servicer = health.HealthServicer()
    health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(grace=None)


def test_stubs_stream_generate_and_serve_beside_health_and_reflection(echo_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    stub = engine_pb2_grpc.EngineServiceStub(echo_server)
    responses = list(stub.Generate(engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[5, 6, 7]),
                                   timeout=10))
    assert [list(r.new_token_ids) for r in responses] == [[5], [6], [7]]
    assert [r.finish_reason for r in responses] == [0, 0, engine_pb2.FINISH_REASON_LENGTH]

    # Unimplemented RPCs answer UNIMPLEMENTED, as the generated base class promises.
    with pytest.raises(grpc.RpcError) as error:
        stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED

    health = health_pb2_grpc.HealthStub(echo_server).Check(
        health_pb2.HealthCheckRequest(service="tandem.engine.v1.EngineService"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    # A client with nothing but the address finds the contract by reflection, under buf's file name.
    reflected = ProtoReflectionDescriptorDatabase(echo_server).FindFileContainingSymbol(
        "tandem.engine.v1.EngineService")
    assert reflected.name == "tandem/engine/v1/engine.proto"
    assert [m.name for m in reflected.service[0].method] == [
        "Generate", "Abort", "GetModelInfo", "GetTokenizer", "GetLoad", "GetMetrics", "GenerateStream", "Embed",
        "PutStoredResponse", "GetStoredResponse", "DeleteStoredResponse"]
