"""Tokenizer loading: HF directories, GGUF files (converted once, then cached) and dummy presets.

Converting the tokenizer embedded in a GGUF file takes seconds, so the converted tokenizer is
saved under ``$VERIFYPD_CACHE/tokenizers`` (default ``~/.cache/verifypd/tokenizers``), keyed by
the file's name, size and mtime, and loaded from there next time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from verifypd.config import PRESETS, ModelConfig
from verifypd.model_config import DUMMY_PREFIX

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Dummy presets that share the vocabulary of the embedded model reuse its real tokenizer.
_EMBEDDED_VOCAB_PRESETS = ("smollm2-135m",)


def load_tokenizer(source: str | Path, config: ModelConfig | None = None) -> Any:
    """Tokenizer for a model spec: ``default``, ``dummy:PRESET``, an HF dir or a ``.gguf`` file.

    An HF directory without tokenizer files gets a ``DummyTokenizer`` sized from ``config``
    (with a warning); without ``config`` that is an error.
    """
    spec = str(source)
    if spec == "default":
        from verifypd.engine.loader import find_default_gguf

        return _load_gguf_tokenizer(find_default_gguf())
    if spec.startswith(DUMMY_PREFIX):
        return _load_dummy_preset(spec.removeprefix(DUMMY_PREFIX))
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_tokenizer(path)
    if path.is_dir():
        return _load_hf_dir_tokenizer(path, config)
    raise ValueError(f"no tokenizer at {spec!r}: expected default, dummy:PRESET, a dir or .gguf")


def eos_token_ids(config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Union of the checkpoint's eos ids and the tokenizer's ``eos_token_id``, sorted."""
    ids = set(config.eos_token_ids)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None:
        ids.add(int(tokenizer_eos))
    return tuple(sorted(ids))


def _load_hf_dir_tokenizer(path: Path, config: ModelConfig | None) -> Any:
    if any((path / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    if config is None:
        raise ValueError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    logger.warning("%s has no tokenizer files; using a DummyTokenizer", path)
    return DummyTokenizer(config.vocab_size, _first(config.eos_token_ids), config.bos_token_id)


def _load_dummy_preset(preset: str) -> Any:
    if preset not in PRESETS:
        raise ValueError(f"unknown dummy preset {preset!r}; known: {sorted(PRESETS)}")
    if preset in _EMBEDDED_VOCAB_PRESETS:
        return load_tokenizer("default")
    cfg = PRESETS[preset]
    return DummyTokenizer(cfg.vocab_size, _first(cfg.eos_token_ids), cfg.bos_token_id)


def _first(ids: tuple[int, ...]) -> int | None:
    return ids[0] if ids else None


# ----------------------------------------------------------------------------- GGUF + cache
def tokenizer_cache_dir(gguf_path: Path) -> Path:
    """Where the converted tokenizer of ``gguf_path`` is cached (name + size/mtime hash)."""
    root = Path(os.environ.get("VERIFYPD_CACHE") or Path.home() / ".cache" / "verifypd")
    stat = gguf_path.stat()
    digest = hashlib.sha1(f"{stat.st_size}-{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return root / "tokenizers" / f"{gguf_path.stem}-{digest}"


def _load_gguf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    cache_dir = tokenizer_cache_dir(gguf_path)
    if (cache_dir / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(cache_dir)
        except Exception as exc:  # a corrupt cache entry: rebuild it
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cache_dir, exc)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _save_to_cache(tokenizer, cache_dir)
    return tokenizer


def _save_to_cache(tokenizer: Any, cache_dir: Path) -> None:
    """Save atomically (temp dir + rename) so concurrent processes never see half a cache.

    Caching is best effort: a read-only home or a racing writer only costs a warning.
    """
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.", dir=cache_dir.parent))
    except OSError as exc:
        logger.warning("could not cache tokenizer at %s: %s", cache_dir, exc)
        return
    try:
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(cache_dir, ignore_errors=True)  # only an unreadable entry gets here
        os.replace(tmp, cache_dir)
    except OSError as exc:
        logger.warning("could not cache tokenizer at %s: %s", cache_dir, exc)
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- dummy tokenizer
class DummyTokenizer:
    """A tiny stand-in with the HF tokenizer methods the engine uses, for dummy-weight models.

    Bytes of UTF-8 text map to ids ``BYTE_OFFSET + byte`` (mod vocab); any id decodes without
    failing: byte ids back to their bytes, other ids to ``<|id|>``.
    """

    BYTE_OFFSET = 3  # ids 0..2 are left to unk/bos/eos

    def __init__(self, vocab_size: int, eos_token_id: int | None, bos_token_id: int | None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.pad_token_id = eos_token_id
        self.all_special_ids = [i for i in (bos_token_id, eos_token_id) if i is not None]
        self.eos_token = None if eos_token_id is None else self._id_to_token(eos_token_id)
        self.chat_template = None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, **_: object) -> list[int]:
        ids = [(self.BYTE_OFFSET + b) % self.vocab_size for b in text.encode("utf-8")]
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False, **_: object) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        pieces: list[str] = []
        pending = bytearray()
        for token_id in ids:
            byte = self._id_to_byte(token_id)
            if byte is not None:
                pending.append(byte)
                continue
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            pieces.append(self._id_to_token(token_id))
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_: Any,
    ) -> str | list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _id_to_byte(self, token_id: int) -> int | None:
        if token_id in self.all_special_ids:
            return None
        byte = token_id - self.BYTE_OFFSET
        return byte if 0 <= byte < 256 else None

    def _id_to_token(self, token_id: int) -> str:
        byte = self._id_to_byte(token_id)
        if byte is not None and 32 <= byte < 127:
            return chr(byte)
        return f"<|{token_id}|>"
