"""Stage 1: processed dt and its per-chunk inclusive log2 decay cumsum.

    dt (b, L, H) fp32/bf16/fp16, A (H,) fp32, dt_bias (H,) fp32, seq_idx (b, L) int or none
    -> dt_out (b, H, nchunks, Q) fp32:  clamp(softplus(dt + dt_bias), dt_min, dt_max), 0 past seqlen
       log2_decay_cumsum (b, H, nchunks, 2, Q) fp32:  inclusive cumsum S over each chunk of
       dt_out * A * log2(e), flat past seqlen (decays are exp2 of differences, never > 1), as
       hi + lo: [..., 0, :] = hi, the float32 nearest S; [..., 1, :] = lo, what hi leaves out;
       NaN for a head with A > 0

One block per (chunk, batch row, block of HEAD_BLOCK heads); the chunk is one tile, so the cumsum
is one in-register scan, in float64 (below).

With seq_idx (packed sequences; ``ChunkCumsumConfig.seq_dtype``) each position where a sequence
starts (but the row's first) adds RESET_LOG2_DECAY to its step's log2 decay: the decay into it
from any earlier position is then 2^(<= -256), which float32's exp2 returns as 0, so every kernel
that reads S resets the state there, as a decay of exactly 0 would: the carried state's term
in out, the pairs (i, j) of two sequences, the state update's carry and its earlier positions, a
segment's carry (kernels/entering_states.py). The walks of kernels/scan_out.py and the fused
scan of kernels/state_scan.py with compute_out read such an S and need no sequence index of their
own, nor any mask: a packed call runs the unpacked call's kernels (``kernels.ssd.make_plan``).
The dt_out they weight positions by is dt's own. Within a sequence a difference S_i - S_j
subtracts the same resets twice: at most 64 a chunk, |S| < 2^15 more, which the float64 scan and
the hi + lo split (below) hold to ~2^-30 absolute, as they hold the decay sums they carry.

Why two parts: the kernels need differences S_i - S_j of nearby positions (the decay between
them), and S reaches tens within a chunk under strong decay (|S| = 76 in 256 steps is a Mamba-2
init draw). A float32 S carries an error of up to ~ulp(|S|) (8e-6 at 76) from the scan's tree
order, uncorrelated between positions, so the decay 2^(S_i - S_j) of two adjacent positions would
be off by ~5e-6 relative, 60 float32 ulps. On the H200 the property tests caught final_states
at 17x and 9x the float32 chunked reference's error for that reason (4.2x and 2.2x the allowance;
reports/h200/failures/). The scan sums the float32 terms in float64 (at most 63 roundings of
2^-53 relative, all terms of one sign) and splits each sum into hi and lo, so hi and lo together
hold S to ~2^-47 relative, and a difference is accurate to float32 relative to itself; in the H200
envelope (4b1e5b9) the strong-decay cells' chunk and final states went from the reference's error
to 1/20 of it. Until 9cdad9c a float32 scan carried each partial sum's rounding error (TwoSum) in
lo: on the H200 the float64 scan gave the same hi and lo bit for bit at the three anchors, in
0.932x / 0.937x / 0.853x the time (18.7 -> 17.4 us at the first;
experiments/ab_cumsum_float64_9cdad9c.txt).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.device import launch_stream
from kernels.tile_ops import (LOG2_E, KernelVariant, array_constraint, index_variants,
                              kernel_signature, next_pow2, placeholder, scalar_constraint,
                              softplus)

ZERO = ct.PaddingMode.ZERO
# Heads per block. 8 rather than 32: four times the blocks for a scan that waits on its loads. On
# the H200 (bf16 anchors, outputs equal bit for bit) 0.0264 -> 0.0200 ms at (8, 4096, 64 heads),
# 0.0168 -> 0.0127 at (4, 8192, 32), 0.0478 -> 0.0360 at (1, 65536, 64); 4 and 16 between
# (reports/h200/experiments/ab_launch_d740c5a.txt).
MAX_HEAD_BLOCK = 8
# CUDA's limit on a grid's second dimension. The kernel's grid is (chunks, rows x head blocks);
# past this many rows x head blocks (a batch of 8,192 rows of 64 heads) it runs on a flat grid
# (``flat_grid``), one dimension of up to 2^31 - 1 blocks, so that any batch launches. Only
# there: the flat grid's index arithmetic has not been timed against the two-dimensional one.
MAX_GRID_Y = 65535
# What a sequence's start adds to its step's log2 decay: float32's exp2 returns 0 below -150,
# whatever the decays summed with it (all <= 0), and 64 of them in a chunk keep |S| < 2^15.
RESET_LOG2_DECAY = -256.0


def chunk_cumsum_kernel(dt, A, dt_bias, seq_idx, dt_out, log2_decay_cumsum, seqlen,
                        nhead_blocks, dt_min: float, dt_max: float,
                        CHUNK: ct.Constant[int], HEAD_BLOCK: ct.Constant[int],
                        HAS_BIAS: ct.Constant[bool], SOFTPLUS: ct.Constant[bool],
                        HAS_LIMIT: ct.Constant[bool], FLAT_GRID: ct.Constant[bool],
                        HAS_RESETS: ct.Constant[bool]):
    chunk, row_block = ct.bid(0), ct.bid(1)
    if FLAT_GRID:
        nchunks = (seqlen + CHUNK - 1) // CHUNK
        chunk, row_block = ct.bid(0) % nchunks, ct.bid(0) // nchunks
    batch = row_block // nhead_blocks
    head_block = row_block % nhead_blocks
    step = ct.load(dt, (batch, chunk, head_block), shape=(1, CHUNK, HEAD_BLOCK),
                   padding_mode=ZERO).reshape((CHUNK, HEAD_BLOCK)).astype(ct.float32).transpose()
    if HAS_BIAS:
        bias = ct.load(dt_bias, (head_block,), shape=(HEAD_BLOCK,), padding_mode=ZERO)
        step = step + bias[:, None]
    if SOFTPLUS:
        step = softplus(step)
    if HAS_LIMIT:
        # propagate_nan: a NaN dt must stay NaN, not become the bound.
        step = ct.minimum(ct.maximum(step, dt_min, propagate_nan=True), dt_max, propagate_nan=True)
    position = chunk * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    step = ct.where(position[None, :] < seqlen, step, 0.0)
    a = ct.load(A, (head_block,), shape=(HEAD_BLOCK,), padding_mode=ZERO)
    # A > 0 (a growing state, which every later exp2 would clamp to a silently wrong decay) makes
    # its head's cumsum NaN: what reaches the outputs where the host cannot refuse it first (CUDA
    # graph capture, kernels/contract.py). An identity for A <= 0, whose bits are unchanged.
    a = ct.where(a > 0.0, math.nan, a)
    log2_decay = (step * (a * LOG2_E)[:, None]).astype(ct.float64)
    if HAS_RESETS:
        # The row's first position starts no sequence: the start state is its sequence's. Added
        # in float64, exactly for a step's decay above 2^-21 (in float32 it would round to
        # 2^-16 there), so that S is the unpacked S less the resets to the scan's own rounding.
        starts = ((ct.gather(seq_idx, (batch, position))
                   != ct.gather(seq_idx, (batch, ct.maximum(position - 1, 0))))
                  & (position < seqlen))
        log2_decay = log2_decay + ct.where(starts, RESET_LOG2_DECAY, 0.0).astype(
            ct.float64)[None, :]
    total = ct.cumsum(log2_decay, axis=1)
    hi = total.astype(ct.float32)
    # An infinite sum (dt = inf) leaves inf - inf = NaN in lo: its decay is exactly 0, keep hi.
    lo = ct.where(ct.abs(hi) == math.inf, 0.0, (total - hi.astype(ct.float64)).astype(ct.float32))
    ct.store(dt_out, (batch, head_block, chunk, 0), step.reshape((1, HEAD_BLOCK, 1, CHUNK)))
    tile = (1, HEAD_BLOCK, 1, 1, CHUNK)
    ct.store(log2_decay_cumsum, (batch, head_block, chunk, 0, 0), hi.reshape(tile))
    ct.store(log2_decay_cumsum, (batch, head_block, chunk, 1, 0), lo.reshape(tile))


# dt and the two stage outputs are (b, L, H)-sized: beyond 2^31 positions x heads they need int64.
KERNELS = index_variants(chunk_cumsum_kernel, ("dt", "seq_idx", "dt_out", "log2_decay_cumsum"))


@dataclass(frozen=True)
class ChunkCumsumConfig(KernelVariant):
    """Everything that selects a compiled variant of the kernel."""

    VARIANTS = KERNELS

    dt_dtype: torch.dtype = torch.float32
    chunk_size: int = 128
    head_block: int = 16
    has_bias: bool = False
    softplus: bool = False
    has_limit: bool = False
    wide: bool = False
    occupancy: int | None = None
    flat_grid: bool = False      # past MAX_GRID_Y rows x head blocks (``needs_flat_grid``)
    # Packed sequences' resets in S (the module docstring): seq_idx's dtype, None without.
    seq_dtype: torch.dtype | None = None

    def constants(self) -> tuple:
        return (self.chunk_size, self.head_block, self.has_bias, self.softplus, self.has_limit,
                self.flat_grid, self.seq_dtype is not None)

    def signature(self):
        f32 = torch.float32
        return kernel_signature([
            array_constraint(self.dt_dtype, 3, self.wide), array_constraint(f32, 1),
            array_constraint(f32, 1),
            array_constraint(self.seq_dtype or torch.int32, 2, self.wide),
            array_constraint(f32, 4, self.wide), array_constraint(f32, 5, self.wide),
            scalar_constraint(torch.int32),
            scalar_constraint(torch.int32), scalar_constraint(f32), scalar_constraint(f32),
            *self.constants()])

    def describe(self) -> str:
        return (f"chunk_cumsum dt={self.dt_dtype} Q={self.chunk_size} HB={self.head_block} "
                f"bias={self.has_bias} softplus={self.softplus} limit={self.has_limit} "
                f"int64={self.wide}" + (" flat-grid" if self.flat_grid else "")
                + (f" resets={self.seq_dtype}" if self.seq_dtype is not None else ""))


def head_block_for(nheads: int) -> int:
    return min(next_pow2(nheads), MAX_HEAD_BLOCK)


def needs_flat_grid(batch: int, nheads: int) -> bool:
    """Whether the (chunks, rows x head blocks) grid would pass CUDA's limit on its second
    dimension (MAX_GRID_Y)."""
    return batch * -(-nheads // head_block_for(nheads)) > MAX_GRID_Y


def chunk_cumsum(dt: torch.Tensor, A: torch.Tensor, config: ChunkCumsumConfig, dt_bias=None,
                 dt_limit=(0.0, math.inf), stream=None, seq_idx=None):
    """(dt_out (b, H, nchunks, Q), log2_decay_cumsum (b, H, nchunks, 2, Q)), fp32; see the module
    docstring.

    dt (b, L, H) CUDA fp32/bf16/fp16 (any strides); A, dt_bias (H,) CUDA, any float dtype.
    config: the variant (``kernels.ssd.make_plan(...).cumsum``): chunk size, which of bias,
    softplus and limit apply, 64-bit indexing, the resets; dt_bias and dt_limit give their
    values, seq_idx (b, L) of ``config.seq_dtype`` the resets (None without).
    stream: where to launch (default: the current stream of the inputs' device).
    """
    if (seq_idx is None) != (config.seq_dtype is None) or (
            seq_idx is not None and seq_idx.dtype != config.seq_dtype):
        raise ValueError(f"chunk_cumsum: seq_idx of dtype {config.seq_dtype} expected by the "
                         f"config, got {None if seq_idx is None else seq_idx.dtype}")
    b, L, H = dt.shape
    Q = config.chunk_size
    nchunks = -(-L // Q)
    f32 = torch.float32
    dt_out = torch.empty(b, H, nchunks, Q, device=dt.device, dtype=f32)
    cumsum = torch.empty(b, H, nchunks, 2, Q, device=dt.device, dtype=f32)
    A32 = A.to(f32)
    bias = A32 if dt_bias is None else dt_bias.to(f32)   # A stands in for an absent bias: never read
    nhb = -(-H // config.head_block)
    grid = (nchunks * b * nhb,) if config.flat_grid else (nchunks, b * nhb)
    ct.launch(launch_stream(dt, stream), grid,
              config.kernel,
              (dt, A32, bias,
               seq_idx if seq_idx is not None else placeholder(dt.device, torch.int32, 2),
               dt_out, cumsum, L, nhb, float(dt_limit[0]), float(dt_limit[1]),
               *config.constants()))
    return dt_out, cumsum
