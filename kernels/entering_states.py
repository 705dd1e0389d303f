"""The state entering each segment of the split walk (kernels/scan_out.py, ``segmented``), from
the end states of the states-only walk's parts, each walked from zero.

    end_states (b * (segments - 1) * split, H, P, N) fp32, log2_decay_cumsum (b, H, nchunks, 2, Q)
    fp32 (kernels/chunk_cumsum.py, hi + lo), start_states (b, H, P, N) or none
    -> entering (b * segments, H, P, N) fp32

        h_0 = start (or 0),   h_{k+1} = 2^(D_k) h_k + end_k,   D_k = part k's chunk decays summed

segment s enters where its first part, s * split, does. One block per (batch row, head, P_BLOCK
channels) carries h through the parts as the walk carries its state through the chunks.

Why a kernel: the same recurrence as torch ops was eight small kernels and their views, 0.30 ms
of the H200's host a call against the whole unsplit call's 0.27 ms, so at b1 L16384 (0.34 ms of
kernels) the split call waited on the host (reports/h200/experiments/host_split_1b268f7.txt).

Why D_k in float32: every decay is <= 0, so summing them loses at most a few float32 ulps of
|D_k|, and that error reaches h as 2^(D_k) |D_k| times it, at most 0.53 times: a few ulps of
the decay factor however long the part. The walk itself carries each chunk's decay as one
float32 exp2 (kernels/state_scan.py, ``next_state``).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.device import launch_stream
from kernels.tile_ops import (KernelVariant, array_constraint, exp2_nonpos, index_variants,
                              kernel_signature, placeholder, scalar_constraint)

ZERO = ct.PaddingMode.ZERO
# Chunks whose decays one load reads (the last position's hi and lo of each).
CHUNK_BLOCK = 64
# Channels a block carries: at 64 x 256 a block took 230,520 bytes of shared memory on sm_90
# (CPU compile), at the limit; the blocks are few (b * H * P / 32) and walk a few parts.
ENTERING_P_BLOCK = 32


def entering_states_kernel(end_states, log2_decay_cumsum, start_states, entering, nchunks,
                           nheads, n_p_blocks, nsegments, split, part_chunks,
                           CHUNK: ct.Constant[int], P_BLOCK: ct.Constant[int],
                           N_PAD: ct.Constant[int], HAS_START: ct.Constant[bool]):
    pid = ct.bid(0)
    head = pid % nheads
    rest = pid // nheads
    p_block = rest % n_p_blocks
    batch = rest // n_p_blocks
    h = ct.zeros((P_BLOCK, N_PAD), dtype=ct.float32)
    if HAS_START:
        h = ct.load(start_states, (batch, head, p_block, 0), shape=(1, 1, P_BLOCK, N_PAD),
                    padding_mode=ZERO).reshape((P_BLOCK, N_PAD)).astype(ct.float32)
    # A load wholly past the chunks' end is undefined: tiles stop at the last one.
    tiles_end = (nchunks + CHUNK_BLOCK - 1) // CHUNK_BLOCK
    nparts = (nsegments - 1) * split
    for segment in range(nsegments - 1):
        ct.store(entering, (batch * nsegments + segment, head, p_block, 0),
                 h.reshape((1, 1, P_BLOCK, N_PAD)))
        for k in range(segment * split, (segment + 1) * split):
            first = k * part_chunks
            decays = ct.zeros((CHUNK_BLOCK,), dtype=ct.float32)
            for tile in range(first // CHUNK_BLOCK,
                              ct.minimum((first + part_chunks + CHUNK_BLOCK - 1) // CHUNK_BLOCK,
                                         tiles_end)):
                last = ct.load(log2_decay_cumsum, (batch, head, tile, 0, CHUNK - 1),
                               shape=(1, 1, CHUNK_BLOCK, 2, 1),
                               padding_mode=ZERO).reshape((CHUNK_BLOCK, 2))
                chunk = tile * CHUNK_BLOCK + ct.arange(CHUNK_BLOCK, dtype=ct.int32)
                inside = (chunk >= first) & (chunk < first + part_chunks)
                decays = decays + ct.where(inside, ct.sum(last, axis=1), 0.0)
            end = ct.load(end_states, (batch * nparts + k, head, p_block, 0),
                          shape=(1, 1, P_BLOCK, N_PAD), padding_mode=ZERO)
            h = exp2_nonpos(ct.sum(decays)).reshape((1, 1)) * h + end.reshape((P_BLOCK, N_PAD))
    ct.store(entering, (batch * nsegments + nsegments - 1, head, p_block, 0),
             h.reshape((1, 1, P_BLOCK, N_PAD)))


# The cumsum passes 2^31 elements with x (b * L * H * 2 floats): 64-bit indexing in the wide
# variant, the states with it.
KERNELS = index_variants(entering_states_kernel, ("end_states", "log2_decay_cumsum",
                                                  "start_states", "entering"))


@dataclass(frozen=True)
class EnteringStatesConfig(KernelVariant):
    VARIANTS = KERNELS

    start_dtype: torch.dtype = torch.float32
    chunk_size: int = 64
    p_block: int = ENTERING_P_BLOCK
    n_pad: int = 128
    has_start: bool = False
    wide: bool = False
    occupancy: int | None = None

    def constants(self) -> tuple:
        return (self.chunk_size, self.p_block, self.n_pad, self.has_start)

    def signature(self):
        f32, i32, w = torch.float32, torch.int32, self.wide
        return kernel_signature([
            array_constraint(f32, 4, w), array_constraint(f32, 5, w),
            array_constraint(self.start_dtype, 4, w), array_constraint(f32, 4, w),
            *(scalar_constraint(i32) for _ in range(6)), *self.constants()])

    def describe(self) -> str:
        return (f"entering_states Q={self.chunk_size} PB={self.p_block} N={self.n_pad} "
                f"start={self.has_start}:{self.start_dtype} int64={self.wide}")


def segment_entering_states(end_states, log2_decay_cumsum, start_states, segments: int,
                            split: int, part_chunks: int, cfg: EnteringStatesConfig,
                            stream=None) -> torch.Tensor:
    """(b * segments, H, P, N) fp32, the state entering each segment of ``split`` parts of
    ``part_chunks`` chunks; see the module docstring. stream: where to launch (default: the
    current stream of the inputs' device)."""
    stream = launch_stream(end_states, stream)
    b, H, nchunks = log2_decay_cumsum.shape[:3]
    P, N = end_states.shape[2:]
    entering = torch.empty(b * segments, H, P, N, device=end_states.device, dtype=torch.float32)
    npb = -(-P // cfg.p_block)
    ct.launch(stream, (b * H * npb,), cfg.kernel,
              (end_states, log2_decay_cumsum,
               start_states if start_states is not None else placeholder(end_states.device,
                                                                         torch.float32, 4),
               entering, nchunks, H, npb, segments, split, part_chunks, *cfg.constants()))
    return entering
