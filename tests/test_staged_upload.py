"""A step's host arrays reach the device in one staged copy (backend/worker/staged_upload.py).

On the CPU the staging is forced (unpinned, a copy in place of the device's); the CUDA test
(marked gpu) checks the pinned, non-blocking copy while the device is busy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.worker.staged_upload import StagedUpload


def arrays(seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.integers(-2**40, 2**40, 7).tolist(), torch.int64),
            (rng.integers(0, 100, (3, 5)), torch.int32),
            ([], torch.int64),
            (rng.standard_normal(3).astype(np.float32).tolist(), torch.float32),
            (rng.integers(0, 9, 1).tolist(), torch.int32)]


def expected(values, dtype) -> torch.Tensor:
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values).to(dtype)
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_every_array_arrives_whole_with_its_dtype_and_shape(stage):
    upload = StagedUpload(torch.device("cpu"), stage=stage)
    results = []
    for seed in range(5):  # the two buffers reused in turn, grown when a step needs more
        given = arrays(seed)
        if seed == 3:
            given.append((list(range(100_000)), torch.int64))
        out = upload(given)
        results.append((given, out))
    for given, out in results:  # earlier steps' tensors stay intact after the buffers are reused
        assert len(out) == len(given)
        for (values, dtype), tensor in zip(given, out):
            assert tensor.dtype == dtype and torch.equal(tensor, expected(values, dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_copy_is_pinned_and_does_not_wait_for_the_queue():
    device = torch.device("cuda")
    upload = StagedUpload(device)
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # keep the device busy: the uploads below queue behind this
        busy = busy @ busy / 64
    outs = [(given, upload(given)) for given in (arrays(seed) for seed in range(6))]
    torch.cuda.synchronize()
    for given, out in outs:
        for (values, dtype), tensor in zip(given, out):
            assert tensor.is_cuda and torch.equal(tensor.cpu(), expected(values, dtype))
