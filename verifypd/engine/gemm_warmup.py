"""Start-up: a prompt step's GEMMs at every row count it can have, run once before traffic comes.

cuBLAS chooses a kernel the first time it sees a GEMM shape, and a prompt step's first layer
pays that host time for each of its projections (on an H200 ~2.2 ms a GEMM against ~16 us once
seen: ``bench/gemm_host.py``). Prompt steps are padded to a row bucket
(``EngineConfig.prompt_token_bucket``), so their row counts are few; without this warm-up a
fresh server still paid for each one the first time a prompt step had it, over its first
traffic. Here layer 0's projections run at every padded row count, through the same ops the
forward calls (norm, bias, the residual added in the epilogue: each its own cuBLAS call), on
zeros: the other layers' shapes are the same.
"""

from __future__ import annotations

import torch

from verifypd.engine.model import DecoderLM


@torch.inference_mode()
def warm_prompt_gemms(model: DecoderLM, rows: list[int]) -> int:
    """Runs layer 0's q/k/v, o, gate/up and down projections of ``model`` at every row count in
    ``rows`` (``StepInputBuilder.prompt_rows``); returns how many row counts ran."""
    if not rows:
        return 0
    cfg, ops, layer = model.cfg, model.ops, model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    weight = attn.qkv_proj.weight
    factory = {"device": weight.device, "dtype": weight.dtype}
    residual = torch.zeros(rows[-1], cfg.hidden_size, **factory)  # [T, H]
    attn_out = torch.zeros(rows[-1], cfg.num_heads * cfg.head_dim, **factory)  # [T, Hq * D]
    for m in rows:
        # Zeros in, zeros out: the residual stream (written in place) stays zero.
        ops.rms_norm_linear(residual[:m], layer.input_layernorm.weight, cfg.rms_norm_eps,
                            attn.qkv_proj.weight, attn.qkv_proj.bias)  # fmt: skip
        ops.linear(attn_out[:m], attn.o_proj.weight, None, residual[:m])
        ops.mlp(residual[:m], layer.post_attention_layernorm.weight, cfg.rms_norm_eps,
                mlp.gate_up_proj.weight, mlp.down_proj.weight)  # fmt: skip
    if weight.device.type == "cuda":
        torch.cuda.synchronize(weight.device)
    return len(rows)
