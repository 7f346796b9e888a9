"""Plain-torch twin of every kernel: the test oracle and the CPU path.

KV-cache layout (one tensor per layer for K, one for V), head-major inside a block::

    cache[num_blocks, num_kv_heads, block_size, head_dim]      (see kv_cache_shape)
    token p of a request -> block block_table[p // block_size], row p % block_size
    slot = block_id * block_size + row   -> cache[block_id, :, row, :]

    block b:  | head 0: rows 0..bs-1 | head 1: rows 0..bs-1 | ...
                 ^ one contiguous block_size * head_dim run per (block, KV head)

so a kernel that walks one request's blocks for one KV head streams whole runs
(the fused CPU kernel and the Triton kernel do). This file gathers a batch's
blocks with one dim-0 ``index_select`` and lays them out for SDPA.

Attention is "varlen with paged KV": request i owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` (its newest ``query_len`` tokens)
and attends causally to its first ``seq_len`` cached tokens, the newest
included. Single-token queries (decode) run together in one SDPA call over
their gathered blocks; longer ones (prefill chunks) one request at a time.

Two forms of a step's attention metadata exist: ``AttentionPlan`` (host-built
index work for this file's SDPA path) and ``VarlenPlan`` (tensors only, what the
Triton kernel reads and what a CUDA graph captures). ``paged_attention`` here
takes either, so a replayed graph step also runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


# ---- norms ------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden]. Normalizes in fp32, casts back, then scales (HF's order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); both [num_tokens, hidden]."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


# ---- rotary embedding ---------------------------------------------------------------

def rotary_cos_sin(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
                   ) -> torch.Tensor:
    """The cache both rotary paths read: [max_positions, rotary_dim] = cat(cos, sin), fp32."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())  # [max_positions, rotary_dim / 2]
    return torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1)


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim dims of every head; returns new (query, key).

    NeoX style (``is_neox``) pairs dim i with dim i + rotary_dim / 2 (Llama's
    "rotate half"); GPT-J style pairs dims 2i and 2i + 1. Pair i turns by
    position * inv_freq[i] either way, so both read the same cache.

    positions: [num_tokens]; query: [num_tokens, num_heads * head_dim];
    key: [num_tokens, num_kv_heads * head_dim]; cos_sin_cache: [max_pos, rotary_dim].
    """
    cos_sin = cos_sin_cache.index_select(0, positions)  # [num_tokens, rotary_dim]
    cos, sin = cos_sin.chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2] each
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, head_dim)
        rot_dim = cos.shape[-1] * 2
        x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
        if is_neox:
            x1, x2 = x_rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if x_pass.shape[-1]:
            out = torch.cat([out, x_pass], dim=-1)
        return out.reshape(num_tokens, -1)

    return rotate(query), rotate(key)


# ---- activations ---------------------------------------------------------------------

def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = gate | up -> [num_tokens, d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- greedy sampling -----------------------------------------------------------------

def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> [rows] int64: each row's first maximum (a NaN counts as the maximum).
    ``max(dim).indices``: on CPU ~2x faster than ``argmax`` and the same indices."""
    return x.max(dim=-1).indices


# ---- sampling penalties --------------------------------------------------------------

def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, prompt_seen: torch.Tensor,
                    output_counts: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """In place on logits [R, V] float32: row ``rows[j]`` penalized from table slot ``slots[j]``
    (prompt_seen [S, V] bool, output_counts [S, V] int32) with ``repetition[j]``, ``frequency[j]``
    and ``presence[j]`` (float32 [n]). A token seen in the prompt or the outputs has its logit
    shrunk towards zero by the repetition penalty (divided if positive, else multiplied), as HF
    and vLLM do; then ``frequency * count`` and ``presence * (count > 0)`` are subtracted."""
    sub = logits.index_select(0, rows)  # [n, V]
    counts = output_counts.index_select(0, slots).float()  # [n, V]
    # A repetition penalty of 1 changes nothing (x / 1 and x * 1 are x): no test on the values,
    # which on a GPU would wait for the device.
    seen = prompt_seen.index_select(0, slots) | (counts > 0)  # [n, V]
    penalty = repetition.unsqueeze(1)  # [n, 1]
    sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    sub = sub - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).float()
    logits.index_copy_(0, rows, sub)


def penalized_argmax(logits: torch.Tensor, rows: torch.Tensor, prompt_seen: torch.Tensor,
                     output_counts: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                     frequency: torch.Tensor, presence: torch.Tensor, count: bool) -> torch.Tensor:
    """logits [R, V] (any float dtype; not modified) -> [R] int64: each row's ``argmax_rows``
    after ``apply_penalties`` (on a float32 copy; rows listed at most once). With ``count``, each
    ``rows[j]``'s token is then added to ``output_counts[slots[j]]`` (a greedy step's tokens
    counted in the sequences' histories)."""
    work = logits.to(torch.float32, copy=True)  # [R, V]
    apply_penalties(work, rows, prompt_seen, output_counts, slots, repetition, frequency, presence)
    tokens = argmax_rows(work)  # [R]
    if count:
        chosen = tokens.index_select(0, rows)  # [n]
        output_counts.index_put_((slots, chosen), torch.ones_like(chosen, dtype=torch.int32), accumulate=True)
    return tokens


# ---- quantized linears ------------------------------------------------------------

ACTIVATION_BLOCK = 32  # w8a8: activations share one int8 scale per row and 32-wide block along K


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32 or bf16, weight [N, K] int8, scale [N], bias [N] or None -> [M, N] in x's
    dtype: the float32 sum of x times the int8 weight, times the weight's scale, plus the bias,
    rounded once to x's dtype (bf16 x int8 products are exact in float32)."""
    out = x.float() @ weight.float().t() * scale.float()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 or bf16 -> (q [M, K] int8, scale [M, ceil(K / 32)] float32): per row and
    block of ``ACTIVATION_BLOCK``, s = max|x| / 127 and q = round(x / s) (half to even; 0 where
    s = 0), computed in float32 (bf16 -> float32 is exact)."""
    x = x.float()
    m, k = x.shape
    blocks = -(-k // ACTIVATION_BLOCK)
    padded = F.pad(x, (0, blocks * ACTIVATION_BLOCK - k)).view(m, blocks, ACTIVATION_BLOCK)
    scale = padded.abs().amax(dim=2) / 127.0  # [M, blocks]
    q = torch.where(scale.unsqueeze(2) > 0, padded / scale.unsqueeze(2), torch.zeros_like(padded))
    return torch.round(q).to(torch.int8).view(m, -1)[:, :k], scale


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32 or bf16, weight [N, K] int8, scale [N], bias [N] or None -> [M, N] in x's
    dtype: x quantized by ``quantize_activation_blocks``; each block's products summed exactly,
    times its activation scale, summed over blocks, times the weight's scale, plus the bias."""
    m, k = x.shape
    q, x_scale = quantize_activation_blocks(x)
    blocks = x_scale.shape[1]
    pad = blocks * ACTIVATION_BLOCK - k
    qb = F.pad(q.long(), (0, pad)).view(m, blocks, ACTIVATION_BLOCK)  # [M, B, 32]
    wb = F.pad(weight.long(), (0, pad)).view(-1, blocks, ACTIVATION_BLOCK)  # [N, B, 32]
    dots = torch.einsum("mbk,nbk->mnb", qb, wb)  # [M, N, B], exact integers
    out = (dots.double() * x_scale.double().unsqueeze(1)).sum(dim=2) * scale.double()
    return (out if bias is None else out + bias.double()).float().to(x.dtype)


INT4_GROUP = 32  # int4 weights: one (d, m) pair per row and 32-wide group along K


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight [N, K / 2] uint8, scales [N, K / 32, 2] float16 -> weight [N, K] float32.
    Group g of row n is bytes [16 g, 16 g + 16): byte i holds element 32 g + i in its low nibble and
    32 g + 16 + i in its high one (GGUF's Q4_0 / Q4_1 block order); scales holds (d, m) and the
    weight is d * q + m in fp32 (d * q is exact, so one rounding): GGUF's Q4_1 exactly, and its
    Q4_0, d * (q - 8), with m = -8 d."""
    n = qweight.shape[0]
    q = qweight.view(n, -1, INT4_GROUP // 2)  # [N, G, 16]
    nibbles = torch.cat([q & 15, q >> 4], dim=2).float()  # [N, G, 32]
    s = scales.float()  # [N, G, 2]
    return (nibbles * s[..., :1] + s[..., 1:]).view(n, -1)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32, bf16 or fp16 @ int4_dequantize(qweight, scales)^T + bias -> [M, N] in x's
    dtype: the products and sums in fp32, rounded once. With bf16 (or fp16, the GPU kernel's) x the
    dequantized weights are rounded to x's dtype first (the model with its dequantized weights in
    that dtype), so every product is exact."""
    weight = int4_dequantize(qweight, scales)
    if x.dtype in (torch.bfloat16, torch.float16):
        weight = weight.to(x.dtype).float()
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


# ---- KV cache ---------------------------------------------------------------------

def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
    """The shape of one layer's K (or V) cache: the one definition of the layout."""
    return (num_blocks, num_kv_heads, block_size, head_dim)


FP8_KV_DTYPE = torch.float8_e4m3fn  # --kv-cache-dtype fp8
FP8_MAX = 448.0  # its largest finite value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: unchanged in its own dtype; in fp8 clamped to +-448 first (torch's
    fp8 conversion makes NaN of what overflows), then rounded to nearest even."""
    if x.dtype == dtype:
        return x
    if dtype == FP8_KV_DTYPE:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] -> the slots in slot_mapping [num_tokens]."""
    block_size = k_cache.shape[2]
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, rows] = to_cache_dtype(key, k_cache.dtype)  # [num_tokens, kvh, head_dim] slices
    v_cache[blocks, :, rows] = to_cache_dtype(value, v_cache.dtype)


# ---- attention --------------------------------------------------------------------

@dataclass
class AttentionPlan:
    """Per-step index work shared by every layer (built once by ``plan_attention``).

    decode_*: the requests with one query token, batched together.
    prefills: (request index, query start, query len, seq len) of the others.
    """

    decode_rows: Optional[torch.Tensor]  # [num_decodes] query rows, None when all rows decode
    decode_block_tables: Optional[torch.Tensor]  # [num_decodes, max_blocks]
    decode_mask: Optional[torch.Tensor]  # [num_decodes, 1, 1, max_blocks * block_size] bool: True = attend
    prefills: list[tuple[int, int, int, int]]
    prefill_block_tables: list[torch.Tensor]  # per prefill: [num_blocks_needed]
    num_decodes: int


def plan_attention(block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                   block_size: int) -> AttentionPlan:
    """block_tables: [num_reqs, max_blocks] (padding may be any valid block ID); the plan's
    tensors live on block_tables' device."""
    device = block_tables.device
    block_tables = block_tables.long()
    decode_idx = [i for i, q in enumerate(query_lens) if q == 1]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    plan = AttentionPlan(None, None, None, [], [], len(decode_idx))
    if decode_idx:
        all_decode = len(decode_idx) == len(query_lens)
        max_len = max(seq_lens[i] for i in decode_idx)
        num_blocks = -(-max_len // block_size)
        if all_decode:
            tables = block_tables[:, :num_blocks]
            lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        else:
            idx = torch.tensor(decode_idx, dtype=torch.long, device=device)
            rows = torch.tensor([starts[i] for i in decode_idx], dtype=torch.long, device=device)
            plan.decode_rows = rows
            tables = block_tables.index_select(0, idx)[:, :num_blocks]
            lens = torch.tensor([seq_lens[i] for i in decode_idx], dtype=torch.long, device=device)
        plan.decode_block_tables = tables.contiguous()
        span = torch.arange(num_blocks * block_size, device=device)
        valid = span.unsqueeze(0) < lens.unsqueeze(1)  # [num_decodes, span]
        plan.decode_mask = valid.view(len(decode_idx), 1, 1, -1)
    for i, q in enumerate(query_lens):
        if q != 1:
            plan.prefills.append((i, starts[i], q, seq_lens[i]))
            plan.prefill_block_tables.append(block_tables[i, :-(-seq_lens[i] // block_size)])
    return plan


@dataclass
class VarlenPlan:
    """A step's attention metadata as tensors only (the Triton kernel's input).

    Nothing in it is host-side state derived from the values, so a CUDA graph can
    capture kernels reading it and later steps refill the same tensors in place.
    """

    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: tokens in the cache after this step
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_query_len: int
    max_seq_len: int  # an upper bound of seq_lens (it fixes the KV split count)
    num_splits: Optional[int] = None  # KV splits per request; None: the kernel decides


def plan_varlen(block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                seq_lens_tensor: Optional[torch.Tensor] = None,
                query_start_tensor: Optional[torch.Tensor] = None) -> VarlenPlan:
    """The VarlenPlan of a step; its tensors live on block_tables' device. The caller may pass
    seq_lens and the query start offsets as int32 tensors there already (not uploaded again)."""
    device = block_tables.device
    if seq_lens_tensor is None:
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if query_start_tensor is None:
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        query_start_tensor = torch.tensor(starts, dtype=torch.int32, device=device)
    return VarlenPlan(block_tables=block_tables.to(torch.int32), seq_lens=seq_lens_tensor,
                      query_start_loc=query_start_tensor, max_query_len=max(query_lens),
                      max_seq_len=max(seq_lens))


def _plan_from_varlen(plan: VarlenPlan, block_size: int) -> AttentionPlan:
    query_lens = plan.query_start_loc.diff().tolist()
    return plan_attention(plan.block_tables.long(), plan.seq_lens.tolist(), query_lens, block_size)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[num_blocks, kvh, block_size, d], block_ids[..., nb] -> [..., kvh, nb * block_size, d]."""
    _, kvh, block_size, d = cache.shape
    gathered = cache.index_select(0, block_ids.reshape(-1))  # [n * nb, kvh, block_size, d]
    gathered = gathered.view(*block_ids.shape, kvh, block_size, d).transpose(-4, -3)
    return gathered.reshape(*block_ids.shape[:-1], kvh, -1, d)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan | VarlenPlan,
                    scale: float) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; key/value: this step's
    [num_tokens, num_kv_heads, head_dim], already written to the caches.
    Returns [num_tokens, num_heads, head_dim] in query's dtype. Attention sees K and V as the
    caches hold them (in an fp8 cache: rounded)."""
    if isinstance(plan, VarlenPlan):
        plan = _plan_from_varlen(plan, k_cache.shape[2])
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)

    if plan.num_decodes:
        q = query if plan.decode_rows is None else query.index_select(0, plan.decode_rows)
        n = q.shape[0]
        k = _gather(k_cache, plan.decode_block_tables).to(q.dtype)  # [n, kvh, span, d]
        v = _gather(v_cache, plan.decode_block_tables).to(q.dtype)
        # 4-D SDPA (its fused CPU kernel): ~2x faster here than batched matmuls + softmax.
        o = F.scaled_dot_product_attention(q.view(n, num_heads, 1, head_dim), k, v,
                                           attn_mask=plan.decode_mask, scale=scale, enable_gqa=group > 1)
        o = o.view(n, num_heads, head_dim)
        if plan.decode_rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, plan.decode_rows, o)

    for (_, start, q_len, seq_len), table in zip(plan.prefills, plan.prefill_block_tables):
        q = query[start:start + q_len].transpose(0, 1)  # [num_heads, q_len, d]
        if seq_len == q_len:  # nothing cached before this chunk: use this step's K/V
            k = to_cache_dtype(key[start:start + q_len], k_cache.dtype).transpose(0, 1)  # [kvh, q_len, d]
            v = to_cache_dtype(value[start:start + q_len], v_cache.dtype).transpose(0, 1)
            mask, causal = None, True
        else:
            k = _gather(k_cache, table)[:, :seq_len]  # [kvh, seq_len, d]
            v = _gather(v_cache, table)[:, :seq_len]
            # Query row r sits at position seq_len - q_len + r and sees keys <= that.
            rows = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            mask, causal = torch.arange(seq_len, device=query.device).unsqueeze(0) <= rows, False
        # 4-D inputs: with 3-D ones, SDPA on CPU takes its slow math path (measured 5x slower).
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.to(q.dtype).unsqueeze(0), v.to(q.dtype).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out
