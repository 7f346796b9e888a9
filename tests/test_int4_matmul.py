"""The Triton int4 dequant-GEMM (tandem_kernels.int4_matmul) against its plain-torch twins,
reference.int4_linear (fp16 scales) and gguf_reference.int4f_linear (fp32 scales).

Without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py) on CPU tensors, so shapes stay
tiny; the GPU-marked test runs real layer shapes compiled (skipped without CUDA). The interpreter
computes in fp32 what the compiled kernel computes in bf16 / fp16 tensor-core dots with fp32 sums
(exact products), so only the summation order differs: results agree to an ulp of x's dtype.
"""

from __future__ import annotations

import pytest
import torch

from backend.models.int4_weights import quantize_int4
from tandem_kernels import gguf_reference, reference as R
from tandem_kernels.launch_config import int4_matmul_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # about one ulp of the output's dtype


@pytest.fixture(scope="module")
def int4_matmul():
    from tandem_kernels import int4_matmul

    return int4_matmul


def make_case(m: int, n: int, k: int, dtype: torch.dtype, int4f: bool, bias: bool, seed: int = 0):
    """x [m, k], int4 weights of a random [n, k] matrix (fp32 scales holding the same values when
    int4f, as a GGUF Q4_K or AWQ layer would), an optional bias; all on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    qweight, scales = quantize_int4(torch.randn(n, k, generator=g))
    if int4f:
        scales = scales.float()
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    to = (lambda t: None if t is None else t.to(DEVICE))
    return to(x), to(qweight), to(scales), to(b)


def twin(x, qweight, scales, bias):
    fn = R.int4_linear if scales.dtype == torch.float16 else gguf_reference.int4f_linear
    return fn(x.cpu(), qweight.cpu(), scales.cpu(), None if bias is None else bias.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k, int4f, bias", [
    (1, 80, 96, False, True),  # decode; K three groups, not a power of two (a masked K step)
    (5, 80, 2048 + 32, True, False),  # several K steps and a partial last one; fp32 scales
    (64, 80, 96, False, False),  # the 64 x 64 tiles
    (130, 48, 64, True, True),  # 128 x 128 tiles, two along M (the grouped program order)
    (3, 33, 32, False, True),  # one group; N not a multiple of anything
])
def test_int4_matmul_matches_twin(int4_matmul, dtype, m, n, k, int4f, bias):
    x, qweight, scales, b = make_case(m, n, k, dtype, int4f, bias)
    got = int4_matmul.int4_linear(x, qweight, scales, b)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().float(), twin(x, qweight, scales, b).float(), atol=tol, rtol=tol)


def test_int4_matmul_leading_dims_and_strided_rows(int4_matmul):
    """x [..., K] keeps its leading dims; rows with a stride (a view of a wider tensor) are read as such."""
    x, qweight, scales, _ = make_case(6, 40, 64, torch.float16, False, False)
    wide = torch.cat([x, x], dim=1)[:, :64]  # [6, 64], row stride 128
    got = int4_matmul.int4_linear(wide.view(2, 3, 64), qweight, scales, None)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got.view(6, 40).cpu().float(), twin(x, qweight, scales, None).float(),
                               atol=2e-3, rtol=2e-3)


def test_int4_matmul_refuses_what_it_does_not_compute(int4_matmul):
    x, qweight, scales, _ = make_case(2, 16, 64, torch.float16, False, False)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        int4_matmul.int4_linear(x.float(), qweight, scales, None)
    with pytest.raises(ValueError, match="scales must be"):
        int4_matmul.int4_linear(x, qweight, scales[:, :1].contiguous(), None)
    with pytest.raises(ValueError, match="qweight must be"):
        int4_matmul.int4_linear(x[:, :48], qweight, scales, None)
    with pytest.raises(ValueError, match="bias must be"):
        int4_matmul.int4_linear(x, qweight, scales, torch.zeros(15, dtype=x.dtype, device=x.device))


def test_int4_matmul_config():
    """Block sizes are whole (d, m) groups and powers of two (tl.arange), at least tl.dot's 16."""
    for m in (1, 16, 17, 64, 65, 4096):
        for n, k in ((80, 96), (2048, 2048), (16384, 2048), (2048, 8192), (48, 32)):
            c = int4_matmul_config(m, n, k)
            assert c.block_k % 32 == 0 and c.block_k & (c.block_k - 1) == 0 and c.block_k <= max(32, 2 * k)
            assert min(c.block_m, c.block_n) >= 16
    assert int4_matmul_config(1, 2048, 2048).block_m == 16
    with pytest.raises(ValueError):
        int4_matmul_config(1, 16, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 32, 512])
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 8192), (16384, 2048)])  # Llama-3.2-1B: qkv, down, gate_up
def test_int4_matmul_realistic(dtype, m, n, k):
    from tandem_kernels import int4_matmul

    for int4f in (False, True):
        x, qweight, scales, b = make_case(m, n, k, dtype, int4f, bias=True)
        got = int4_matmul.int4_linear(x, qweight, scales, b)
        fn = R.int4_linear if not int4f else gguf_reference.int4f_linear
        want = fn(x, qweight, scales, b)  # the twin on the GPU: same values, torch's sum order
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_the_benchmark_runs_under_the_interpreter(capsys):
    """bench/int4_matmul.py --tiny: the GPU benchmark's code path, on the CPU (numbers meaningless)."""
    from bench import int4_matmul as bench

    assert bench.main(["--tiny"]) == 0
    table = capsys.readouterr().out
    lines = [line.split(" | ") for line in table.splitlines() if line.startswith("| tiny 80x96 |")]
    assert [cells[1] for cells in lines] == ["1", "5"]
    assert all(float(cells[2]) < 0.1 for cells in lines)  # outputs ~10: within an ulp of bf16
