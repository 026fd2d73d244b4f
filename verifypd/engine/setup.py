"""Engine set-up: device and dtype, the target model and its drafter, both KV pools sized
together, the scheduler, runner and speculative decoder, CUDA graphs and the start-up cost
calibration. ``build_engine`` returns the parts; ``EngineCore`` serves with them.

Order matters: the drafter's weights load before the pools are sized (both pools share one
budget), and the costs are measured after the graphs are captured (a step replays them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from verifypd.config import EngineConfig, ModelConfig, SpecConfig
from verifypd.costs import CostTable
from verifypd.engine import sampler
from verifypd.engine.calibrate import VERIFY_GRAPH_BATCH, measure_costs
from verifypd.engine.cuda_graphs import StepGraphs, warm_up_eager
from verifypd.engine.gemm_warmup import warm_prompt_gemms
from verifypd.engine.grammar import GrammarCompiler, GrammarTable
from verifypd.engine.kv_sizing import KVSizing, draft_graph_headroom, kv_budget, size_kv
from verifypd.engine.loader import LoadedModel, load_model
from verifypd.engine.prompt_in_decode import PromptInDecodeGraphs
from verifypd.engine.rejection import warm_noise
from verifypd.engine.runner import ModelRunner
from verifypd.engine.scheduler import Scheduler
from verifypd.engine.speculative import DraftModelProposer, SpecDecoder
from verifypd.kernels import get_ops
from verifypd.kvcache import KVCacheManager, KVPool
from verifypd.types import Observer

logger = logging.getLogger("verifypd")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CATCH_UP_CHUNK_BATCH = 8  # drafters catching up on a context at once in one chunk-graph replay
PROMPT_GRAPH_BATCH = 2  # prompts in one replay of the prompt graph (prompt_graph_tokens)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class EngineParts:
    """Everything one engine serves with (see the module docstring for how it is built)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    ops: Any  # the kernel set (``kernels.get_ops``)
    loaded: LoadedModel
    max_model_len: int
    use_cuda_graphs: bool
    kv_sizing: KVSizing
    pool: KVPool
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    grammars: GrammarTable
    spec: SpecDecoder
    cost_table: CostTable | None = None  # set once the graphs exist (``calibrate``)

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def build_engine(config: EngineConfig, observer: Observer) -> EngineParts:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    use_triton = config.use_triton if config.use_triton is not None else device.type == "cuda"
    ops = get_ops(use_triton, config.kernels)
    sampler.use_fused_noise(use_triton and config.kernels.fused_sampling_noise)
    loaded = load_model(
        config.model, device, dtype, ops, seed=config.seed, tokenizer=config.tokenizer
    )
    max_model_len = config.scheduler.max_model_len or loaded.config.max_position_embeddings
    use_cuda_graphs = config.cuda_graphs
    if use_cuda_graphs is None:
        use_cuda_graphs = device.type == "cuda" and use_triton
    draft = load_drafter(config, device, dtype, ops, loaded.config)
    draft_config = draft.config if draft is not None else None
    sizing = size_pools(config, loaded.config, draft_config, device, dtype, use_cuda_graphs)
    pool = target_pool(loaded.config, sizing.num_blocks, config.cache.block_size, dtype, device)
    kv = KVCacheManager(pool.num_blocks, pool.block_size, config.cache.enable_prefix_caching)
    eos = eos_token_ids(loaded)
    scheduler = Scheduler(
        kv,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_prefill_chunk=config.scheduler.max_prefill_chunk,
        max_model_len=max_model_len,
        eos_token_ids=eos,
        observer=observer,
        prefill_pack_tokens=config.scheduler.prefill_pack_tokens,
        prefill_pack_backlog_s=config.scheduler.prefill_pack_backlog_s,
    )
    runner = ModelRunner(
        loaded.model,
        pool,
        pool.block_size,
        device,
        synthetic_acceptance=config.spec.synthetic_acceptance,
        always_pad_verify=config.spec.always_pad_verify,
        prompt_token_bucket=config.prompt_token_bucket if device.type == "cuda" else 0,
    )
    runner.logits_processor.eos_token_ids = frozenset(eos)
    grammars = GrammarTable(GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, eos))
    runner.grammars = grammars
    drafter = None
    if draft is not None:  # its own pool of as many blocks as the target's (sized together)
        drafter = DraftModelProposer(draft, pool.num_blocks, pool.block_size, device, dtype)
        drafter.window = config.spec.draft_window
        drafter.window_sink = config.spec.draft_window_sink
    parts = EngineParts(
        config, device, dtype, ops, loaded, max_model_len, use_cuda_graphs, sizing, pool, kv,
        scheduler, runner, grammars, SpecDecoder(config.spec, drafter),
    )  # fmt: skip
    if config.warm_prompt_gemms:
        warm_prompt_steps(parts)
    if use_cuda_graphs:
        capture_graphs(parts)
    elif config.prompt_in_decode_eager:  # tests: prompts ride in decode steps without graphs
        prompt_in_decode_graphs(parts, capture=False)
    parts.cost_table = calibrate(parts)
    return parts


def warm_prompt_steps(parts: EngineParts) -> None:
    """The target's GEMMs at every padded row count of an eager prompt step
    (``EngineConfig.warm_prompt_gemms``; nothing where steps are not padded: CPU)."""
    rows = parts.runner.inputs.prompt_rows(parts.config.scheduler.max_num_batched_tokens)
    t0 = time.perf_counter()
    if warm_prompt_gemms(parts.loaded.model, rows):
        logger.info("prompt step GEMMs run at %d row counts (%d to %d) in %.1f s",
                    len(rows), rows[0], rows[-1], time.perf_counter() - t0)  # fmt: skip


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids = set(loaded.config.eos_token_ids)
    tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    return ids


def load_drafter(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    ops: Any,
    target: ModelConfig,
) -> LoadedModel | None:
    spec = config.spec
    if spec.method != "draft":
        return None
    draft = load_model(spec.draft_model, device, dtype, ops, seed=config.seed)
    if draft.config.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft model vocab ({draft.config.vocab_size}) is larger than the target's "
            f"({target.vocab_size}): they must share a tokenizer"
        )
    return draft


def size_pools(
    config: EngineConfig,
    target: ModelConfig,
    draft: ModelConfig | None,
    device: torch.device,
    dtype: torch.dtype,
    use_cuda_graphs: bool,
) -> KVSizing:
    """Both pools' block count (``engine.kv_sizing``); logged with the split."""
    cfg = config.cache
    max_seqs = config.scheduler.max_num_seqs
    max_model_len = config.scheduler.max_model_len or target.max_position_embeddings
    # Never more than every running sequence at full length could use.
    cap = max_seqs * (max_model_len // cfg.block_size + 1)
    budget = None
    if cfg.num_blocks is None:
        draft_headroom = 0
        if draft is not None and use_cuda_graphs:
            draft_headroom = draft_graph_headroom(draft, max_seqs, dtype)
        budget = kv_budget(device, cfg, draft_headroom)
    sizing = size_kv(target, draft, cfg.block_size, dtype, budget, cap, cfg.num_blocks)
    logger.info(sizing.describe())
    return sizing


def target_pool(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVPool:
    return KVPool(
        model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
    )


def capture_graphs(parts: EngineParts) -> None:
    """The target's decode and verify graphs, the drafter's q = 1 and q = 2 graphs, its
    catch-up graphs (``SpecConfig.catch_up_graphs``), its chunk graphs
    (``SpecConfig.catch_up_chunk``; with ``follow_prefill`` a second set for the follow stream,
    with ``follow_decode_stream`` "beside" or "below" one for the feed stream) and its chained
    steps, after an eager warm-up of every kernel."""
    if not parts.is_cuda:
        raise ValueError("cuda_graphs needs device=cuda")
    max_batch, max_len = parts.config.scheduler.max_num_seqs, parts.max_model_len
    logger.info("capturing CUDA graphs (batch sizes up to %d)", max_batch)
    drafter = parts.spec.drafter
    warm_up_eager(parts.loaded.model, parts.pool.kv, parts.block_size, max_len)
    vocabs = {parts.loaded.model.cfg.vocab_size}
    if drafter is not None:
        warm_up_eager(drafter.runner.model, drafter.pool.kv, parts.block_size, max_len)
        vocabs.add(drafter.runner.model.cfg.vocab_size)
    warm_noise(parts.device, vocabs)
    parts.runner.capture_graphs(1, max_batch, max_len)
    if (q := parts.config.prompt_graph_tokens) and q < max_len:  # short prompt steps
        parts.runner.capture_graphs(q, PROMPT_GRAPH_BATCH, max_len, with_logits=False)
        parts.runner.inputs.prompt_graph_tokens = q
    prompt_in_decode_graphs(parts, capture=True)
    if not parts.spec.enabled:
        return
    verify_batch = min(max_batch, VERIFY_GRAPH_BATCH)
    for draft_len in range(1, parts.config.spec.max_draft_len + 1):
        parts.runner.capture_graphs(1 + draft_len, verify_batch, max_len)
    if drafter is not None:
        drafter.runner.capture_graphs(1, max_batch, max_len)
        drafter.runner.capture_graphs(2, max_batch, max_len)
        spec = parts.config.spec
        for q in spec.catch_up_graphs:  # a few tokens behind: one replay
            drafter.runner.capture_graphs(q, verify_batch, max_len)
        short = spec.chunk_short_attention  # the chunk graphs' attention in pieces
        if spec.chunk_sizes and spec.catch_up_chunks:  # far behind: a few replays
            for q in spec.chunk_sizes:
                drafter.runner.capture_graphs(
                    q, CATCH_UP_CHUNK_BATCH, max_len, with_logits=False, short_attention=short
                )
            drafter.catch_up_chunk, drafter.catch_up_chunks = (
                spec.chunk_sizes,
                spec.catch_up_chunks,
            )
        if spec.follow_prefill and spec.chunk_sizes:  # the follow stream's own (follow_iter)
            drafter.follower.follow_graphs = _chunk_graph_set(drafter, spec, max_len)
        if spec.feeds_beside_decode and spec.chunk_sizes:  # the feed stream's own
            drafter.follower.feed_graphs = _chunk_graph_set(drafter, spec, max_len)
        drafter.warm_up_chain()


def _chunk_graph_set(
    drafter: DraftModelProposer, spec: SpecConfig, max_len: int
) -> dict[int, StepGraphs]:
    """A set of the drafter's chunk graphs with buffers and memory pools of their own, for a
    stream that replays them beside the proposer's (which replays the runner's)."""
    return {
        q: drafter.runner.new_graphs(q, CATCH_UP_CHUNK_BATCH, max_len, with_logits=False,
                                     short_attention=spec.chunk_short_attention)
        for q in spec.chunk_sizes
    }  # fmt: skip


def prompt_in_decode_graphs(parts: EngineParts, capture: bool) -> None:
    """The runner's graphs of decode steps carrying a prompt chunk (``EngineConfig.
    prompt_in_decode_tokens``; three lanes only: the single lane mixes prompts in anyway), one
    per size, sharing one graph memory pool (the largest captured first); not captured: the
    same buffers run eagerly (``EngineConfig.prompt_in_decode_eager``, tests)."""
    if parts.config.lane_mode != "three":
        return
    max_batch, max_len = parts.config.scheduler.max_num_seqs, parts.max_model_len
    pool = torch.cuda.graph_pool_handle() if capture else None
    for q in sorted(q for q in parts.config.prompt_in_decode_tokens if q < max_len)[::-1]:
        graphs = PromptInDecodeGraphs(
            parts.loaded.model, parts.pool.kv, parts.block_size, max_batch, max_len, q
        )
        if capture:
            graphs.capture(pool)
        parts.runner.inputs.prompt_in_decode.insert(0, graphs)  # ascending q


def decode_ahead_on(config: EngineConfig, is_cuda: bool) -> bool:
    """``EngineConfig.decode_ahead`` resolved: None is on a GPU, where a launch only enqueues."""
    return is_cuda if config.decode_ahead is None else config.decode_ahead


def calibration_wanted(config: EngineConfig, is_cuda: bool, speculating: bool) -> bool:
    """``EngineConfig.calibrate_costs`` resolved. None: on a GPU where anything reads the
    table: the speculation policy, the prefill bound (``prefill_step_target_s``), or
    decode-ahead's rule of waiting for a landing prompt (``lanes.decode_ahead.lands_first``;
    decode-ahead is on by default on a GPU). So a server without a drafter plans with the same
    measured costs as one with a drafter whose policy speculates for no one."""
    if config.calibrate_costs is not None:
        return config.calibrate_costs
    bound = config.scheduler.prefill_step_target_s is not None
    waits = decode_ahead_on(config, is_cuda) and config.decode_ahead_waits_for_prompts
    return is_cuda and (speculating or bound or waits)


def calibrate(parts: EngineParts) -> CostTable | None:
    """Step costs measured after graph capture (``engine.calibrate``), or None when off."""
    if not calibration_wanted(parts.config, parts.is_cuda, parts.spec.enabled):
        return None
    try:
        table = measure_costs(parts)
    except Exception:  # the policy falls back to its prior shape; serving goes on
        logger.exception("step-cost calibration failed; the policy learns costs online")
        return None
    logger.info("%s (calibrated in %.2f s)", table.summary(), table.meta["seconds"])
    return table
