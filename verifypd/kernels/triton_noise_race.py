"""Counter-based sampling noise in one kernel (Triton): the uniforms (``uniform_noise``), and
one draw per row of unnormalized probabilities with them (``noise_race``).

``sampler.uniform_noise`` as torch ops is about forty-five elementwise kernels (the splitmix64
hash in int64 ops), and ``exponential_race`` over it five more. A sampled drafter step, and a
sampled verify, launch them a few times each: on the GPU their launches held the host longer
than the drafter's forward. Here the uniforms are one launch and a draw two (a row's chunks in
parallel, then the pick). The uniforms are the same bit for bit (uint64 arithmetic wraps as the
int64 ops do), the argmax takes the first index on ties as torch's does; only the log is
Triton's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# sampler.py's splitmix64 constants, as unsigned 64-bit values (constexpr: a kernel reads no
# other globals).
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)
_BITS_SHIFT = tl.constexpr(64 - 23)  # the uniform keeps the hash's top 23 bits
_BITS_UNIT = tl.constexpr(2.0**-23)
_STREAM = 0xD6E8FEB86659FD93  # host side: a stream's offset is passed in
_MASK64 = (1 << 64) - 1
_RACE_BLOCK = 2048  # columns a program of the race takes
# A step's seeds and positions are often rows of one uploaded int64 block (verify_step.py), so
# their addresses are 16-byte aligned or not from step to step; Triton would compile a kernel
# for each under traffic (a stall of every lane). They are scalar loads: no specializing.
_ROW_SCALARS = ["seeds_ptr", "positions_ptr"]


@triton.jit
def _mix64(x):
    """splitmix64's finalizer on uint64 (multiplication wraps mod 2^64)."""
    x = x ^ (x >> 30)
    x = x * tl.full(x.shape, _MIX1, tl.uint64)
    x = x ^ (x >> 27)
    x = x * tl.full(x.shape, _MIX2, tl.uint64)
    return x ^ (x >> 31)


@triton.jit
def _row_hash(seeds_ptr, positions_ptr, row, STREAM_OFFSET: tl.constexpr):
    """The row's hash of (seed, stream, position): [1] uint64."""
    seed = tl.load(seeds_ptr + row + tl.zeros([1], tl.int32)).to(tl.uint64, bitcast=True)
    pos = tl.load(positions_ptr + row + tl.zeros([1], tl.int32)).to(tl.uint64, bitcast=True)
    h = _mix64(seed + tl.full([1], STREAM_OFFSET, tl.uint64))
    return _mix64(h + pos * tl.full([1], _GOLDEN, tl.uint64))


@triton.jit
def _uniforms(h, cols, BLOCK: tl.constexpr):
    """Column ``cols``' uniforms in (0, 1) of the row with hash ``h``: [BLOCK] float32."""
    counter = (cols + 1).to(tl.uint64) * tl.full([BLOCK], _GOLDEN, tl.uint64)
    bits = _mix64(h + counter) >> _BITS_SHIFT
    return (bits.to(tl.float32) + 0.5) * _BITS_UNIT


@triton.jit(do_not_specialize_on_alignment=_ROW_SCALARS)
def _uniform_noise_kernel(
    seeds_ptr,  # [N] int64
    positions_ptr,  # [N] int64
    out_ptr,  # [N, C] float32, contiguous
    C,
    STREAM_OFFSET: tl.constexpr,  # stream * _STREAM mod 2^64
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _row_hash(seeds_ptr, positions_ptr, row, STREAM_OFFSET)
    u = _uniforms(h, cols, BLOCK)
    tl.store(out_ptr + row.to(tl.int64) * C + cols, u, mask=cols < C)


@triton.jit(do_not_specialize_on_alignment=_ROW_SCALARS)
def _noise_race_chunk_kernel(
    probs_ptr,  # [N, V], >= 0, any float dtype
    seeds_ptr,  # [N] int64
    positions_ptr,  # [N] int64
    best_ptr,  # [N, S] float32: each chunk's best score
    idx_ptr,  # [N, S] int32: its column (the first on ties)
    V,
    S,
    stride_p,
    STREAM_OFFSET: tl.constexpr,  # stream * _STREAM mod 2^64
    BLOCK: tl.constexpr,
):
    """One chunk of BLOCK columns of one row: its best score and that score's first column."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    h = _row_hash(seeds_ptr, positions_ptr, row, STREAM_OFFSET)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    p = tl.load(probs_ptr + row.to(tl.int64) * stride_p + cols, mask=mask, other=0.0)
    u = _uniforms(h, cols, BLOCK)
    score = tl.where(mask, p.to(tl.float32) / -tl.log(u), -1.0)
    at = row * S + chunk + tl.zeros([1], tl.int32)
    tl.store(best_ptr + at, tl.max(score, axis=0) + tl.zeros([1], tl.float32))
    tl.store(
        idx_ptr + at,
        tl.argmax(score, axis=0, tie_break_left=True) + chunk * BLOCK + tl.zeros([1], tl.int32),
    )


@triton.jit
def _noise_race_pick_kernel(
    best_ptr,  # [N, S] float32
    idx_ptr,  # [N, S] int32
    out_ptr,  # [N] int64
    S,
    S_BLOCK: tl.constexpr,
):
    """A row's winner: the first chunk holding the best score (so the first column overall)."""
    row = tl.program_id(0)
    offs = tl.arange(0, S_BLOCK)
    mask = offs < S
    best = tl.load(best_ptr + row * S + offs, mask=mask, other=-2.0)
    idx = tl.load(idx_ptr + row * S + offs, mask=mask, other=0)
    first = tl.argmax(best, axis=0, tie_break_left=True)
    pick = tl.sum(tl.where(offs == first, idx, 0), axis=0)
    tl.store(out_ptr + row + tl.zeros([1], tl.int32), pick.to(tl.int64) + tl.zeros([1], tl.int64))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, num_cols: int, stream: int):
    """``sampler.uniform_noise``: [N], [N] -> [N, num_cols] float32 in (0, 1), bit for bit."""
    n = seeds.shape[0]
    assert positions.shape == (n,), "one position per seed"
    out = torch.empty((n, num_cols), dtype=torch.float32, device=seeds.device)
    if n == 0 or num_cols == 0:
        return out
    block = min(2048, triton.next_power_of_2(num_cols))
    _uniform_noise_kernel[(n, triton.cdiv(num_cols, block))](
        seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(), out,
        num_cols, STREAM_OFFSET=(stream * _STREAM) & _MASK64, BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return out


def noise_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int):
    """``argmax(probs / -log(uniform_noise(seeds, positions, V, stream)))`` per row:
    [N, V], [N], [N] -> [N] int64 (first index on ties; no host sync)."""
    n, v = probs.shape
    assert probs.stride(1) == 1, "probs: last dim contiguous"
    assert seeds.shape == (n,) and positions.shape == (n,), "one seed and position per row"
    out = torch.empty(n, dtype=torch.int64, device=probs.device)
    if n == 0:
        return out
    seeds = seeds.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    # A row's columns in chunks, each on its own program, then one program a row picks the first
    # chunk with the best score: one program a row looping over 151,936 columns took 0.11 ms on
    # an H200 (bench/sample_cost.py, 5f99af4), the length of a quarter of a 0.5B drafter step.
    block = min(_RACE_BLOCK, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, block)
    best = torch.empty((n, chunks), dtype=torch.float32, device=probs.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=probs.device)
    _noise_race_chunk_kernel[(n, chunks)](
        probs, seeds, positions, best, idx, v, chunks, probs.stride(0),
        STREAM_OFFSET=(stream * _STREAM) & _MASK64, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    _noise_race_pick_kernel[(n,)](
        best, idx, out, chunks, S_BLOCK=max(16, triton.next_power_of_2(chunks)), num_warps=1
    )
    return out
