"""Stage 3, one fused kernel: the output of every position from the state entering its chunk and
the positions before it in the chunk.

    x (b, L, H, P), B, C (b, L, G, N), dt (b, H, nchunks, Q) and log2_decay_cumsum S
    (b, H, nchunks, 2, Q) fp32 (hi + lo, kernels/chunk_cumsum.py),
    chunk_states (b, nchunks, H, P, N), D (H, P) fp32, z (b, L, H, P)  ->  out (b, L, H, P) x.dtype

    y_i = [seq(i) entered the chunk] 2^(S_i) C_i . h_chunk
          + sum_{j <= i, seq(j) = seq(i)} (C_i . B_j) 2^(S_i - S_j) dt_j x_j
          [+ 2^(S_i - S_(r-1)) C_i . H0(seq(i)) when seq(i) starts at r inside the chunk from its
             own per-sequence initial state H0]
          + D x_i,      then y_i *= z_i sigmoid(z_i) when z is given

A block owns ROW_BLOCK rows of one chunk for one head and P_BLOCK channels; it walks the row
blocks j <= i of its chunk like causal attention: S = C_i B_j^T (dstate contraction), masked decay
weights L_ij = 2^(S_i - S_j) (exponent masked before exp2, so a masked entry is 0, never inf * 0),
then y += (S o L dt_j) x_j. The three matmuls are MMAs with float32 accumulation at the
precision of ``kernels.tile_ops`` (tensor cores except in the ieee mode).

Variants (``ComputeOutConfig``): ``shared_scores`` reads S from kernels/chunk_scores.py, computed
once per group, instead of an MMA per head (the dispatcher's choice from 8 heads per group,
``kernels.ssd.shares_scores``). Tuner knobs: ``transposed`` accumulates y^T = h C_i^T +
x_j^T (B_j C_i^T o L^T dt_j) instead, the same sums with the loaded x_j as the left operand and
the computed weights as the right one; ``ordered_loads`` reads the transposed operands in the
order the MMA consumes them rather than transposing loaded tiles; ``latency`` is the latency hint
of the column blocks' tile loads (scores or B_j, and x_j; 0 leaves it to the compiler);
``persistent`` launches only the blocks the SMs hold at once (SMs x the occupancy hint), each
walking tiles ``ct.num_blocks(0)`` apart, instead of one block per tile: 3%, 4% and 1% off
compute_out at the three anchors, outputs equal bit for bit, and 30% slower at float32 x
(experiments/ab_compute_out_persistent_1f159b8.txt); the table sets it at the bf16 'input'
shared-scores key. Writing out through plain stores instead of a TMA store was a knob until
1e42bdc: faster only with D per head (2.2% at the first and third anchors), 7-11% slower
without D or with z and D per channel (experiments/ab_store_d_1e42bdc.txt). On sm_90 the hints
1 and 2 compile the first anchor's kernel to other code (text 28.9 -> 50.9 KB), 3 to 10 to the
compiler's own (CPU compile at the launch's signature, 49d954e).

A NaN or Inf in x, dt or B at position j also reaches the positions before j in its chunk (and
other sequences packed in it): their masked weight 0 multiplies it inside the MMA.
Measured on the H200 (bf16, chunk 256, (8, 4096, 64 heads, 1 group), tuner, same run;
reports/h200/experiments/tune_322c7d5.json.gz): 1.58 ms as first tuned (row block 64, P block 64,
occupancy 2), 1.43 transposed, 1.27 transposed with shared scores, ordered loads and occupancy 4
(the registers the per-head scores MMA held let 4 blocks share an SM); in 'input' precision
0.77 ms. At (4, 8192, 32 heads, 8 groups) 0.82 -> 0.70 ms transposed, 0.58 in 'input'; a
search in 'input' there (experiments/tune_21b71eb_input.json.gz) chose row block 128 untransposed
(0.53 ms in the tuner; in the bench, with L2 flushed, 0.43 -> 0.39 ms). Before
these, ncu found the kernel bound by shared memory (L1/shared 61%, 46% of its wavefronts
bank-conflict excess; DRAM 12%, occupancy 17%; experiments/ncu_anchor1_4f66ebf.txt.gz): TF32
operands must be K-major on Hopper's tensor cores, so a computed or loaded tile in the other
order is transposed through shared memory; the transposed orientation needs fewer of those.
Reading bf16 chunk states ('input''s default since 5b56790) the first anchor's transposed tiles
took 0.80 ms in the bench against 0.61 on float32 states; a search there
(experiments/tune_79bdf52_compute_out.json.gz) chose row block 64 untransposed with ordered loads,
occupancy 2: 0.63 ms in the bench; at the second anchor bf16 states took it from 0.39 to 0.33.
Blocks of 2 or 4 heads of one group (every per-head tile along a leading axis, batched MMAs, so C,
B and the scores are read once per block) were tried at 45c6102 and removed: the tuner's best, 2
heads, took 0.65 ms in the bench at the first anchor and 0.325 at the second (one head, 79bdf52:
0.63 and 0.33; experiments/bench_anchors_422eda8), and a batched MMA, even over one head,
compiles to other sm_90 code than the 2-d one, slower in the tuner (the table's tile 1.08 vs 0.80
ms; experiments/tune_1008d4f_compute_out_anchor0.json, tune_79bdf52_compute_out.json.gz).
Factoring the decay of the blocks off the diagonal through the row block's start (2^(S_i - S_j) =
2^(S_i - S_(f-1)) 2^(S_(f-1) - S_j), both factors <= 1: one multiply per score instead of the
pairwise exponent, mask and exp2) was tried at a190f60 and removed. Timed in one process beside
this kernel (experiments/ab_compute_out_a190f60.txt; one to three tiles per shape), the best of
each, 0.717 vs 0.689 ms at the first anchor, 1.429 vs 1.408 at the third, 4.10 vs 3.11 in
'3xbf16' on float32 x; only at the second anchor was it ahead (0.356 vs 0.373 ms). The
elementwise work it saves is not what bounds this kernel. Reading x_i, D and z before the
products rather than after them took the first anchor (D per head) from 0.764 to 0.723 ms, with z
and D per channel from 1.003 to 0.956, the third anchor from 1.501 to 1.411, outputs bit for bit
the same (experiments/ab_compute_out_prefetch_abdd947.txt). The occupancy hint 3 at row block 64
compiles the first anchor's kernel to 80 registers and 72 KB of shared memory (three blocks per
SM; 128 and 108 KB at occupancy 2): in the tuner 0.585 against 0.722 ms there and 0.315 against
0.401 at the second anchor (experiments/tune_b3ee563_compute_out_anchor*.json.gz), the tables'
choice for 16-bit x since; the latency hint at occupancy 2 gained nothing (0.747, 0.401).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.chunk_scores import ChunkScoresConfig, chunk_scores
from kernels.device import launch_stream
from kernels.tile_ops import (MODE, KernelVariant, array_constraint, exp2_nonpos,
                              index_variants, kernel_signature, latency_hint,
                              load_log2_cumsum, load_transposed, log2_decay_between,
                              log2_decay_since, placeholder, precise_mma, scalar_constraint,
                              silu_gated)

ZERO = ct.PaddingMode.ZERO


@ct.function
def load_transposed5(array, i0, i1, i2, rows, cols, ROWS: ct.Constant[int],
                     COLS: ct.Constant[int], ORDERED: ct.Constant[bool],
                     LATENCY: ct.Constant[int]):
    """``load_transposed`` for the (1, 1, 1, ROWS, COLS) tile of a 5-d array."""
    if ORDERED:
        t = ct.load(array, (i0, i1, i2, cols, rows), shape=(1, 1, 1, COLS, ROWS),
                    order=(0, 1, 2, 4, 3), padding_mode=ZERO,
                    latency=latency_hint(LATENCY)).reshape((COLS, ROWS))
    else:
        t = ct.load(array, (i0, i1, i2, rows, cols), shape=(1, 1, 1, ROWS, COLS),
                    padding_mode=ZERO,
                    latency=latency_hint(LATENCY)).reshape((ROWS, COLS)).transpose()
    return t


@ct.function
def out_tile(x, B, C, scores, dt, log2_decay_cumsum, A, chunk_states, D, z, seq_idx, start_states,
             cu_seqlens, out, seqlen, nheads, heads_per_group, n_p_blocks, pid,
             CHUNK: ct.Constant[int], ROW_BLOCK: ct.Constant[int], P_BLOCK: ct.Constant[int],
             N_PAD: ct.Constant[int], MODE: ct.Constant[int], HAS_D: ct.Constant[bool],
             HAS_Z: ct.Constant[bool], HAS_SEQ: ct.Constant[bool],
             PER_SEQ_START: ct.Constant[bool], TRANSPOSED: ct.Constant[bool],
             SHARED_SCORES: ct.Constant[bool], ORDERED_LOADS: ct.Constant[bool],
             LATENCY: ct.Constant[int]):
    """The output tile ``pid``: ROW_BLOCK rows of one chunk, one head, P_BLOCK channels."""
    # Heads vary fastest: tiles running together share C and B rows (one group, one chunk).
    head = pid % nheads
    rest = pid // nheads
    p_block = rest % n_p_blocks
    rest = rest // n_p_blocks
    rows_per_chunk = CHUNK // ROW_BLOCK
    nrow_blocks = ct.cdiv(seqlen, CHUNK) * rows_per_chunk
    rows = rest % nrow_blocks                         # row block index along the sequence
    batch = rest // nrow_blocks
    chunk = rows // rows_per_chunk
    row_block = rows % rows_per_chunk
    group = head // heads_per_group
    first = chunk * CHUNK
    local_i = row_block * ROW_BLOCK + ct.arange(ROW_BLOCK, dtype=ct.int32)
    hi_i, lo_i = load_log2_cumsum(log2_decay_cumsum, batch, head, chunk, row_block, ROW_BLOCK)
    if HAS_SEQ:
        seq_i = ct.load(seq_idx, (batch, rows), shape=(1, ROW_BLOCK),
                        padding_mode=ZERO).reshape((ROW_BLOCK,))
        # Chunk 0's entering state belongs to the row's first sequence.
        seq_entering = ct.load(seq_idx, (batch, ct.maximum(first - 1, 0)), shape=(1, 1)).reshape(())
    # Every product is an MMA whose operands are read in the order it consumes them, so no tile
    # is transposed in registers (ORDERED_LOADS; else loaded, then transposed). TRANSPOSED
    # accumulates y^T (P_BLOCK x ROW_BLOCK) = h C_i^T + sum_j x_j^T W_ij^T, with the scores
    # computed transposed (B_j C_i^T): the loaded x_j is then the MMA's left operand and the
    # computed weights the right one, which on the H200 staged through shared memory (this
    # kernel's bound) with fewer conflicts than the other way round (tf32 tuner, 1.33 vs 1.56 ms).
    if TRANSPOSED:
        C_it = load_transposed(C, batch, rows, group, 0, ROW_BLOCK, N_PAD, ORDERED_LOADS, 0)
        h = ct.load(chunk_states, (batch, chunk, head, p_block, 0), shape=(1, 1, 1, P_BLOCK, N_PAD),
                    padding_mode=ZERO).reshape((P_BLOCK, N_PAD))
    else:
        C_i = ct.load(C, (batch, rows, group, 0), shape=(1, ROW_BLOCK, 1, N_PAD),
                      padding_mode=ZERO).reshape((ROW_BLOCK, N_PAD))
        h_t = load_transposed5(chunk_states, batch, chunk, head, p_block, 0, P_BLOCK, N_PAD,
                               ORDERED_LOADS, 0)
    # z, and with it x_i for the D skip, are read before the products, as loaded (16-bit x and z
    # hold half the registers): their loads overlap the products instead of waiting after them
    # with the store. They are issued after the MMA operands above: read before those (the order
    # until 89092f0) compute_out took 0.564 against 0.531 ms at the first anchor with D per head
    # and 1.151 against 1.045 at the third (outputs equal bit for bit; without D the same code;
    # with z and D per channel 0.664 against 0.663; experiments/ab_order_89092f0.txt, the orders
    # of these loads timed in one process). Without z the D skip takes x_i from the diagonal
    # column block instead, whose x_j it is (DIAGONAL_D): at the table's tiles with D per head
    # compute_out 3.2% and 0.7% faster at the first and third anchors; with z and D per channel
    # that was 2.5% and 1.2% slower, so x_i is read here (outputs equal bit for bit in that A/B,
    # experiments/ab_diagonal_d_9951847.txt; with per-sequence initial states D's term now comes
    # before theirs, a change of summation order).
    DIAGONAL_D = HAS_D and not HAS_Z
    if HAS_D and HAS_Z:
        x_i = ct.load(x, (batch, rows, head, p_block), shape=(1, ROW_BLOCK, 1, P_BLOCK),
                      padding_mode=ZERO).reshape((ROW_BLOCK, P_BLOCK))
    if HAS_D:
        d = ct.load(D, (head, p_block), shape=(1, P_BLOCK), padding_mode=ZERO)
    if HAS_Z:
        z_i = ct.load(z, (batch, rows, head, p_block), shape=(1, ROW_BLOCK, 1, P_BLOCK),
                      padding_mode=ZERO).reshape((ROW_BLOCK, P_BLOCK))
    if TRANSPOSED:
        y = precise_mma(h, C_it, ct.zeros((P_BLOCK, ROW_BLOCK), dtype=ct.float32), MODE, x.dtype)
    else:
        y = precise_mma(C_i, h_t, ct.zeros((ROW_BLOCK, P_BLOCK), dtype=ct.float32), MODE, x.dtype)
    # The state entering the chunk, seen by the rows still in the sequence that entered it.
    carried_scale = exp2_nonpos(hi_i + lo_i)
    if HAS_SEQ:
        carried_scale = ct.where(seq_i == seq_entering, carried_scale, 0.0)
    if TRANSPOSED:
        y = y * carried_scale[None, :]
    else:
        y = y * carried_scale[:, None]

    for col_block in range(row_block + 1):
        cols = chunk * rows_per_chunk + col_block
        local_j = col_block * ROW_BLOCK + ct.arange(ROW_BLOCK, dtype=ct.int32)
        hi_j, lo_j = load_log2_cumsum(log2_decay_cumsum, batch, head, chunk, col_block,
                                      ROW_BLOCK)
        dt_j = ct.load(dt, (batch, head, chunk, col_block),
                       shape=(1, 1, 1, ROW_BLOCK)).reshape((ROW_BLOCK,))
        if HAS_SEQ:
            seq_j = ct.load(seq_idx, (batch, cols), shape=(1, ROW_BLOCK),
                            padding_mode=ZERO).reshape((ROW_BLOCK,))
        if TRANSPOSED:
            # Everything indexed [j, i].
            if SHARED_SCORES:
                s = load_transposed5(scores, batch, chunk, group, row_block, col_block, ROW_BLOCK,
                                     ROW_BLOCK, ORDERED_LOADS, LATENCY)
            else:
                B_j = ct.load(B, (batch, cols, group, 0), shape=(1, ROW_BLOCK, 1, N_PAD),
                              padding_mode=ZERO, latency=latency_hint(LATENCY)
                              ).reshape((ROW_BLOCK, N_PAD))
                s = precise_mma(B_j, C_it, ct.zeros((ROW_BLOCK, ROW_BLOCK), dtype=ct.float32),
                                MODE, x.dtype)
            sees = local_j[:, None] <= local_i[None, :]
            if HAS_SEQ:
                sees = sees & (seq_j[:, None] == seq_i[None, :])
            exponent = log2_decay_between(hi_i[None, :], lo_i[None, :], hi_j[:, None],
                                          lo_j[:, None])
            weights = s * (ct.where(sees, exp2_nonpos(exponent), 0.0) * dt_j[:, None])
            x_jt = load_transposed(x, batch, cols, head, p_block, ROW_BLOCK, P_BLOCK,
                                   ORDERED_LOADS, LATENCY)
            y = precise_mma(x_jt, weights, y, MODE, x.dtype)
            if DIAGONAL_D:
                if col_block == row_block:
                    y = y + d.reshape((P_BLOCK, 1)) * x_jt.astype(ct.float32)
        else:
            if SHARED_SCORES:
                s = ct.load(scores, (batch, chunk, group, row_block, col_block),
                            shape=(1, 1, 1, ROW_BLOCK, ROW_BLOCK),
                            latency=latency_hint(LATENCY)).reshape((ROW_BLOCK, ROW_BLOCK))
            else:
                B_jt = load_transposed(B, batch, cols, group, 0, ROW_BLOCK, N_PAD, ORDERED_LOADS,
                                       LATENCY)
                s = precise_mma(C_i, B_jt, ct.zeros((ROW_BLOCK, ROW_BLOCK), dtype=ct.float32),
                                MODE, x.dtype)
            sees = local_j[None, :] <= local_i[:, None]
            if HAS_SEQ:
                sees = sees & (seq_j[None, :] == seq_i[:, None])
            exponent = log2_decay_between(hi_i[:, None], lo_i[:, None], hi_j[None, :],
                                          lo_j[None, :])
            # dt_j joins the weights, so x_j enters the MMA as loaded: a 16-bit x is exact in
            # TF32 and the split modes cut only the weights.
            weights = s * (ct.where(sees, exp2_nonpos(exponent), 0.0) * dt_j[None, :])
            x_j = ct.load(x, (batch, cols, head, p_block), shape=(1, ROW_BLOCK, 1, P_BLOCK),
                          padding_mode=ZERO, latency=latency_hint(LATENCY)
                          ).reshape((ROW_BLOCK, P_BLOCK))
            y = precise_mma(weights, x_j, y, MODE, x.dtype)
            if DIAGONAL_D:
                if col_block == row_block:
                    y = y + d * x_j.astype(ct.float32)

    if PER_SEQ_START:
        # Sequences that begin inside this chunk and reach these rows, each from its own H0.
        valid = first + local_i < seqlen
        seq_lo = ct.maximum(ct.min(ct.where(valid, seq_i, seq_entering + 1)), seq_entering + 1)
        seq_hi = ct.max(ct.where(valid, seq_i, -1))
        for sequence in range(seq_lo, seq_hi + 1):
            start = ct.load(cu_seqlens, (sequence,), shape=())
            exponent = log2_decay_since(log2_decay_cumsum, dt, A, batch, head, chunk,
                                        ct.maximum(start - first, 0), hi_i, lo_i)
            scale = ct.where(seq_i == sequence, exp2_nonpos(exponent), 0.0)
            if TRANSPOSED:
                h0 = ct.load(start_states, (sequence, head, p_block, 0),
                             shape=(1, 1, P_BLOCK, N_PAD), padding_mode=ZERO).reshape(
                                 (P_BLOCK, N_PAD))
                from_start = precise_mma(h0, C_it, ct.zeros((P_BLOCK, ROW_BLOCK),
                                                            dtype=ct.float32), MODE, x.dtype)
                y = y + from_start * scale[None, :]
            else:
                h0_t = ct.load(start_states, (sequence, head, p_block, 0),
                               shape=(1, 1, P_BLOCK, N_PAD), padding_mode=ZERO).reshape(
                                   (P_BLOCK, N_PAD)).transpose()
                from_start = precise_mma(C_i, h0_t, ct.zeros((ROW_BLOCK, P_BLOCK),
                                                             dtype=ct.float32), MODE, x.dtype)
                y = y + from_start * scale[:, None]
    if TRANSPOSED:
        y = y.transpose()

    if HAS_D and HAS_Z:
        y = y + d * x_i.astype(ct.float32)
    if HAS_Z:
        y = silu_gated(y, z_i.astype(ct.float32), out)
    ct.store(out, (batch, rows, head, p_block),
             y.reshape((1, ROW_BLOCK, 1, P_BLOCK)).astype(out.dtype))


def compute_out_kernel(x, B, C, scores, dt, log2_decay_cumsum, A, chunk_states, D, z, seq_idx,
                       start_states, cu_seqlens, out, seqlen, nheads, heads_per_group, n_p_blocks,
                       ntiles, CHUNK: ct.Constant[int], ROW_BLOCK: ct.Constant[int],
                       P_BLOCK: ct.Constant[int], N_PAD: ct.Constant[int],
                       MODE: ct.Constant[int],
                       HAS_D: ct.Constant[bool], HAS_Z: ct.Constant[bool],
                       HAS_SEQ: ct.Constant[bool], PER_SEQ_START: ct.Constant[bool],
                       TRANSPOSED: ct.Constant[bool], SHARED_SCORES: ct.Constant[bool],
                       ORDERED_LOADS: ct.Constant[bool], LATENCY: ct.Constant[int],
                       PERSISTENT: ct.Constant[bool]):
    # PERSISTENT: a grid of the blocks an SM holds at once walks the ntiles tiles, so no block
    # waits to be launched behind a finished one: at the first anchor a tile takes ~7 us, and ncu
    # measured 25.7% achieved occupancy against 37.5% possible (experiments/
    # ncu_anchor0_out_alone_5d543e6.txt.gz).
    if PERSISTENT:
        for tile in range(ct.bid(0), ntiles, ct.num_blocks(0)):
            out_tile(x, B, C, scores, dt, log2_decay_cumsum, A, chunk_states, D, z, seq_idx,
                     start_states, cu_seqlens, out, seqlen, nheads, heads_per_group, n_p_blocks,
                     tile, CHUNK, ROW_BLOCK, P_BLOCK, N_PAD, MODE, HAS_D, HAS_Z, HAS_SEQ,
                     PER_SEQ_START, TRANSPOSED, SHARED_SCORES, ORDERED_LOADS, LATENCY)
    else:
        out_tile(x, B, C, scores, dt, log2_decay_cumsum, A, chunk_states, D, z, seq_idx,
                 start_states, cu_seqlens, out, seqlen, nheads, heads_per_group, n_p_blocks,
                 ct.bid(0), CHUNK, ROW_BLOCK, P_BLOCK, N_PAD, MODE, HAS_D, HAS_Z, HAS_SEQ,
                 PER_SEQ_START, TRANSPOSED, SHARED_SCORES, ORDERED_LOADS, LATENCY)


# x, z, out (and B, C, the states) can pass 2^31 elements: 64-bit indexing in the wide variant.
KERNELS = index_variants(compute_out_kernel, ("x", "B", "C", "scores", "chunk_states", "z",
                                              "start_states", "out"))


@dataclass(frozen=True)
class ComputeOutConfig(KernelVariant):
    VARIANTS = KERNELS

    x_dtype: torch.dtype = torch.float32
    b_dtype: torch.dtype = torch.float32
    c_dtype: torch.dtype = torch.float32
    z_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    seq_dtype: torch.dtype = torch.int32
    start_dtype: torch.dtype = torch.float32
    cu_dtype: torch.dtype = torch.int32
    chunk_size: int = 128
    row_block: int = 64
    p_block: int = 64
    n_pad: int = 64
    precision: str = "3xtf32"
    has_d: bool = False
    has_z: bool = False
    has_seq: bool = False
    per_seq_start: bool = False
    transposed: bool = False
    shared_scores: bool = False
    ordered_loads: bool = False
    latency: int = 0
    wide: bool = False
    occupancy: int | None = None
    worker_warps: int | None = None     # tile_ops.with_hints; None: the compiler's (4)
    persistent: bool = False            # a grid of resident blocks walks the tiles (the kernel)

    def constants(self) -> tuple:
        return (self.chunk_size, self.row_block, self.p_block, self.n_pad,
                MODE[self.precision], self.has_d, self.has_z, self.has_seq, self.per_seq_start,
                self.transposed, self.shared_scores, self.ordered_loads, self.latency,
                self.persistent)

    def signature(self):
        f32, i32, w = torch.float32, torch.int32, self.wide
        return kernel_signature([
            array_constraint(self.x_dtype, 4, w), array_constraint(self.b_dtype, 4, w),
            array_constraint(self.c_dtype, 4, w), array_constraint(f32, 5, w),
            array_constraint(f32, 4), array_constraint(f32, 5), array_constraint(f32, 1),
            array_constraint(self.state_dtype, 5, w), array_constraint(f32, 2),
            array_constraint(self.z_dtype, 4, w), array_constraint(self.seq_dtype, 2),
            array_constraint(self.start_dtype, 4, w), array_constraint(self.cu_dtype, 1),
            array_constraint(self.x_dtype, 4, w),
            *(scalar_constraint(i32) for _ in range(5)), *self.constants()])

    def describe(self) -> str:
        return (f"compute_out x={self.x_dtype} B={self.b_dtype} C={self.c_dtype} z={self.z_dtype} "
                f"states={self.state_dtype} Q={self.chunk_size} RB={self.row_block} "
                f"PB={self.p_block} N={self.n_pad} {self.precision} "
                f"D={self.has_d} z={self.has_z} seq={self.has_seq} "
                f"per_seq_start={self.per_seq_start} transposed={self.transposed} "
                f"shared_scores={self.shared_scores} ordered_loads={self.ordered_loads} "
                f"latency={self.latency} "
                f"int64={self.wide} occupancy={self.occupancy} worker_warps={self.worker_warps} "
                f"persistent={self.persistent}")


@dataclass
class OutInputs:
    """What stage 3 reads, on the GPU. A (H,) fp32; D (H, P) fp32 or None; seq_idx (b, L) int or None;
    start_states (nseq, H, P, N) per-sequence initial states or None; cu_seqlens or None."""

    x: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    log2_decay_cumsum: torch.Tensor
    A: torch.Tensor
    chunk_states: torch.Tensor
    D: torch.Tensor | None = None
    z: torch.Tensor | None = None
    seq_idx: torch.Tensor | None = None
    start_states: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None


def compute_out(inp: OutInputs, cfg: ComputeOutConfig, stream=None) -> torch.Tensor:
    """out (b, L, H, P) in x's dtype; see the module docstring. With ``cfg.shared_scores`` the
    stage is two launches: kernels/chunk_scores.py, then this kernel reading its scores. stream:
    where to launch (default: the current stream of the inputs' device)."""
    stream = launch_stream(inp.x, stream)
    b, L, H, P = inp.x.shape
    out = torch.empty(b, L, H, P, device=inp.x.device, dtype=inp.x.dtype)
    nchunks = -(-L // cfg.chunk_size)
    npb = -(-P // cfg.p_block)
    nrow_blocks = nchunks * (cfg.chunk_size // cfg.row_block)
    ntiles = b * nrow_blocks * npb * H
    dev, f32, i32 = out.device, torch.float32, torch.int32
    if cfg.shared_scores:
        scores = chunk_scores(inp.B, inp.C, inp.x, ChunkScoresConfig.for_out(cfg), stream)
    else:
        scores = placeholder(dev, f32, 5)
    # Absent optional arrays are never read (their flags are off): stand-ins of a fixed dtype.
    args = (inp.x, inp.B, inp.C, scores, inp.dt, inp.log2_decay_cumsum, inp.A, inp.chunk_states,
            inp.D if inp.D is not None else placeholder(dev, f32, 2),
            inp.z if inp.z is not None else inp.x,
            inp.seq_idx if inp.seq_idx is not None else placeholder(dev, i32, 2),
            inp.start_states if inp.start_states is not None else placeholder(dev, f32, 4),
            inp.cu_seqlens if inp.cu_seqlens is not None else placeholder(dev, i32, 1),
            out, L, H, H // inp.B.shape[2], npb, ntiles, *cfg.constants())
    ct.launch(stream, (cfg.launch_blocks(ntiles, out.device),), cfg.kernel, args)
    return out
