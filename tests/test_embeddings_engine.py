"""The engine's embed path: pooled final hidden states equal HF transformers' (fp32), through
chunked prefill, in a batch with generation, and with its blocks freed afterwards."""

import asyncio

import pytest
import torch

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams

PROMPTS = [[5, 9, 12, 3, 40, 41, 7, 8, 100, 101, 102, 3, 9], [17], [60, 61, 62, 63, 64, 65, 66]]


def hf_pooled(model_dir, prompt, kind, normalize):
    """HF's final hidden states (after the final norm), pooled and normalized the same way."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [len, hidden]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embed_equals_hf_through_chunked_prefill_beside_generation(model_dir, async_scheduling):
    # A 4-token budget splits the 13-token prompt into chunks that share steps with a generation.
    config = EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=64,
                          max_model_len=64, max_num_batched_tokens=4, enable_prefix_caching=True,
                          async_scheduling=async_scheduling)
    engine = AsyncLLMEngine(config)

    async def run():
        async def generation():
            return [o async for o in engine.generate("gen", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6))]

        cases = [(i, kind, normalize) for i in range(len(PROMPTS)) for kind in ("last", "mean", "cls")
                 for normalize in (True, False)]
        results = await asyncio.gather(generation(), *(
            engine.embed(f"e{i}-{kind}-{normalize}", PROMPTS[i], PoolingParams(kind, normalize))
            for i, kind, normalize in cases))
        # The same prompt again: a prefix-cache hit for last pooling, none for mean and CLS (their
        # own salt).
        again = await asyncio.gather(*(engine.embed(f"again-{kind}", PROMPTS[0], PoolingParams(kind))
                                       for kind in ("last", "mean", "cls")))
        return cases, results[1:], again

    try:
        cases, vectors, again = asyncio.run(run())
        for (i, kind, normalize), vector in zip(cases, vectors):
            assert len(vector) == 64
            expected = hf_pooled(model_dir, PROMPTS[i], kind, normalize)
            torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-3, rtol=0)
        for kind, vector in zip(("last", "mean", "cls"), again):
            torch.testing.assert_close(torch.tensor(vector), hf_pooled(model_dir, PROMPTS[0], kind, True),
                                       atol=1e-3, rtol=0)
        core = engine.engine
        assert not core.has_unfinished_requests()
        assert core.block_manager.usage == 0  # every block freed (cached ones stay reusable, and free)
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_embed_refuses_what_generation_refuses(model_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4,
                                         num_kv_blocks=64, max_model_len=32))

    async def refused(prompt):
        with pytest.raises(InvalidRequestError) as info:
            await engine.embed("bad", prompt, PoolingParams())
        return info.value

    try:
        assert asyncio.run(refused([])).param == "prompt"
        assert asyncio.run(refused(list(range(40)))).param == "prompt"
        with pytest.raises(InvalidRequestError):
            PoolingParams("step")  # vLLM's, not Tandem's
    finally:
        engine.shutdown()
