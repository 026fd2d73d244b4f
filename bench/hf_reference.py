"""The transformers reference of a verifypd ``ModelConfig``: its config (``hf_config``) and a
random-init model of the same shape (``build_hf_model``), for the benchmarks that run
transformers beside us and for the tests that check the shapes agree."""

from __future__ import annotations

from typing import Any

import torch

from verifypd.config import ModelConfig

_HF_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """transformers config fields (``config.json`` names) describing the same architecture."""
    kw: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) or None,
        "use_sliding_window": False,
    }
    if cfg.rope_scaling:
        kw["rope_scaling"] = {**cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}
    if cfg.arch != "qwen2":  # Qwen2 always has q/k/v bias in transformers
        kw["attention_bias"] = cfg.attention_bias
    return kw


def hf_config(cfg: ModelConfig) -> Any:
    """A transformers ``PretrainedConfig`` (Llama/Qwen2/Qwen3) for a verifypd ``ModelConfig``."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(_HF_TYPES[cfg.arch], **hf_config_kwargs(cfg))
    theta = hf_rope_theta(hf)
    if theta is not None and abs(theta - cfg.rope_theta) > 1e-6 * cfg.rope_theta:
        raise ValueError(f"rope_theta did not carry over: {theta} != {cfg.rope_theta}")
    return hf


def hf_rope_theta(hf: Any) -> float | None:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(hf, "rope_theta", None)
    return None if theta is None else float(theta)


def build_hf_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, attn: str):
    """Random-init HF causal LM of the same shape, created in ``dtype`` directly on ``device``."""
    from transformers import AutoModelForCausalLM

    hf = hf_config(cfg)
    errors = []
    for dtype_kw in ("dtype", "torch_dtype"):
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(
                    hf, attn_implementation=attn, **{dtype_kw: dtype}
                )
            return model.eval()
        except TypeError as exc:  # older/newer transformers name the dtype argument differently
            errors.append(exc)
    raise errors[-1]


def hf_dtype_of(model: Any) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
