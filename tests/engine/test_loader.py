"""Loaders and tokenizers: the embedded SmolLM2 GGUF vs transformers, dummy presets, errors.

``hf_smollm`` (tests/conftest.py, session scope) is transformers' own GGUF loading of that file.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from paged_helpers import PagedSeq, forward_step, new_kv_pool
from transformers import LlamaConfig, LlamaForCausalLM

from verifypd.config import PRESETS
from verifypd.engine.loader import (
    DEFAULT_MODEL_NAME,
    ModelNotFoundError,
    find_default_gguf,
    load_model,
    unpermute_llama_rotary,
)
from verifypd.engine.model import DecoderLM
from verifypd.engine.tokenizer import DummyTokenizer, load_tokenizer, tokenizer_cache_dir
from verifypd.kernels import get_ops

CPU = torch.device("cpu")
BLOCK_SIZE = 16
MIN_COSINE = 0.9999


# ----------------------------------------------------------------------------- embedded GGUF
@pytest.fixture(scope="module")
def smollm():
    return load_model("default", CPU, torch.float32, get_ops())


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NUM_GREEDY = 16


@pytest.fixture(scope="module")
def smollm_greedy(smollm):
    """Both prompts prefilled together (interleaved blocks), then 16 greedy tokens each, one
    decode batch per step. Returns per prompt: (prompt ids, generated ids, logits [L + 15, V])."""
    prompts = [_chat_ids(smollm.tokenizer, p) for p in PROMPTS]
    seqs = [PagedSeq(list(ids), [1 + i, 3 + i, 5 + i, 7 + i]) for i, ids in enumerate(prompts)]
    kv = new_kv_pool(smollm.config, 9, BLOCK_SIZE)
    logits: list[list[torch.Tensor]] = [[], []]
    steps = [len(ids) for ids in prompts]
    for _ in range(NUM_GREEDY):
        step_logits = forward_step(smollm.model, kv, seqs, steps)
        for seq, out, step in zip(seqs, logits, step_logits, strict=True):
            out.append(step)
            seq.token_ids.append(int(step[-1].argmax()))
        steps = [1, 1]
    return [
        (ids, seq.token_ids[len(ids) :], torch.cat(out))
        for ids, seq, out in zip(prompts, seqs, logits, strict=True)
    ]


def _chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=False)


def test_default_model_config_and_tokenizer(smollm):
    cfg = smollm.config
    assert smollm.name == DEFAULT_MODEL_NAME
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and smollm.model.lm_head is None
    assert smollm.tokenizer.eos_token_id == 2
    assert smollm.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert smollm.eos_token_ids == (2,)
    assert (tokenizer_cache_dir(find_default_gguf()) / "tokenizer_config.json").exists()


def test_default_model_logits_match_transformers(smollm_greedy, hf_smollm):
    """Prefill and decode logits at every position vs one transformers forward over the
    prompt + generated tokens; its argmax is then our greedy token at every step."""
    for prompt, generated, ours in smollm_greedy:
        ids = prompt + generated[:-1]
        with torch.inference_mode():
            expected = hf_smollm(torch.tensor([ids])).logits[0]
        cosine = F.cosine_similarity(ours.double(), expected.double(), dim=-1)
        assert cosine.min().item() >= MIN_COSINE
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_default_model_greedy_matches_transformers_generate(smollm, smollm_greedy, hf_smollm):
    for prompt, generated, _ in smollm_greedy:
        with torch.inference_mode():
            out = hf_smollm.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_GREEDY, do_sample=False, pad_token_id=2
            )
        expected = out[0, len(prompt) :].tolist()
        ours = generated[: len(expected)]  # transformers stops early at eos
        assert ours == expected, (smollm.tokenizer.decode(ours), smollm.tokenizer.decode(expected))


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp (convert_hf_to_gguf) interleaves each head's two rotary halves."""
    num_heads, head_dim = 3, 8
    weight = torch.randn(num_heads * head_dim, 5)
    halves = weight.reshape(num_heads, 2, head_dim // 2, 5)
    llama_cpp = halves.transpose(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_llama_rotary(llama_cpp, num_heads), weight)


# ----------------------------------------------------------------------------- dummy presets
def test_dummy_tiny_is_seeded_and_finite():
    a = load_model("dummy:tiny", CPU, torch.float32, get_ops(), seed=7)
    b = load_model("dummy:tiny", CPU, torch.float32, get_ops(), seed=7)
    c = load_model("dummy:tiny", CPU, torch.float32, get_ops(), seed=8)
    assert a.name == "dummy:tiny" and isinstance(a.tokenizer, DummyTokenizer)
    for (name, pa), pb, pc in zip(
        a.model.named_parameters(), b.model.parameters(), c.model.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name

    seq = PagedSeq(a.tokenizer.encode("hello dummy"), [3])
    kv = new_kv_pool(a.config, 4, BLOCK_SIZE)
    (logits,) = forward_step(a.model, kv, [seq], [len(seq.token_ids)])
    assert logits.shape == (len(seq.token_ids), a.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.dtype == torch.float32


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_shapes_on_meta_device(preset):
    """Real shapes without allocating: parameter count agrees with ModelConfig.num_params."""
    cfg = PRESETS[preset]
    model = DecoderLM(cfg, get_ops(), device="meta", dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    uncounted = ("bias", "q_norm.weight", "k_norm.weight")  # not in ModelConfig.num_params
    extra = sum(p.numel() for n, p in params.items() if n.endswith(uncounted))
    assert sum(p.numel() for p in params.values()) - extra == cfg.num_params
    qkv = params["layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    gate_up = params["layers.0.mlp.gate_up_proj.weight"]
    assert gate_up.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert ("layers.0.self_attn.qkv_proj.bias" in params) == cfg.attention_bias
    assert ("layers.0.self_attn.q_norm.weight" in params) == cfg.qk_norm
    assert ("lm_head.weight" in params) != cfg.tie_word_embeddings
    assert model.cos_sin_cache.shape == (cfg.max_position_embeddings, cfg.head_dim)


def test_dummy_qwen3_loads_on_meta_device():
    loaded = load_model("dummy:qwen3-0.6b", torch.device("meta"), torch.bfloat16, get_ops())
    assert loaded.config.qk_norm and loaded.model.embed_tokens.weight.is_meta


# ----------------------------------------------------------------------------- tokenizers
def test_dummy_tokenizer_round_trip_and_total_decode():
    tok = DummyTokenizer(512, eos_token_id=2, bos_token_id=1)
    ids = tok.encode("héllo, wörld", add_special_tokens=True)
    assert ids[0] == 1 and max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == "héllo, wörld"
    assert isinstance(tok.decode(list(range(512))), str)  # any id decodes
    assert tok.convert_ids_to_tokens([2, tok.encode("a", add_special_tokens=False)[0]]) == [
        "<|2|>",
        "a",
    ]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "system: be brief\nuser: hi\nassistant: "


def test_dummy_smollm2_preset_reuses_embedded_tokenizer(smollm):
    tok = load_tokenizer("dummy:smollm2-135m")
    assert tok.encode("Hello world") == smollm.tokenizer.encode("Hello world")


def test_tokenizer_cache_key_follows_file(tmp_path, monkeypatch):
    monkeypatch.setenv("VERIFYPD_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(12))
    first = tokenizer_cache_dir(model)
    model.write_bytes(b"GGUF" + bytes(20))
    second = tokenizer_cache_dir(model)
    assert first.parent == tmp_path / "cache" / "tokenizers" and first.name.startswith("m-")
    assert first != second


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("spec", ["dummy:nope", "/no/such/model", "model.bin", "llama"])
def test_bad_specs_raise_value_error(spec):
    with pytest.raises(ValueError):
        load_model(spec, CPU, torch.float32, get_ops())


def test_hf_dir_without_weights_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path), CPU, torch.float32, get_ops())


def test_hf_dir_with_missing_weight_raises(tmp_path):
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    state = {k: v for k, v in hf.state_dict().items() if "k_proj" not in k}
    hf.save_pretrained(tmp_path, state_dict=state, safe_serialization=True)
    with pytest.raises(ValueError, match="lacks"):
        load_model(str(tmp_path), CPU, torch.float32, get_ops())
