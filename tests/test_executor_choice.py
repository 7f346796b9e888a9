"""Which executor the engine picks when none is named (as vLLM picks), and the clear error when
the ``ray`` executor is asked for without Ray installed. Config only: no worker starts."""

from __future__ import annotations

import sys
import types

import pytest

from backend.models.resolve import resolve_config
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError


def resolved(model, **kwargs) -> EngineConfig:
    return resolve_config(EngineConfig(model=str(model), dtype="float32", **kwargs))


def test_one_worker_is_uni_several_on_this_machine_mp_and_ray_once_this_process_joined_ray(
        tiny_checkpoint, monkeypatch):
    model = tiny_checkpoint("llama")
    assert resolved(model).executor_backend == "uni"
    assert resolved(model, tensor_parallel_size=2).executor_backend == "mp"
    assert resolved(model, pipeline_parallel_size=2).executor_backend == "mp"
    assert resolved(model, tensor_parallel_size=2,
                    distributed_executor_backend="external_launcher").executor_backend == "external_launcher"

    fake_ray = types.ModuleType("ray")
    fake_ray.is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert resolved(model, tensor_parallel_size=2).executor_backend == "mp"  # imported, not joined
    fake_ray.is_initialized = lambda: True
    assert resolved(model, tensor_parallel_size=2).executor_backend == "ray"
    assert resolved(model).executor_backend == "uni"  # one worker never needs a cluster


def test_an_unknown_executor_is_refused_naming_the_choices(tiny_checkpoint):
    with pytest.raises(InvalidRequestError, match="must be one of uni, mp, ray, external_launcher") as error:
        resolved(tiny_checkpoint("llama"), tensor_parallel_size=2, distributed_executor_backend="mpi")
    assert error.value.param == "distributed_executor_backend"


def test_the_ray_executor_without_ray_says_how_to_install_it(tiny_checkpoint, monkeypatch):
    from backend.engine.llm_engine import LLMEngine

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(InvalidRequestError, match=r"needs Ray, which is not installed: pip install 'tandem\[ray\]'"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", tensor_parallel_size=2,
                               distributed_executor_backend="ray"))


def test_external_launcher_outside_a_launcher_names_the_missing_variable(tiny_checkpoint, monkeypatch):
    from backend.engine.llm_engine import LLMEngine

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidRequestError, match="runs under a launcher such as torchrun, which sets WORLD_SIZE"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", tensor_parallel_size=2,
                               distributed_executor_backend="external_launcher"))
