"""The scores C_i . B_j of every chunk, once per group: what compute_out's heads share.

    B, C (b, L, G, N), x (b, L, H, P) (only its dtype is read: the 'input' mode's rounding)
    -> scores (b, nchunks, G, Q, Q) fp32: scores[.., i, j] = C_(cQ+i) . B_(cQ+j) for the
       ROW_BLOCK x ROW_BLOCK tiles with j's block <= i's block (the others are never written)

The scores depend on the group, not on the head: computed inside compute_out they cost one
(ROW_BLOCK x N) . (N x ROW_BLOCK) MMA per tile per head, the kernel's largest matmul, repeated
nheads / ngroups times (64 times at the anchor shapes with one group). Here each is computed once
and compute_out reads the tile instead (``ComputeOutConfig.shared_scores``, chosen from 8 heads
per group by ``kernels.ssd.shares_scores``, which says what the H200 measured). The products
are the same MMAs at the same precision (``kernels.tile_ops.precise_mma``); a tile
covers whole row and column blocks, so the diagonal tiles' masked entries are computed values,
never unwritten memory that a zero weight would turn into NaN.

The scores stay in float32, though compute_out reads every tile once per head (at the first
anchor, by count, 40 of the ~90 KB a tile reads, from L2). Timed on the H200 beside it,
compute_out alone at the table's tiles, and not kept (branch perf/fp16-scores):
- bf16 scores (experiments/ab_scores_cc5b8d4.txt): 0.572 -> 0.521 ms at the first anchor, 1.139
  -> 1.042 at the third, but out's normwise error vs float64 13-19% larger at every shape (its
  ratio to the error of rounding the exact out, 1.199 -> 1.358 at the first anchor): accuracy
  does not pay for speed.
- fp16 scores scaled by a power of two per row (C_i) and column (B_j), 11 bits for any
  magnitudes (experiments/ab_scores_fp16_ba28cbe.txt): the accuracy kept (1.199 -> 1.201), but
  slower, 0.572 -> 0.635 ms with the scales multiplied in and 0.569 -> 0.597 with them added to
  the decay's exponent (the likely cost, not profiled: converting fp16 to float32 takes an
  instruction per entry where bf16's is a shift).
The walk of out (kernels/scan_out.py) reads them once a step per head as well, and there the
bytes matter less still: without any scores load the first anchor's walk took 0.953x, bf16
scores 0.962x, scaled fp16 1.103x (experiments/ab_walk_scores_16bit_991db3f.txt).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.tile_ops import (MODE, KernelVariant, array_constraint, index_variants,
                              kernel_signature, precise_mma, scalar_constraint)

ZERO = ct.PaddingMode.ZERO


def chunk_scores_kernel(B, C, x, scores, seqlen, ngroups,
                        CHUNK: ct.Constant[int], ROW_BLOCK: ct.Constant[int],
                        N_PAD: ct.Constant[int], MODE: ct.Constant[int]):
    pid = ct.bid(0)
    group = pid % ngroups
    rest = pid // ngroups
    rows_per_chunk = CHUNK // ROW_BLOCK
    nrow_blocks = ct.cdiv(seqlen, CHUNK) * rows_per_chunk
    rows = rest % nrow_blocks
    batch = rest // nrow_blocks
    chunk = rows // rows_per_chunk
    row_block = rows % rows_per_chunk
    C_i = ct.load(C, (batch, rows, group, 0), shape=(1, ROW_BLOCK, 1, N_PAD),
                  padding_mode=ZERO).reshape((ROW_BLOCK, N_PAD))
    for col_block in range(row_block + 1):
        B_j = ct.load(B, (batch, chunk * rows_per_chunk + col_block, group, 0),
                      shape=(1, ROW_BLOCK, 1, N_PAD), padding_mode=ZERO).reshape((ROW_BLOCK, N_PAD))
        tile = precise_mma(C_i, B_j.transpose(), ct.zeros((ROW_BLOCK, ROW_BLOCK), dtype=ct.float32),
                           MODE, x.dtype)
        ct.store(scores, (batch, chunk, group, row_block, col_block),
                 tile.reshape((1, 1, 1, ROW_BLOCK, ROW_BLOCK)))


# B and C pass 2^31 elements only with the other inputs; the scores are (b, L, G, Q)-sized.
KERNELS = index_variants(chunk_scores_kernel, ("B", "C", "x", "scores"))


@dataclass(frozen=True)
class ChunkScoresConfig(KernelVariant):
    VARIANTS = KERNELS

    x_dtype: torch.dtype = torch.float32
    b_dtype: torch.dtype = torch.float32
    c_dtype: torch.dtype = torch.float32
    chunk_size: int = 128
    row_block: int = 64
    n_pad: int = 64
    precision: str = "3xtf32"
    wide: bool = False
    occupancy: int | None = None

    @classmethod
    def for_out(cls, out) -> "ChunkScoresConfig":
        """The scores a ``ComputeOutConfig`` with shared_scores reads: its tiles, dtypes, mode."""
        return cls(x_dtype=out.x_dtype, b_dtype=out.b_dtype, c_dtype=out.c_dtype,
                   chunk_size=out.chunk_size, row_block=out.row_block, n_pad=out.n_pad,
                   precision=out.precision, wide=out.wide)

    def constants(self) -> tuple:
        return (self.chunk_size, self.row_block, self.n_pad, MODE[self.precision])

    def signature(self):
        w = self.wide
        return kernel_signature([
            array_constraint(self.b_dtype, 4, w), array_constraint(self.c_dtype, 4, w),
            array_constraint(self.x_dtype, 4, w), array_constraint(torch.float32, 5, w),
            scalar_constraint(torch.int32), scalar_constraint(torch.int32), *self.constants()])

    def describe(self) -> str:
        return (f"chunk_scores B={self.b_dtype} C={self.c_dtype} x={self.x_dtype} "
                f"Q={self.chunk_size} RB={self.row_block} N={self.n_pad} {self.precision} "
                f"int64={self.wide}")


def chunk_scores(B: torch.Tensor, C: torch.Tensor, x: torch.Tensor, cfg: ChunkScoresConfig,
                 stream) -> torch.Tensor:
    """scores (b, nchunks, G, Q, Q) fp32; see the module docstring. stream: where to launch
    (compute_out's)."""
    b, L, G, _ = B.shape
    Q = cfg.chunk_size
    nchunks = -(-L // Q)
    scores = torch.empty(b, nchunks, G, Q, Q, device=B.device, dtype=torch.float32)
    ct.launch(stream, (b * nchunks * (Q // cfg.row_block) * G,), cfg.kernel,
              (B, C, x, scores, L, G, *cfg.constants()))
    return scores
