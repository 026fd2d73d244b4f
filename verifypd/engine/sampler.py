"""Sync-free batched sampling: temperature, top-k, top-p, greedy.

Randomness is counter-based: the uniform for (seed, position, column, stream) is a hash of those
four integers computed with torch int64 ops, so a request's tokens depend only on its own seed
and positions, never on its batch-mates, and nothing is ever read back to the host.

Streams in use: 0 = plain sampling and drafting (``sample``), 1 = acceptance tests and
2 = correction/bonus tokens (``rejection``), 3 = synthetic acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from verifypd.kernels import triton_noise_race

# KernelConfig.fused_sampling_noise, set by the engine at start-up (``use_fused_noise``): on a
# GPU the noise runs as Triton kernels. Process-wide, as the kernel set is.
_fused_noise = False


def use_fused_noise(on: bool) -> None:
    """Sampling noise on a GPU as Triton kernels (True) or torch ops (False): the same bits."""
    global _fused_noise
    _fused_noise = bool(on)


def _int64(c: int) -> int:
    """A Python int reduced mod 2^64, as the signed int64 with the same bits."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _int64(0x9E3779B97F4A7C15)  # 2^64 / phi, the splitmix64 increment
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_STREAM = 0xD6E8FEB86659FD93
_UNIFORM_BITS = 23  # (k + 0.5) / 2^23 is exact in float32 and lies strictly inside (0, 1)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on negatives)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64 finalizer. int64 multiplication wraps: the mod-2^64 arithmetic we want."""
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: Tensor, positions: Tensor, num_cols: int, stream: int) -> Tensor:
    """Counter-based uniforms: ``[N], [N] -> [N, num_cols]`` float32 in the open interval (0, 1).

    Entry (i, c) is a pure function of (seeds[i], positions[i], c, stream). On a GPU with
    ``use_fused_noise`` one Triton kernel (``kernels.triton_noise_race``), else torch ops: the
    same bits.
    """
    if _fused_noise and seeds.is_cuda:
        return triton_noise_race.uniform_noise(seeds, positions, num_cols, stream)
    return uniform_noise_torch(seeds, positions, num_cols, stream)


def uniform_noise_torch(seeds: Tensor, positions: Tensor, num_cols: int, stream: int) -> Tensor:
    """``uniform_noise`` in torch int64 ops (the reference; about 45 kernels on a GPU)."""
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    row = _mix64(seeds + _int64(stream * _STREAM))  # [N]
    row = _mix64(row + positions * _GOLDEN)  # [N]
    cols = torch.arange(1, num_cols + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN
    bits = _shr(_mix64(row[:, None] + cols[None, :]), 64 - _UNIFORM_BITS)  # [N, C]
    return (bits.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)


_MASK64 = (1 << 64) - 1


def _mix64_int(x: int) -> int:
    """``_mix64`` on one unsigned 64-bit Python int (the same bits)."""
    x ^= x >> 30
    x = (x * _MIX1) & _MASK64
    x ^= x >> 27
    x = (x * _MIX2) & _MASK64
    return x ^ (x >> 31)


def uniform_host(seed: int, position: int, col: int, stream: int) -> float:
    """Entry (seed, position, col) of ``uniform_noise`` computed on the host: the same value,
    bit for bit (benchmark bookkeeping that must not launch GPU work)."""
    row = _mix64_int((seed + stream * _STREAM) & _MASK64)
    row = _mix64_int((row + position * _GOLDEN) & _MASK64)
    bits = _mix64_int((row + (col + 1) * _GOLDEN) & _MASK64) >> (64 - _UNIFORM_BITS)
    return (bits + 0.5) * 2.0**-_UNIFORM_BITS


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device."""

    temperature: Tensor  # [N] float32 (0 = greedy)
    top_k: Tensor  # [N] int64 (0 = off)
    top_p: Tensor  # [N] float32 (1 = off)
    seeds: Tensor  # [N] int64
    positions: Tensor  # [N] int64: index of the token being sampled in its sequence
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # False: no greedy row, so no one-hot rows to mix in (a few ops fewer a draw). True is
    # always correct.
    any_greedy: bool = True

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        seeds: list[int],
        positions: list[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        """Copy host lists to ``device`` (one pinned, non-blocking copy per field on CUDA)."""
        device = torch.device(device)
        sampled = [t > 0 for t in temperature]
        return cls(
            temperature=_to_device(temperature, torch.float32, device),
            top_k=_to_device(top_k, torch.int64, device),
            top_p=_to_device(top_p, torch.float32, device),
            seeds=_to_device(seeds, torch.int64, device),
            positions=_to_device(positions, torch.int64, device),
            all_greedy=not any(sampled),
            any_top_k=any(s and k > 0 for s, k in zip(sampled, top_k, strict=True)),
            any_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_p, strict=True)),
            any_greedy=not all(sampled),
        )

    def prefix(self, rows: int, advance: int) -> SamplingTensors:
        """The first ``rows`` rows, each ``advance`` positions further on (a drafter's later
        steps over a prefix of its rows), without another host copy. The flags stay the whole
        batch's: a flag set for rows outside the prefix only costs work that changes nothing."""
        positions = self.positions[:rows]
        return replace(
            self,
            temperature=self.temperature[:rows],
            top_k=self.top_k[:rows],
            top_p=self.top_p[:rows],
            seeds=self.seeds[:rows],
            positions=positions + advance if advance else positions,
        )


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[N, V] -> [N, V] float32 one-hot at the row's argmax (first index on ties)."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _top_k_top_p(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Restrict each row of ``probs`` [N, V] to its top-k, then to the nucleus of top-p of the
    renormalized top-k distribution. Returns unnormalized [N, V] (dropped tokens are 0)."""
    vocab_size = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [N, V]
    ranks = torch.arange(vocab_size, device=probs.device)  # [V]
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [N]
    sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= k[:, None], 0.0)
    # Nucleus: keep rank r iff the mass strictly above it is below top_p (rank 0 always kept).
    cum = sorted_probs.cumsum(dim=-1)  # [N, V]
    mass_above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1) / cum[:, -1:]
    keep = (mass_above < top_p[:, None]) | (top_p[:, None] >= 1.0)
    sorted_probs = sorted_probs.masked_fill(~keep, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def processed_probs(logits: Tensor, t: SamplingTensors) -> Tensor:
    """The exact distribution ``sample`` draws from: [N, V] logits -> [N, V] float32 probs.

    softmax(logits / T), restricted to the top-k tokens, then to the top-p nucleus (the smallest
    set of most likely tokens with mass >= top_p, never empty), renormalized. Greedy rows
    (T == 0) are one-hot at the argmax.
    """
    logits = logits.to(torch.float32)
    if t.all_greedy:
        return _one_hot_argmax(logits)
    if t.any_greedy:
        is_greedy = (t.temperature == 0)[:, None]  # [N, 1]
        temperature = torch.where(is_greedy, 1.0, t.temperature[:, None])
    else:
        temperature = t.temperature[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)  # [N, V]
    if t.any_top_k or t.any_top_p:
        probs = _top_k_top_p(probs, t.top_k, t.top_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if not t.any_greedy:
        return probs
    return torch.where(is_greedy, _one_hot_argmax(logits), probs)


def exponential_race(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Draw one index per row with probability proportional to ``probs`` [N, V] (need not be
    normalized): argmax(p / E) with E = -log(u) ~ Exp(1). Returns [N] int64."""
    return (probs / -torch.log(uniforms)).argmax(dim=-1)


def noise_race(probs: Tensor, seeds: Tensor, positions: Tensor, stream: int) -> Tensor:
    """``exponential_race(probs, uniform_noise(seeds, positions, V, stream))``: [N] int64. On a
    GPU with ``use_fused_noise`` two Triton kernels that never write the uniforms out."""
    if _fused_noise and probs.is_cuda:
        return triton_noise_race.noise_race(probs, seeds, positions, stream)
    return exponential_race(probs, uniform_noise_torch(seeds, positions, probs.shape[-1], stream))


def sample(logits: Tensor, t: SamplingTensors) -> Tensor:
    """[N, V] logits -> [N] int64 tokens: argmax for greedy rows, else a draw from
    ``processed_probs`` with the noise of ``uniform_noise(seeds, positions, V, stream=0)``."""
    return sample_with_probs(logits, t)[0]


def sample_with_probs(logits: Tensor, t: SamplingTensors) -> tuple[Tensor, Tensor | None]:
    """``sample``'s tokens and the distribution they were drawn from (``processed_probs``;
    None when every row is greedy), computed once: a sampled drafter keeps both."""
    if t.all_greedy:
        return logits.argmax(dim=-1), None
    probs = processed_probs(logits, t)
    # A greedy row's distribution is one-hot at its argmax, the one column the race can pick
    # (every other score is 0, that one positive): its draw is its argmax.
    return noise_race(probs, t.seeds, t.positions, stream=0), probs
