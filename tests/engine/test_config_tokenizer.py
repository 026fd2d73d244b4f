"""``EngineConfig.tokenizer`` replaces the model's own tokenizer (it used to be ignored)."""

from __future__ import annotations

from pathlib import Path

from helpers import tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verifypd.config import PRESETS, CacheConfig
from verifypd.engine.core import EngineCore


def test_engine_config_tokenizer_is_used(tmp_path: Path) -> None:
    vocab = PRESETS["tiny"].vocab_size
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>").save_pretrained(tmp_path)
    config = tiny_config(tokenizer=str(tmp_path), cache=CacheConfig(num_blocks=16))
    core = EngineCore(config)
    assert core.tokenizer.decode([5, 7]) == "<5> <7>"
    assert core.tokenizer.encode("<9> <3>", add_special_tokens=False) == [9, 3]
