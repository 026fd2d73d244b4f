"""DecoderLM over the paged cache vs transformers on tiny random Llama / Qwen2 / Qwen3 models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_helpers import PagedSeq, forward_step, new_kv_pool
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from verifypd.engine.loader import load_model
from verifypd.engine.rope import build_cos_sin_cache
from verifypd.kernels import get_ops, reference

BLOCK_SIZE = 4
NUM_BLOCKS = 40
MIN_COSINE = 0.9999
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
             "original_max_position_embeddings": 64},
}  # fmt: skip
CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters=ROPE["default"])),
    "llama-llama3": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters=ROPE["llama3"])),
    "llama-linear": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters=ROPE["linear"])),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2-untied-yarn": (
        Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=False, rope_parameters=ROPE["yarn"])
    ),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
}  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF inits biases to 0 and norms to 1; make every parameter matter (and be peaky)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    """(transformers model, our LoadedModel) sharing weights through a sharded safetensors dir."""
    model_cls, config_cls, extra = CASES[request.param]
    hf = model_cls(config_cls(**TINY, **extra, attn_implementation="eager")).eval()
    _randomize(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    ours = load_model(str(path), torch.device("cpu"), torch.float32, get_ops())
    return hf, ours


@pytest.fixture(scope="module", params=["llama", "qwen2-tied", "qwen3"])
def triton_models(request, tmp_path_factory):
    """(transformers model, our model on the Triton ops): run by the interpreter on CPU."""
    model_cls, config_cls, extra = CASES[request.param]
    hf = model_cls(config_cls(**TINY, **extra, attn_implementation="eager")).eval()
    _randomize(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param + "-triton")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(str(path), torch.device("cpu"), torch.float32, get_ops(use_triton=True))


@torch.inference_mode()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def _assert_close_logits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    cosine = F.cosine_similarity(ours.double(), expected.double(), dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _paged_seqs(token_lists: list[list[int]], seed: int) -> list[PagedSeq]:
    """Sequences with interleaved, shuffled block ids (never block 0: padding points there)."""
    free = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
    free = free.tolist()
    return [
        PagedSeq(ids, [free.pop() for _ in range(-(-len(ids) // BLOCK_SIZE))])
        for ids in token_lists
    ]


@pytest.fixture(params=["padded", "per_seq"])
def attention_path(request, monkeypatch):
    """Run prefill batches through either reference attention path."""
    if request.param == "per_seq":
        monkeypatch.setattr(reference, "MAX_PADDED_SCORES", 0)
    return request.param


def test_prefill_batch_matches_hf(models, attention_path):
    hf, ours = models
    prompts = _prompts([7, 13, 10], seed=0)
    seqs = _paged_seqs(prompts, seed=1)
    kv = new_kv_pool(ours.config, NUM_BLOCKS, BLOCK_SIZE)

    logits = forward_step(ours.model, kv, seqs, [len(p) for p in prompts])

    for prompt, seq_logits in zip(prompts, logits, strict=True):
        _assert_close_logits(seq_logits, _hf_logits(hf, prompt))


def test_decode_steps_match_hf(models):
    """Prefill, then one token per sequence per step (teacher-forced) through the cache."""
    hf, ours = models
    prompt_lens, num_decode = [5, 9, 6], 7
    full = _prompts([n + num_decode for n in prompt_lens], seed=2)
    seqs = _paged_seqs(full, seed=3)
    kv = new_kv_pool(ours.config, NUM_BLOCKS, BLOCK_SIZE)

    outputs = [[x] for x in forward_step(ours.model, kv, seqs, prompt_lens)]
    for _ in range(num_decode - 1):
        for out, step in zip(outputs, forward_step(ours.model, kv, seqs, [1, 1, 1]), strict=True):
            out.append(step)

    for ids, out in zip(full, outputs, strict=True):
        _assert_close_logits(torch.cat(out), _hf_logits(hf, ids)[: len(ids) - 1])


def test_chunked_prefill_next_to_decode_matches_hf(models, attention_path):
    """A 15-token prompt in chunks 6 + 5 + 4 while another sequence decodes in the same batch."""
    hf, ours = models
    long_ids, short_ids = _prompts([15, 10], seed=4)
    long_seq, short_seq = _paged_seqs([long_ids, short_ids], seed=5)
    kv = new_kv_pool(ours.config, NUM_BLOCKS, BLOCK_SIZE)

    short_out = forward_step(ours.model, kv, [short_seq], [7])
    long_out = []
    for chunk in (6, 5, 4):
        chunk_logits, decode_logits = forward_step(
            ours.model, kv, [long_seq, short_seq], [chunk, 1]
        )
        long_out.append(chunk_logits)
        short_out.append(decode_logits)

    _assert_close_logits(torch.cat(long_out), _hf_logits(hf, long_ids))
    _assert_close_logits(torch.cat(short_out), _hf_logits(hf, short_ids))


@pytest.mark.parametrize("rope", list(ROPE))
def test_cos_sin_cache_matches_transformers(rope):
    config = LlamaConfig(**TINY, rope_parameters=dict(ROPE[rope]))
    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.arange(config.max_position_embeddings)[None]
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]
    half = cos.shape[-1] // 2
    scaling = None if rope == "default" else ROPE[rope]
    theta = ROPE[rope]["rope_theta"]

    cache = build_cos_sin_cache(16, theta, scaling, config.max_position_embeddings)

    torch.testing.assert_close(cache, torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1))


def test_unsupported_rope_type_raises():
    with pytest.raises(ValueError, match="rope_scaling type"):
        build_cos_sin_cache(16, 10000.0, {"rope_type": "longrope", "factor": 2.0}, 32)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the Triton ops on CPU tensors under TRITON_INTERPRET, which conftest sets only "
    "without a GPU; on a GPU tests/kernels checks each kernel's CUDA build against its reference",
)
def test_triton_ops_prefill_then_single_token_decode_matches_hf(triton_models):
    """The Triton op table end to end: prefill (separate norm + matmul), then batch-1 decode
    steps (one row: the fused norm/SwiGLU/bias GEMV, fused rope + KV store, split-K attention)."""
    hf, ours = triton_models
    (ids,) = _prompts([12], seed=6)
    (seq,) = _paged_seqs([ids], seed=7)
    kv = new_kv_pool(ours.config, NUM_BLOCKS, BLOCK_SIZE)

    out = forward_step(ours.model, kv, [seq], [6])
    for _ in range(5):
        out += forward_step(ours.model, kv, [seq], [1])

    _assert_close_logits(torch.cat(out), _hf_logits(hf, ids)[:11])
