"""What the engine checks of a request before it queues it, and the model's EOS tokens."""

from __future__ import annotations

from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from backend.types.sampling_params import SamplingParams


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     limits: Limits) -> None:
    """Raise InvalidRequestError, naming the problem, for a request the engine cannot serve."""
    if not prompt_token_ids:
        raise InvalidRequestError("The prompt is empty.", param="prompt")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"The prompt (length {len(prompt_token_ids)}) is too long: this model's maximum "
            f"context length is {max_model_len} tokens, and at least one must be "
            "left for output.", param="prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"Token ID {bad[0]} is out of vocabulary (size {vocab_size}).", param="prompt")
    limits.check_sampling_params(params, vocab_size)
    for name in ("stop_token_ids", "logprob_token_ids", "logit_bias"):
        bad = [t for t in getattr(params, name) or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} holds token ID {bad[0]}, outside the vocabulary "
                                      f"(size {vocab_size}).", param=name)


def eos_token_ids(config: EngineConfig) -> list[int]:
    """EOS IDs from generation_config.json (which may list several), else config.json."""
    ids = None
    try:
        from transformers import GenerationConfig

        ids = GenerationConfig.from_pretrained(str(config.model_path)).eos_token_id
    except (OSError, ValueError):
        pass
    if ids is None:
        ids = getattr(config.hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)
