"""Tandem's kernels, imported as ``tandem_kernels`` (the top-level ``kernels/`` folder holds this one package).

``ops`` is the one entry point models use (it dispatches by device: Triton on CUDA, the fused C++
kernels in ``cpu`` on CPUs, ``reference`` otherwise). The package is not called ``kernels``: that is
Hugging Face's kernel hub package, which transformers requires and imports, and ours would hide it.
"""
