"""One decoder-only transformer for the Llama, Qwen2 and Qwen3 families over a paged KV cache.

Differences between the families are config flags: Qwen2 adds a bias to the q/k/v projection
(``attention_bias``), Qwen3 RMS-normalises every q and k head before RoPE (``qk_norm``).
Projections are fused: ``qkv_proj`` = [q | k | v] rows and ``gate_up_proj`` = [gate | up] rows.
All attention, norm and activation math goes through an ``Ops`` table (torch reference or
Triton), and ``forward`` is free of host syncs so it can be captured in a CUDA graph.
``forward_iter`` is the same forward as a generator that pauses between layer groups: an
eager prompt step is enqueued a few layers at a time, with the event loop free in between.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verifypd.config import ModelConfig
from verifypd.engine.rope import build_cos_sin_cache
from verifypd.kernels import Ops
from verifypd.kernels.metadata import AttentionMetadata

T = TypeVar("T")


def drain(steps: Generator[None, None, T]) -> T:
    """Runs a generator that only pauses (yields None) to its end; returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def packed_shard_sizes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Row sizes of the pieces stacked in each fused projection, in order."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv_proj": (q_size, kv_size, kv_size),
        "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size),
    }


def _empty(*shape: int, device: torch.device | None, dtype: torch.dtype | None) -> nn.Parameter:
    # Uninitialised on purpose: loaders fill every parameter (and check that they did).
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters (no init cost for big models)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, **factory) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, **factory)
        self.bias = _empty(out_features, **factory) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, **factory) -> None:
        super().__init__()
        self.weight = _empty(num_embeddings, dim, **factory)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class RMSNormWeight(nn.Module):
    """Holds a norm's weight; the math is ``ops.rms_norm``."""

    def __init__(self, dim: int, **factory) -> None:
        super().__init__()
        self.weight = _empty(dim, **factory)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, **factory) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        self.split_sizes = list(packed_shard_sizes(cfg)["qkv_proj"])
        qkv_size = sum(self.split_sizes)
        self.qkv_proj = Linear(cfg.hidden_size, qkv_size, cfg.attention_bias, **factory)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, **factory)
        self.q_norm = RMSNormWeight(cfg.head_dim, **factory) if cfg.qk_norm else None
        self.k_norm = RMSNormWeight(cfg.head_dim, **factory) if cfg.qk_norm else None

    def forward(
        self,
        residual: Tensor,  # [T, H], the residual stream
        norm_weight: Tensor,  # [H], the block's pre-norm
        eps: float,
        positions: Tensor,  # [T]
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: Tensor,  # [max_pos, D]
    ) -> Tensor:
        """Pre-norm attention block: returns the residual stream plus the block's output."""
        num_tokens = residual.shape[0]
        qkv_proj = self.qkv_proj
        qkv = self.ops.rms_norm_linear(residual, norm_weight, eps, qkv_proj.weight, qkv_proj.bias)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._head_norm(q, self.q_norm.weight), self._head_norm(k, self.k_norm.weight)
        q = self.ops.rope_store_kv(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping
        )
        # k now holds the rotated keys (rope_store_kv rotates it in place)
        out = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale, k, v)  # [T, Hq, D]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.ops.linear(out, self.o_proj.weight, None, residual)

    def _head_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm over each head: [T, H, D] -> [T, H, D]."""
        normed, _ = self.ops.rms_norm(x.reshape(-1, self.head_dim), weight, self.eps)
        return normed.view(x.shape)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, **factory) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, **factory)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, **factory)

    def forward(self, residual: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
        """Pre-norm SwiGLU block: residual stream [T, H] -> residual + MLP(norm(residual))."""
        w_gate_up, w_down = self.gate_up_proj.weight, self.down_proj.weight
        return self.ops.mlp(residual, norm_weight, eps, w_gate_up, w_down)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, **factory) -> None:
        super().__init__()
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, **factory)
        self.self_attn = Attention(cfg, ops, **factory)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, **factory)
        self.mlp = MLP(cfg, ops, **factory)

    def forward(
        self,
        residual: Tensor,  # [T, H], the residual stream
        positions: Tensor,
        kv_layer: Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        cos_sin_cache: Tensor,
    ) -> Tensor:
        """Two pre-norm blocks; each norm runs with the projection after it, and each block's
        last projection adds the residual stream in its epilogue."""
        residual = self.self_attn(
            residual, self.input_layernorm.weight, self.eps, positions,
            kv_layer[0], kv_layer[1], meta, cos_sin_cache,
        )  # fmt: skip
        return self.mlp(residual, self.post_attention_layernorm.weight, self.eps)


class DecoderLM(nn.Module):
    """Causal LM: embeddings, ``num_layers`` decoder layers, final norm and LM head.

    Parameters are created uninitialised on ``device`` in ``dtype`` (a loader fills them); the
    RoPE table stays fp32. Use the ``dtype`` argument rather than ``.to(dtype)``, which would
    also cast the RoPE table.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        factory = {"device": torch.device(device) if device is not None else None, "dtype": dtype}
        self.embed_tokens = Embedding(cfg.embed_vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, ops, **factory) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNormWeight(cfg.hidden_size, **factory)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, False, **factory)
        )
        cos_sin = build_cos_sin_cache(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling_dict,
            cfg.max_position_embeddings,
            factory["device"],
        )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_pos, D] fp32

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [T] int64; kv: [num_layers, 2, num_blocks, block_size, Hkv, D]
        -> final-norm hidden states [T, H]. Writes the new tokens' KV into ``kv``."""
        return drain(self.forward_iter(input_ids, positions, kv, meta))

    def forward_iter(
        self, input_ids: Tensor, positions: Tensor, kv: Tensor, meta: AttentionMetadata,
        every: int = 0,
    ) -> Generator[None, None, Tensor]:  # fmt: skip
        """``forward``, pausing (yielding None) after every ``every`` layers but the last
        (0: never); the hidden states are the generator's return value."""
        residual = self.embed_tokens(input_ids)  # [T, H]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            residual = layer(residual, positions, kv[i], meta, self.cos_sin_cache)
            if every and i < last and (i + 1) % every == 0:
                yield
        hidden, _ = self.ops.rms_norm(residual, self.norm.weight, self.cfg.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, H] -> [N, V] fp32 logits (tied embedding, its first V rows, or separate LM head)."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if head.shape[0] != self.cfg.vocab_size:  # tied, the embedding reading more ids
            head = head[: self.cfg.vocab_size]
        return self.ops.linear(hidden, head, None).float()
