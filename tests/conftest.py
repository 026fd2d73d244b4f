import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run on the interpreter. It must be chosen before the first
# ``@triton.jit`` runs, whichever test module happens to import a kernel module first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tiny_core():
    """A fresh ``EngineCore`` on ``dummy:tiny`` (CPU, fp32, default config); see helpers.py's
    ``tiny_config`` for other settings."""
    from helpers import tiny_config

    from verifypd.engine.core import EngineCore

    return EngineCore(tiny_config())


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own GGUF path: its config parsing, dequantization and q/k un-permutation.

    (``from_pretrained(gguf_file=...)`` needs accelerate; this is the same code without it, and
    parses the file once: the name-mapping template only needs the layer count.)
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from verifypd.engine.loader import find_default_gguf

    with torch.device("meta"):
        template = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30, hidden_size=8,
                                                intermediate_size=8, num_attention_heads=1,
                                                vocab_size=8))  # fmt: skip
    parsed = load_gguf_checkpoint(find_default_gguf(), return_tensors=True, model_to_load=template)
    config = AutoConfig.for_model(**parsed["config"])
    with torch.device("meta"):  # skip the random init: every weight is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(parsed["tensors"], strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers were on meta
    return model.eval()
