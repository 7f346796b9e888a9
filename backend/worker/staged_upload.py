"""Host arrays to the device in one copy that never waits for the device's queue.

A copy from pageable host memory returns only once the device has run it, so a step's input
upload would wait behind every kernel queued before it (the step in flight, under async
scheduling). Here the arrays of a step are packed into a pinned buffer and sent in one
non-blocking copy; each array comes back as a view of the one device buffer. Pinned buffers
are used in turn (a step uploads its inputs, then up to five sets of sampling parameters:
min_tokens, logit_bias, penalties, the random rows and their parameters), and one is refilled
only after the copy out of it has run: the ring holds more than two steps' uploads, so with
steps two deep in flight that copy ran long before and the check never waits in practice.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

Array = Union[Sequence[int], Sequence[float], np.ndarray]
_ALIGN = 8  # bytes: every array starts aligned for any dtype used here
_RING = 16  # pinned buffers used in turn (a deferrable step uploads at most 6 times)


class StagedUpload:
    def __init__(self, device: torch.device, stage: bool | None = None) -> None:
        """stage: pack and copy (default: on CUDA only; tests stage on the CPU, unpinned)."""
        self.device = device
        self.stage = device.type == "cuda" if stage is None else stage
        self._buffers: list[torch.Tensor | None] = [None] * _RING  # pinned uint8
        self._copied: list[torch.cuda.Event | None] = [None] * _RING
        self._turn = 0

    def __call__(self, arrays: list[tuple[Array, torch.dtype]]) -> list[torch.Tensor]:
        """(values, dtype) pairs -> device tensors, same order; a 2-D numpy array keeps its shape."""
        if not self.stage:  # the CPU reads host memory directly: no copy to stage
            # (numpy builds a tensor from a list ~4x faster than torch.tensor does)
            return [torch.from_numpy(np.ascontiguousarray(a)).to(dtype) if isinstance(a, np.ndarray)
                    else list_tensor(a, dtype) for a, dtype in arrays]
        shapes, offsets, total = [], [], 0
        for values, dtype in arrays:
            shape = values.shape if isinstance(values, np.ndarray) else (len(values),)
            shapes.append(shape)
            offsets.append(total)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            total += -(-nbytes // _ALIGN) * _ALIGN
        turn, self._turn = self._turn, (self._turn + 1) % _RING
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy out of this buffer (steps ago) has run
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < total:
            size = max(total, 2 * (buffer.numel() if buffer is not None else 0), 1 << 16)
            buffer = self._buffers[turn] = torch.empty(size, dtype=torch.uint8,
                                                       pin_memory=self.device.type == "cuda")
        host = buffer.numpy()
        for (values, dtype), shape, offset in zip(arrays, shapes, offsets):
            count = int(np.prod(shape))
            view = host[offset:offset + count * dtype.itemsize].view(_numpy_dtype(dtype))
            view[:] = np.asarray(values, dtype=view.dtype).reshape(-1)
        if self.device.type == "cuda":
            device_bytes = buffer[:total].to(self.device, non_blocking=True)
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        else:  # staged on the CPU (tests): a copy, as the device's would be
            device_bytes = buffer[:total].clone()
        out = []
        for (values, dtype), shape, offset in zip(arrays, shapes, offsets):
            count = int(np.prod(shape))
            out.append(device_bytes[offset:offset + count * dtype.itemsize].view(dtype).view(shape))
        return out


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def list_tensor(values: Array, dtype: torch.dtype = torch.int64,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a 1-D list of numbers, built through
    numpy (~4x faster on the host for a few hundred values); on another device, then copied there."""
    host = torch.from_numpy(np.array(values, dtype=_NUMPY[dtype])) if dtype in _NUMPY else torch.tensor(values, dtype=dtype)
    return host if torch.device(device).type == "cpu" else host.to(device)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(_NUMPY[dtype])
