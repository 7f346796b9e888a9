"""Tandem's GPU side, one layer per package; each imports only the layers below it (checked by
import-linter, see pyproject.toml)::

    server/       the backend's entry point: gRPC servicer, auth, metrics, ports, log filters
    engine/       LLMEngine (one step) and AsyncLLMEngine (its asyncio loop)
    core/         scheduler, KV-cache block manager, the engine's request state, request
                  features (structured outputs, speculative decoding, beam search)
    executor/     uni, mp, ray, external_launcher: drive one worker per device
    worker/       worker, model runner, sampler, CUDA graphs, CPU traced graphs, huge pages
    messages/     what one step hands down and back: SchedulerOutput, ModelRunnerOutput, grammar masks
    models/       model families, layers, loader, config resolution
    distributed   torch.distributed set-up and the collectives models use
    types/        torch-free, shared with the frontend: sampling params, outputs, errors,
                  limits, config, wire constants

Importing ``backend`` or ``backend.types`` does not import torch.
"""
