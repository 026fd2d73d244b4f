"""Model shapes: ``ModelConfig`` (one decoder-only checkpoint's shape and numerics, read from a
Hugging Face ``config.json``) and the ``dummy:PRESET`` shapes of public checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only checkpoint (Llama, Qwen2, Qwen3 families)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope_scaling as a sorted tuple of (key, value) pairs (hashable), or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Rows of the input embedding when it reads more ids than the LM head scores (0: the
    # same as ``vocab_size``). A draft head in the style of EAGLE-3 reads the target's whole
    # vocabulary and scores a smaller one; ``vocab_size`` is always the logits' width.
    embed_vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; expected {ARCHITECTURES}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.embed_vocab_size == 0:
            object.__setattr__(self, "embed_vocab_size", self.vocab_size)
        if self.embed_vocab_size < self.vocab_size:
            raise ValueError(
                f"embed_vocab_size ({self.embed_vocab_size}) must be at least vocab_size "
                f"({self.vocab_size}): the LM head scores ids the embedding reads"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + self.embed_vocab_size * h + head + h

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict."""
        model_type = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
            model_type
        )
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            theta = scaling.get("rope_theta")
            scaling = None
        else:
            theta = None
        if theta is None:
            theta = cfg.get("rope_theta", 10000.0)
            if cfg.get("rope_parameters"):
                theta = cfg["rope_parameters"].get("rope_theta", theta)
        num_heads = cfg["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_freeze(scaling),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _freeze(d: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not d:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _qwen2(vocab, h, i, layers, heads, kv, tie, ctx=32768, theta=1e6) -> ModelConfig:
    return ModelConfig(
        "qwen2", vocab, h, i, layers, heads, kv, rms_norm_eps=1e-6, rope_theta=theta,
        max_position_embeddings=ctx, tie_word_embeddings=tie, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    )  # fmt: skip


# Real shapes of public checkpoints, used by ``dummy:PRESET`` (random weights).
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        "llama", 49152, 576, 1536, 30, 9, 3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False),
    "qwen3-0.6b": ModelConfig(
        "qwen3", 151936, 1024, 3072, 28, 16, 8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    # Not a checkpoint: one decoder layer of the Qwen2.5-7B's width reading its whole vocabulary
    # and scoring 32,000 ids, the bytes an EAGLE-3 draft head for that target reads per step
    # (its fc over the target's hidden states aside). With random weights it stands in for such a
    # head's cost under synthetic acceptance; the engine has no EAGLE head.
    "qwen2.5-7b-head": ModelConfig(
        "qwen2", 32000, 3584, 18944, 1, 28, 4, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, attention_bias=True, bos_token_id=151643,
        eos_token_ids=(151645, 151643), embed_vocab_size=152064,
    ),
    "llama-3-8b": ModelConfig(
        "llama", 128256, 4096, 14336, 32, 32, 8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    # A tiny shape for fast CPU tests of the whole engine with dummy weights.
    "tiny": ModelConfig(
        "llama", 512, 64, 128, 2, 4, 2, rms_norm_eps=1e-5, max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    # ... and a drafter for it shaped as qwen2.5-7b-head: one layer, all 512 ids read, 256 scored.
    "tiny-head": ModelConfig(
        "llama", 256, 64, 128, 1, 4, 2, rms_norm_eps=1e-5, max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,), embed_vocab_size=512,
    ),
}  # fmt: skip

DUMMY_PREFIX = "dummy:"  # a model spec "dummy:PRESET": random weights of a preset's shape


def dummy_preset(spec: str) -> ModelConfig | None:
    """The preset a ``dummy:PRESET`` model spec names (None for any other spec or name)."""
    return PRESETS.get(spec.removeprefix(DUMMY_PREFIX)) if spec.startswith(DUMMY_PREFIX) else None
