"""Torch reference ops: the semantics every Triton kernel must match (same signatures).

They run on CPU and GPU in any float dtype; attention, norms and rotary math are computed in
fp32 and cast back. ``store_kv`` and the prefill path of ``paged_attention`` use data-dependent
indexing (host syncs), so only the decode-only attention path is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from verifypd.kernels.metadata import AttentionMetadata

# Largest padded score tensor (elements) the batched attention path may build; bigger mixed
# batches (one long prefill next to many short ones) go sequence by sequence instead.
MAX_PADDED_SCORES = 1 << 25


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the new tokens' K/V into their flat slots, in place; slots < 0 are padding.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T].
    """
    is_real = slot_mapping >= 0  # [T]
    slots = slot_mapping[is_real]
    _flat_slots(k_cache)[slots] = k[is_real].to(k_cache.dtype)
    _flat_slots(v_cache)[slots] = v[is_real].to(v_cache.dtype)


def _flat_slots(cache: Tensor) -> Tensor:
    """[num_blocks, block_size, Hkv, D] -> [num_blocks * block_size, Hkv, D] (a view)."""
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
) -> Tensor:
    """Causal attention of the packed query tokens over each sequence's paged KV (GQA).

    q: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D], Hq a multiple of Hkv -> [T, Hq, D].
    ``k_new``, ``v_new`` [T, Hkv, D]: the same tokens' rotated keys and values, equal to what
    ``rope_store_kv`` stored for them; a kernel may read them instead of those cache slots
    (this reference reads the cache).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    num_scores = meta.num_seqs * q.shape[1] * meta.max_query_len * meta.max_seq_len
    if meta.is_decode_only or num_scores <= MAX_PADDED_SCORES:
        return attention_padded(q, k_cache, v_cache, meta, scale)
    return attention_per_seq(q, k_cache, v_cache, meta, scale)


def attention_padded(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """All sequences at once, padded to [B, max_query_len, max_seq_len]; no host sync."""
    num_tokens, num_seqs, max_q = q.shape[0], meta.num_seqs, meta.max_query_len
    q_start = meta.query_start_loc.long()  # [B+1]
    query_lens = q_start[1:] - q_start[:-1]  # [B]
    q_offsets = torch.arange(max_q, device=q.device)  # [Qm]
    rows = (q_start[:-1, None] + q_offsets).clamp(max=num_tokens - 1)  # [B, Qm]
    q_pos = (meta.seq_lens.long() - query_lens)[:, None] + q_offsets  # [B, Qm]
    k = _gather_seq_kv(k_cache, meta.block_tables, meta.max_seq_len)  # [B, S, Hkv, D]
    v = _gather_seq_kv(v_cache, meta.block_tables, meta.max_seq_len)
    out = _attend(q[rows], k, v, q_pos, meta.seq_lens.long(), scale)  # [B, Qm, Hq, D]
    # Unpack: token t belongs to the sequence whose query range holds t.
    tokens = torch.arange(num_tokens, device=q.device)  # [T]
    seq_idx = torch.searchsorted(q_start[1:], tokens, right=True).clamp(max=num_seqs - 1)
    q_idx = (tokens - q_start[seq_idx]).clamp(0, max_q - 1)
    return out[seq_idx, q_idx].to(q.dtype)


def attention_per_seq(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """One sequence at a time (bounded memory); uses the host copies of the lengths."""
    query_lens, seq_lens = _host_lens(meta)
    out = torch.zeros_like(q)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if q_len > 0:
            rows = slice(start, start + q_len)
            table = meta.block_tables[b : b + 1]
            out[rows] = _attend_one_seq(q[rows], k_cache, v_cache, table, seq_len, scale)
        start += q_len
    return out


def _attend_one_seq(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, seq_len: int, scale: float
) -> Tensor:
    """q: [L, Hq, D] (the last L positions of a seq_len-long sequence), table [1, nb]."""
    k = _gather_seq_kv(k_cache, table, seq_len)  # [1, S, Hkv, D]
    v = _gather_seq_kv(v_cache, table, seq_len)
    q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[None]  # [1, L]
    seq_lens = torch.full((1,), seq_len, device=q.device)
    return _attend(q[None], k, v, q_pos, seq_lens, scale)[0]


def _host_lens(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    if meta.query_lens_cpu is not None and meta.seq_lens_cpu is not None:
        return meta.query_lens_cpu, meta.seq_lens_cpu
    q_start = meta.query_start_loc.tolist()
    return [b - a for a, b in zip(q_start, q_start[1:], strict=False)], meta.seq_lens.tolist()


def _gather_seq_kv(cache: Tensor, block_tables: Tensor, max_seq_len: int) -> Tensor:
    """Each sequence's first ``max_seq_len`` cache rows: [B, max_seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [B, nb, block_size, Hkv, D]
    return blocks.flatten(1, 2)[:, :max_seq_len]


def _attend(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Masked GQA attention in fp32.

    q: [B, L, Hq, D]; k, v: [B, S, Hkv, D]; q_pos: [B, L] position of each query (keys at
    positions <= q_pos are visible); seq_lens: [B] -> [B, L, Hq, D] fp32.
    """
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    key_pos = torch.arange(k.shape[1], device=q.device)  # [S]
    # Slots past a sequence's end were never written (may hold NaN garbage): zero them so that
    # their zero attention weight cannot turn into 0 * NaN.
    is_written = (key_pos[None, :] < seq_lens[:, None])[:, :, None, None]  # [B, S, 1, 1]
    k = torch.where(is_written, k.float(), 0.0)
    v = torch.where(is_written, v.float(), 0.0)
    q5 = q.float().view(batch, num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("blhgd,bshd->bhgls", q5, k) * scale  # [B, Hkv, G, L, S]
    is_visible = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, L, S]; key 0 always visible
    scores = scores.masked_fill(~is_visible[:, None, None], float("-inf"))
    out = torch.einsum("bhgls,bshd->blhgd", scores.softmax(dim=-1), v)
    return out.reshape(batch, num_q, num_heads, head_dim)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, optionally after adding a residual.

    Returns ``(norm(r) * weight, r)`` with ``r = x`` (no residual) or ``r = x + residual``.
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), x


def rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate-half (NeoX / HF) rotary embedding of q [T, Hq, D] and k [T, Hkv, D].

    positions: [T] int64; cos_sin_cache: [max_pos, D] fp32 = cat(cos[:, :D/2], sin[:, :D/2]).
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)


def _rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, H, D/2]
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU activation: x [T, 2I] = (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_store_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos_sin_cache: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    """``rope`` then ``store_kv``: write the rotated k and v into the cache and the rotated k
    back into k (as the fused kernel does), return rotated q.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; positions, slot_mapping: [T] int64 (slots < 0 are
    padding); cos_sin_cache: [max_pos, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    -> q rotated [T, Hq, D] (a new tensor; q itself is left as it is).
    """
    q, k_rot = rope(q, k, positions, cos_sin_cache)
    k.copy_(k_rot)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """``x [T, K] @ weight[N, K]^T (+ bias [N]) (+ residual [T, N])`` -> [T, N].

    ``residual`` is the residual stream, handed over: an implementation may write the sum into
    it (the Triton ops do past the GEMV rows, saving a device copy), so a caller that still
    needs it passes a copy. The same holds for ``silu_mul_linear`` and ``mlp``."""
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


def rms_norm_linear(
    x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None = None
) -> Tensor:
    """``rms_norm(x) * norm_weight`` then ``linear``: x [T, K] -> [T, N]."""
    normed, _ = rms_norm(x, norm_weight, eps)
    return linear(normed, weight, bias)


def silu_mul_linear(gate_up: Tensor, weight: Tensor, residual: Tensor | None = None) -> Tensor:
    """``silu_and_mul`` then ``linear`` (+ residual): gate_up [T, 2I] -> [T, N]."""
    return linear(silu_and_mul(gate_up), weight, None, residual)


def mlp(
    residual: Tensor, norm_weight: Tensor, eps: float, gate_up_weight: Tensor, down_weight: Tensor
) -> Tensor:
    """Pre-norm SwiGLU block: ``residual + down(silu(gate) * up)`` of ``rms_norm(residual)``,
    gate_up_weight [2I, H] = [W_gate; W_up], down_weight [H, I]: [T, H] -> [T, H]."""
    gate_up = rms_norm_linear(residual, norm_weight, eps, gate_up_weight)
    return silu_mul_linear(gate_up, down_weight, residual)
