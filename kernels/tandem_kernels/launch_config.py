"""Launch parameters of every Triton kernel: pure functions of shapes (no device query, no state).

The launchers (``attention``, ``cache_ops``, ``norms``, ``rotary``, ``activations``) take their
block sizes, warp and stage counts from here and nowhere else, and CI's compile test
(``tandem_kernels.compile_probe``) runs those same launchers, so the specializations compiled
for sm_80 / sm_90a / sm_100a without a GPU are the ones a GPU runs. Every value depends only
on Python ints a CUDA graph freezes at capture, so replays agree with the capture.
"""

from __future__ import annotations

from dataclasses import dataclass


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AttentionConfig:
    """One paged-attention specialization (see ``tandem_kernels.attention``)."""

    block_q: int  # query tokens per program
    block_m: int  # tile rows: block_q tokens x the GQA group, a power of two >= 16 (tl.dot's minimum)
    tile_n: int  # KV tokens per inner-loop step
    head_dim_pad: int  # head_dim padded to a power of two (tl.arange)
    num_warps: int
    num_stages: int


# Query rows (tokens x GQA group) a prefill program aims for: one Hopper warpgroup MMA is 64 rows.
PREFILL_ROWS = 64


def attention_config(head_dim: int, group: int, max_query_len: int, element_size: int = 2) -> AttentionConfig:
    """Decode steps (every request one query token) pack the GQA group into one tile
    (block_q = 1); steps with longer queries pack as many tokens as fit the tile's rows.
    element_size: bytes per query element (2: bf16/fp16 on tensor cores; 4: fp32, whose exact
    dots are FMA loops that hold their tiles in registers, so they get small tiles).

    Chosen from CI's compile table (bench/kernel_compile_table.py; registers and spills
    per target), with no spills on sm_80, sm_90a or sm_100a for head dims up to 256:

    - decode: 16-row tiles, 64-token KV tiles, 4 warps (71-112 registers at head dims 64-128);
      at head dim 256 8 warps halve the per-thread share of the 16 x 256 accumulator
      (189 -> 109 registers on sm_90a).
    - prefill, head dim <= 64: 64 x 64 tiles on 4 warps (one warpgroup, wgmma on sm_90a).
    - prefill, head dim 65-128 (80 and 96 pad to 128): 32-token KV tiles; 64-token ones take
      217 registers on sm_90a and spill on sm_80 (255 registers), 8 warps spill at 80/96 on sm_80.
    - prefill, head dim 256: 32 x 32 tiles; 64 rows spill on sm_90a (255 registers, 164 KB
      shared) and, with 8 warps, still on sm_100a.
    - fp32: 16-row prefill tiles; 64 x 64 tiles spill 9-10 KB a thread. 16-token KV tiles
      in prefill (with the query-tile search, 32 spilled 8 bytes at head dim 64, group 3, on
      sm_90a); in decode 32 up to head dim 64, 16 above: with 32 the split-KV decode at 80-128 spills ~300 bytes on
      sm_90a and sm_100a (255 registers on 4 warps; on 8, the plain decode spills on sm_100a).
    """
    if group < 1 or head_dim < 1 or max_query_len < 1 or element_size not in (2, 4):
        raise ValueError(f"attention_config({head_dim}, {group}, {max_query_len}, {element_size}): "
                         "sizes must be >= 1 and element_size 2 or 4")
    head_dim_pad = max(16, next_power_of_2(head_dim))
    wide = head_dim_pad >= 256
    decode = max_query_len == 1
    if element_size == 4:
        rows, tile_n, num_stages = 16, 16 if head_dim_pad >= 128 or not decode else 32, 2
        num_warps = 8 if decode and wide else 4
    elif decode:
        rows, tile_n, num_warps, num_stages = 1, 64, 8 if wide else 4, 3
    else:
        rows = PREFILL_ROWS // 2 if wide else PREFILL_ROWS
        tile_n = 64 if head_dim_pad <= 64 else 32
        num_warps, num_stages = 4, 2 if wide else 3
    block_q = 1 if decode else max(1, rows // group)
    block_m = max(16, next_power_of_2(block_q * group))
    return AttentionConfig(block_q=block_q, block_m=block_m, tile_n=tile_n, head_dim_pad=head_dim_pad,
                           num_warps=num_warps, num_stages=num_stages)


PARTITION_ALIGN = 64  # split-KV partitions are multiples of every KV tile size
MIN_PARTITION = 256  # fewest KV tokens per split worth a second kernel
MAX_SPLITS = 64


def kv_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int,
              num_splits: int | None = None) -> tuple[int, int]:
    """(grid_splits, min_partition): the split axis of a decode launch and the fewest KV tokens
    a split takes. Only decode batches whose (request, KV head) programs would leave most of
    the num_sms SMs idle split (num_splits, when given, forces the grid's count and lets
    splits shrink to PARTITION_ALIGN tokens).

    The grid is a cap, not the layout: each request's own split count and partition size are
    chosen on the device from its real seq_len (``request_partition``, which the kernels
    mirror), and splits past its context exit at once. max_seq_len only bounds the cap, so a
    CUDA graph captured at max_model_len runs, at every real context, the same working
    programs as an eager step at that context."""
    if num_splits is not None:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits={num_splits}: must be 1..{MAX_SPLITS}")
        return num_splits, PARTITION_ALIGN
    splits = 1
    programs = num_reqs * num_kv_heads
    if max_query_len == 1 and 0 < programs < num_sms:
        splits = max(1, min(cdiv(2 * num_sms, programs), cdiv(max_seq_len, MIN_PARTITION), MAX_SPLITS))
    return splits, MIN_PARTITION


def request_partition(seq_len: int, grid_splits: int, min_partition: int) -> tuple[int, int]:
    """(working splits, partition_size) of one request's context under a split-KV launch: as
    many splits as the grid allows with at least min_partition tokens each, partitions rounded
    up to PARTITION_ALIGN. The attention and merge kernels compute exactly this on the device
    (``tandem_kernels.attention._request_partition``); splits >= the first value do no work."""
    splits = max(1, min(grid_splits, cdiv(seq_len, min_partition)))
    partition = cdiv(cdiv(max(seq_len, 1), splits), PARTITION_ALIGN) * PARTITION_ALIGN
    return cdiv(seq_len, partition), partition


def query_tile_grid(num_tokens: int, num_reqs: int, max_query_len: int, block_q: int) -> tuple[int, int]:
    """(programs, search_steps) on the query-tile axis of an attention launch.

    Decodes (max_query_len 1): one program per request, search_steps 0. Otherwise programs
    cover the real query tiles, not requests x the longest query's tiles: request r's tiles
    start at tile (query_start_loc[r] + r * (block_q - 1)) // block_q, a non-decreasing
    function of r whose steps are at least the request's cdiv(q_len, block_q) tiles, so
    floor((num_tokens + num_reqs * (block_q - 1)) / block_q) programs cover every tile with at
    most one idle program per request; each program finds its request by a binary search of
    search_steps probes over query_start_loc (no per-step map to build or capture)."""
    if max_query_len <= 1:
        return num_reqs, 0
    return (num_tokens + num_reqs * (block_q - 1)) // block_q, num_reqs.bit_length()


@dataclass(frozen=True)
class RowConfig:
    """A row-wise kernel (one program per token): a power-of-two block of columns."""

    block: int
    num_warps: int


def merge_config(num_splits: int) -> RowConfig:
    """The split-KV merge (one program per token and head): all splits in one block of at
    least 2 rows; 4 warps (at 64 splits and head dim 256, 128-168 registers, no spills)."""
    return RowConfig(block=max(2, next_power_of_2(num_splits)), num_warps=4)


def row_config(width: int) -> RowConfig:
    """RMSNorm and friends: the whole row in one block, ~8 elements a thread, 1..16 warps."""
    block = next_power_of_2(max(1, width))
    return RowConfig(block=block, num_warps=min(16, max(1, block // 256)))


# silu_and_mul: each program handles this many output columns of one token.
ACTIVATION_BLOCK = 1024


def activation_config(width: int) -> RowConfig:
    """silu_and_mul over [tokens, 2 * width]: column blocks of at most ACTIVATION_BLOCK."""
    block = min(ACTIVATION_BLOCK, next_power_of_2(max(1, width)))
    return RowConfig(block=block, num_warps=min(4, max(1, block // 256)))


@dataclass(frozen=True)
class HeadsConfig:
    """A per-token kernel over [heads, width] (rotary, KV-cache writes): both padded to powers of two."""

    heads_pad: int
    width_pad: int
    num_warps: int


def heads_config(num_heads: int, width: int) -> HeadsConfig:
    """4 warps, Triton's default (these kernels move a few KB a token; not tuned on a GPU yet)."""
    return HeadsConfig(heads_pad=next_power_of_2(num_heads), width_pad=next_power_of_2(width), num_warps=4)


@dataclass(frozen=True)
class Int4MatmulConfig:
    """One int4 dequant-GEMM specialization (see ``tandem_kernels.int4_matmul``)."""

    block_m: int  # rows of x per program (>= 16: tl.dot's minimum)
    block_n: int  # weight rows (outputs) per program
    block_k: int  # inputs per inner-loop step: a multiple of 32 (whole (d, m) groups)
    group_m: int  # programs along M that share a band of weight rows (L2 reuse)
    num_warps: int
    num_stages: int


def int4_matmul_config(m: int, n: int, k: int) -> Int4MatmulConfig:
    """Tiles for y [m, n] = x [m, k] @ dequant(W)^T. Not tuned on a GPU yet (none has been lent);
    chosen by reasoning and checked for spills by the compile test:

    - decode (m <= 16): memory-bound on the packed weight; 16-row tiles of x and narrow weight
      bands (16 rows up to n = 4096) so a 1B model's 2048-wide layers still give 128 programs.
    - m <= 64: 64 x 64 tiles, 64 inputs a step (with 128, an earlier form of the kernel spilled
      ~100 bytes on sm_80).
    - larger (prompts): 128 x 128 tiles on 8 warps, 32 inputs a step (64 spilled ~80 bytes on sm_80).
    Registers / spills / shared memory per specialization: ``python bench/kernel_compile_table.py
    --models Llama`` (at these tiles 55-183 registers, no spills, <= 38 KB on sm_80 / 90a / 100a).
    k only bounds block_k (a 32-multiple no wider than k, rounded up to a power of two for tl.arange).
    """
    if m < 1 or n < 1 or k < 32 or k % 32:
        raise ValueError(f"int4_matmul_config({m}, {n}, {k}): sizes must be >= 1 and k a multiple of 32")
    if m <= 16:
        block_m, block_n, block_k, num_warps, num_stages = 16, 16 if n <= 4096 else 32, 256, 4, 3
    elif m <= 64:
        block_m, block_n, block_k, num_warps, num_stages = 64, 64, 64, 4, 3
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 128, 32, 8, 3
    block_k = min(block_k, max(32, next_power_of_2(k)))
    return Int4MatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k, group_m=8,
                            num_warps=num_warps, num_stages=num_stages)
