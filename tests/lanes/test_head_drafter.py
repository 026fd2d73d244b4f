"""A drafter whose embedding reads more ids than its LM head scores
(``ModelConfig.embed_vocab_size``, the shape of an EAGLE-3 draft head: the target's whole
vocabulary in, a smaller one out; the ``dummy:qwen2.5-7b-head`` preset and its CPU twin
``dummy:tiny-head``). Target ids the head cannot score still reach its embedding, its drafts
are ids it scores, and speculation with it stays token-identical to plain greedy decoding,
chained drafts included."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from helpers import generate_all, tiny_config, tiny_draft_spec

from verifypd.config import PRESETS, ModelConfig
from verifypd.engine.loader import init_dummy_weights, load_model
from verifypd.engine.model import DecoderLM
from verifypd.engine.speculative import DraftModelProposer
from verifypd.kernels import get_ops
from verifypd.lanes.async_engine import AsyncEngine
from verifypd.types import SamplingParams

HEAD = "dummy:tiny-head"
SCORED, READ = PRESETS["tiny-head"].vocab_size, PRESETS["tiny-head"].embed_vocab_size
# Ids on both sides of the head's vocabulary, in the prompts and (from the target) the output.
PROMPTS = [[300, 2, 400, 4, 5, 300, 2, 400], [7] * 30, list(range(240, 290)), [511, 8, 256]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_the_config_keeps_the_embedding_at_least_the_heads_width():
    tiny = PRESETS["tiny"]
    assert tiny.embed_vocab_size == tiny.vocab_size  # 0: the same
    with pytest.raises(ValueError, match="embed_vocab_size"):
        ModelConfig("llama", 256, 64, 128, 1, 4, 2, embed_vocab_size=128)
    head = PRESETS["qwen2.5-7b-head"]
    assert (head.vocab_size, head.embed_vocab_size) == (32000, PRESETS["qwen2.5-7b"].vocab_size)
    target, h = PRESETS["qwen2.5-7b"], head.hidden_size
    target_layer = (target.num_params - 2 * target.vocab_size * h - h) // target.num_layers
    assert head.num_params == target_layer + (head.embed_vocab_size + head.vocab_size) * h + h


@pytest.mark.parametrize("tied", [False, True])
def test_logits_score_the_head_vocabulary_of_any_id_read(tied):
    cfg = ModelConfig("llama", 48, 32, 64, 1, 4, 2, embed_vocab_size=80, tie_word_embeddings=tied)
    model = DecoderLM(cfg, get_ops(), device="cpu", dtype=torch.float32)
    init_dummy_weights(model, seed=0)
    assert model.embed_tokens.weight.shape[0] == 80
    hidden = torch.randn(3, 32)
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, 48)
    head = model.embed_tokens.weight[:48] if tied else model.lm_head.weight
    torch.testing.assert_close(logits, hidden @ head.T)


def test_the_proposer_feeds_every_id_its_embedding_reads():
    loaded = load_model(HEAD, torch.device("cpu"), torch.float32, get_ops())
    prop = DraftModelProposer(loaded, 32, 4, torch.device("cpu"), torch.float32)
    assert (prop.vocab_size, prop.input_vocab) == (SCORED, READ)
    assert prop._drafter_ids([3, SCORED, READ - 1, READ]) == [3, SCORED, READ - 1, 0]


def _engine(lane_mode: str, chain: bool) -> AsyncEngine:
    spec = tiny_draft_spec(draft_model=HEAD, chain_drafts=chain)
    engine = AsyncEngine(tiny_config(lane_mode=lane_mode, spec=spec))
    _truncate_target_into_head(engine)
    return engine


def _truncate_target_into_head(engine: AsyncEngine) -> None:
    """The head as the target's first layer scoring its first ``SCORED`` ids: it agrees with
    the target's two layers now and then, so rounds accept some drafts and reject others."""
    target = engine.core.loaded.model
    head = engine.core.spec.drafter.runner.model
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.embed_tokens.weight)
        head.layers[0].load_state_dict(target.layers[0].state_dict())
        head.norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[:SCORED])


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    async def run() -> list[list[int]]:
        engine = AsyncEngine(tiny_config(lane_mode="single"))
        try:
            return await generate_all(engine, PROMPTS, GREEDY)
        finally:
            await engine.stop()

    out = asyncio.run(run())
    assert any(t >= SCORED for o in out for t in o)  # the target outputs ids the head cannot score
    return out


@pytest.mark.parametrize(("lane_mode", "chain"), [("three", True), ("single", False)])
async def test_speculating_with_a_head_is_plain_greedy(reference, lane_mode, chain):
    engine = _engine(lane_mode, chain)
    spec, record, counts, drafted = engine.core.spec, engine.core.spec.record, Counter(), []

    def spy(entry, new_ids):
        drafted.extend(entry.draft_ids())
        accepted = record(entry, new_ids)
        counts[accepted > 0] += 1
        return accepted

    spec.record = spy
    assert await generate_all(engine, PROMPTS, GREEDY) == reference
    assert drafted and all(0 <= t < SCORED for t in drafted)
    assert counts[True] > 0 and counts[False] > 0  # rounds that kept drafts and ones that did not
    if chain:
        assert spec.drafter.num_adopted > 0
