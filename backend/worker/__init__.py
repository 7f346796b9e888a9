"""One worker per device: the worker (device, distributed set-up), the model runner (input tensors,
forward, sampling), the sampler, CUDA graphs and the CPU's traced graphs, huge pages.

Imports: backend.messages, backend.models, backend.distributed, backend.types, kernels.
"""
