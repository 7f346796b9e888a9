"""Tandem's kernels: paged attention, KV-cache writes, norms, rotary.

Every op has a plain-torch twin in ``kernels.reference``: the test oracle and
the CPU path. Call sites import the ops from this package, so Triton versions
for CUDA tensors slot in here without touching them.
"""

from kernels.reference import (  # noqa: F401
    AttentionPlan,
    apply_rotary,
    fused_add_rms_norm,
    paged_attention,
    plan_attention,
    rms_norm,
    rotary_cos_sin,
    write_kv_cache,
)
