"""Where ``--model`` points, checked before anything loads (CLI layer).

``default``, ``dummy:PRESET`` and existing local paths pass through; a Hugging Face model id
(``Qwen/Qwen2.5-7B-Instruct``) becomes its snapshot in the local Hugging Face cache (there is
no download: the machines have no hub). Anything else is a :class:`ModelSourceError` whose
message is one line for the user.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from verifypd.model_config import DUMMY_PREFIX

HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """``--model`` names nothing loadable; the message is one line for the user."""


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the engine loads: default | dummy:PRESET | a local path
    hf_id: str | None = None  # the Hugging Face id it was resolved from, if any


def hf_hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it from the environment."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache_home = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache_home / "huggingface" / "hub"


def resolve_model(spec: str, cache_dir: Path, revision: str | None = None) -> ModelSource:
    """Turn a Hugging Face id into a local snapshot directory; reject specs that name nothing.

    What a local path or preset holds is checked by the loader (its errors are one line too).
    """
    if spec == "default" or spec.startswith(DUMMY_PREFIX) or Path(spec).expanduser().exists():
        return ModelSource(spec)
    if HF_ID.match(spec):
        return ModelSource(str(_from_hf_cache(spec, cache_dir, revision)), hf_id=spec)
    raise ModelSourceError(
        f"model {spec!r} not found: expected 'default', 'dummy:PRESET', a local HF directory "
        "or .gguf file, or a Hugging Face id (org/name) in the local Hugging Face cache"
    )


def _from_hf_cache(model_id: str, cache_dir: Path, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            model_id, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except LocalEntryNotFoundError:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelSourceError(
            f"model {model_id!r}{at} is neither a local path nor in the local Hugging Face cache "
            f"({cache_dir}), and verifypd does not download: fetch it first "
            f"(huggingface-cli download {model_id}) or pass a local directory"
        ) from None
    return Path(snapshot)
