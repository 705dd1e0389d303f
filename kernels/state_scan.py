"""Stage 2 in one kernel, for calls with many (batch row, head) pairs: chunk_state and the state
passing fused into one walk over the chunks.

    x (b, L, H, P), B (b, L, G, N), dt (b, H, nchunks, Q) and log2_decay_cumsum
    (b, H, nchunks, 2, Q) fp32 (kernels/chunk_cumsum.py), start_states (b, H, P, N) or none
    -> chunk_states (b, nchunks, H, P, N) state_dtype: h after c*Q steps (c = 0: the row's start)
       final_states (b, H, P, N) fp32

A block owns one (row, head, P_BLOCK x N_BLOCK tile) and walks its chunks in order, STEP chunks
a step (``chunks_per_step``), keeping h in float32 registers: it stores h as the state entering
chunk c, then

    h <- 2^(S_last) h + x_c^T (w o B_c),   w_t = dt_t 2^(S_last - S_t)

with the whole chunk as the MMA's contraction (one x and one B tile a step, read in the order the
MMA consumes them). S is flat past seqlen (dt is 0 there), so the chunk's last entry is S at its
last position, and x is read as zero past L: the last, partial chunk needs no mask. The
increments never reach memory, the stage's traffic is x read once and the states written once,
but the chunks of a row are no longer parallel: kernels/fwd_pass_state.py (chunk-parallel
increments, then a walk that adds them) keeps the calls with fewer than 64 (row, head) pairs,
where this kernel's few blocks would walk too many chunks each. No sequence index, per-sequence
initial states or varlen states (the dispatcher, ``kernels.ssd.fuses_state_scan``, sends those
there too).

Measured on the H200 in one process against the forward at chunk 256 (bf16, out alone,
reports/h200/experiments/ab_state_scan_436fba5.txt): at chunk 128 this stage took 0.315 ms at
(8, 4096, 64 heads) with P x N tiles of 64 x 128 (0.340 at 64 x 64, where chunk_state and the
state passing took 0.444 at chunk 128 and 0.283 at 256), and the forward 0.717 against 0.755 ms;
at (4, 8192, 32 heads, 8 groups) 0.169 ms and the forward 0.373 against 0.413. Chunk 128 is what
pays: compute_out's causal blocks shrink (0.466 -> 0.364 ms at the first shape). At chunk 64 the
stage took 0.456 ms; loading the next chunk's operands one step ahead 0.521 against 0.340; the
occupancy hints 2 and 4 spill (60-140 ms). In the bench at 58226fa (experiments/
bench_check_58226fa.txt), the stage 0.318 / 0.167 ms at the first two anchors, the forwards
0.704 / 0.381 ms (1.56x / 1.83x mamba_ssm's in that run), out's normwise error 2.40e-3 against
2.38e-3 at chunk 256 (mamba_ssm 2.37e-3). At 64 pairs (one row of 64 heads, 512 chunks each
walked by 128 blocks of 64 x 64 tiles) the stage took 0.622 ms against the two kernels' 0.584 at
chunk 256, and the forward 1.372 against 1.543 ms; at 32 pairs the forward lost, 0.955 against
0.861 ms (experiments/ab_fused_64pairs_e85c35f.txt).

Two chunks a step is what makes chunk 64 pay (experiments/ab_scan_chunk_steps_4e052d9.txt, one
process, out alone, compute_out at chunk 256's table tiles): the step's four loads are issued
together, so a walk of twice the chunks waits on as many loads as chunk 128's. At the first
anchor the stage took 0.261 ms (64 x 128 tiles; 0.493 at one chunk a step, 0.284 at chunk 128)
and the forward 0.566 against 0.661 ms at chunk 128; at the second 0.135 ms and 0.324 against
0.394; at one row of 64 heads (64 x 64 tiles) 0.739 ms and 1.351 against 1.455, compute_out
0.577 against 0.716. Four chunks a step spill on sm_90.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.device import launch_stream
from kernels.fwd_pass_state import weights_ride_on_x
from kernels.tile_ops import (MODE, KernelVariant, array_constraint, exp2_nonpos, index_variants,
                              kernel_signature, load_transposed,
                              log2_decay_between, placeholder, precise_mma, scalar_constraint,
                              two_sum_add)

ZERO = ct.PaddingMode.ZERO


def state_scan_kernel(x, B, dt, log2_decay_cumsum, start_states, chunk_states, final_states,
                      nchunks, nheads, heads_per_group, n_p_blocks, n_n_blocks,
                      CHUNK: ct.Constant[int], P_BLOCK: ct.Constant[int],
                      N_BLOCK: ct.Constant[int], MODE: ct.Constant[int],
                      HAS_START: ct.Constant[bool], STEP: ct.Constant[int]):
    # N blocks vary fastest: the blocks of one (row, head) read the same x tiles together.
    pid = ct.bid(0)
    n_block = pid % n_n_blocks
    rest = pid // n_n_blocks
    head = rest % nheads
    rest = rest // nheads
    p_block = rest % n_p_blocks
    batch = rest // n_p_blocks
    group = head // heads_per_group
    tile = (1, 1, 1, P_BLOCK, N_BLOCK)
    h = ct.zeros((P_BLOCK, N_BLOCK), dtype=ct.float32)
    if HAS_START:
        h = ct.load(start_states, (batch, head, p_block, n_block), shape=(1, 1, P_BLOCK, N_BLOCK),
                    padding_mode=ZERO).reshape((P_BLOCK, N_BLOCK)).astype(ct.float32)
    # STEP chunks a step: their operands in one load each (a load's latency paid once for STEP
    # MMAs), then the chunks in order. Chunks past the last are zero-padded: dt 0 and a flat
    # cumsum leave h as it is, and their entering states are not stored.
    for step in range((nchunks + STEP - 1) // STEP):
        x_all = load_transposed(x, batch, step, head, p_block, STEP * CHUNK, P_BLOCK, True, 0)
        B_all = ct.load(B, (batch, step, group, n_block), shape=(1, STEP * CHUNK, 1, N_BLOCK),
                        padding_mode=ZERO).reshape((STEP * CHUNK, N_BLOCK))
        dt_all = ct.load(dt, (batch, head, step, 0), shape=(1, 1, STEP, CHUNK),
                         padding_mode=ZERO).reshape((STEP, CHUNK))
        cumsum_all = ct.load(log2_decay_cumsum, (batch, head, step, 0, 0),
                             shape=(1, 1, STEP, 2, CHUNK), padding_mode=ZERO)
        for k in ct.static_iter(range(STEP)):
            chunk = step * STEP + k
            if chunk < nchunks:
                ct.store(chunk_states, (batch, chunk, head, p_block, n_block),
                         h.reshape(tile).astype(chunk_states.dtype))
            x_cols = ct.extract(x_all, (0, k), shape=(P_BLOCK, CHUNK))
            B_rows = ct.extract(B_all, (k, 0), shape=(CHUNK, N_BLOCK))
            dt_rows = ct.extract(dt_all, (k, 0), shape=(1, CHUNK)).reshape((CHUNK,))
            hi, lo = step_log2_cumsum(cumsum_all, k, CHUNK)
            h = next_state(h, x_cols, B_rows, dt_rows, hi, lo, x, B, MODE, P_BLOCK, N_BLOCK,
                           CHUNK)
    ct.store(final_states, (batch, head, p_block, n_block), h.reshape((1, 1, P_BLOCK, N_BLOCK)))


@ct.function
def step_log2_cumsum(cumsum_all, k, CHUNK: ct.Constant[int]):
    """(hi, lo), each (CHUNK,): chunk k's compensated cumsum in a step's (1, 1, STEP, 2, CHUNK)
    tile."""
    one = (1, 1, 1, 1, CHUNK)
    hi = ct.extract(cumsum_all, (0, 0, k, 0, 0), shape=one).reshape((CHUNK,))
    lo = ct.extract(cumsum_all, (0, 0, k, 1, 0), shape=one).reshape((CHUNK,))
    return hi, lo


@ct.function
def add_increment(acc, x_cols, B_rows, w, x, B, MODE: ct.Constant[int],
                  P_BLOCK: ct.Constant[int], N_BLOCK: ct.Constant[int]):
    """acc + x_cols (w o B_rows): acc (P_BLOCK, N_BLOCK) float32, x_cols (P_BLOCK, CHUNK),
    B_rows (CHUNK, N_BLOCK), w (CHUNK,) each position's weight; x and B give the operands'
    dtypes."""
    if weights_ride_on_x(x, B, P_BLOCK, N_BLOCK):
        return precise_mma(x_cols.astype(ct.float32) * w[None, :], B_rows, acc, MODE, x.dtype)
    return precise_mma(x_cols, B_rows.astype(ct.float32) * w[:, None], acc, MODE, x.dtype)


@ct.function
def next_state(h, x_cols, B_rows, dt_rows, hi, lo, x, B, MODE: ct.Constant[int],
               P_BLOCK: ct.Constant[int], N_BLOCK: ct.Constant[int], CHUNK: ct.Constant[int]):
    """The state entering the next chunk, 2^(S_last) h + x_c^T (w o B_c), from h (P_BLOCK,
    N_BLOCK) float32, x_cols (P_BLOCK, CHUNK), B_rows (CHUNK, N_BLOCK), dt_rows, hi, lo (CHUNK,);
    x and B give the operands' dtypes. The carried state is the accumulator the MMA adds the
    chunk's increment to."""
    hi_last = ct.extract(hi, (CHUNK - 1,), shape=(1,))
    lo_last = ct.extract(lo, (CHUNK - 1,), shape=(1,))
    w = dt_rows * exp2_nonpos(log2_decay_between(hi_last, lo_last, hi, lo))
    carry = exp2_nonpos(hi_last + lo_last).reshape((1, 1))
    return add_increment(carry * h, x_cols, B_rows, w, x, B, MODE, P_BLOCK, N_BLOCK)


@ct.function
def add_state_backward(h, later_hi, later_lo, x_cols, B_rows, dt_rows, hi, lo, x, B,
                       MODE: ct.Constant[int], P_BLOCK: ct.Constant[int],
                       N_BLOCK: ct.Constant[int], CHUNK: ct.Constant[int]):
    """Walking chunks last to first: (h + the chunk's increment decayed to the end of the chunks
    walked before it, and those chunks' log2 decay with this one's added). later_hi + later_lo
    (1,) is the log2 decay of the chunks walked so far (<= 0), summed with TwoSum; the rest as
    ``next_state``. h is never rescaled: the chunks' MMAs accumulate as a matmul's do."""
    hi_last = ct.extract(hi, (CHUNK - 1,), shape=(1,))
    lo_last = ct.extract(lo, (CHUNK - 1,), shape=(1,))
    w = dt_rows * exp2_nonpos(later_hi + (later_lo + log2_decay_between(hi_last, lo_last, hi,
                                                                         lo)))
    later_hi, later_lo = two_sum_add(later_hi, later_lo, hi_last, lo_last)
    # An infinite decay leaves inf - inf = NaN in lo (as chunk_cumsum's scan does): its decay is
    # exactly 0, keep hi.
    later_lo = ct.where(ct.abs(later_hi) == math.inf, 0.0, later_lo)
    return (add_increment(h, x_cols, B_rows, w, x, B, MODE, P_BLOCK, N_BLOCK), later_hi,
            later_lo)


# x, B and the states can pass 2^31 elements: 64-bit indexing of those in the wide variant.
KERNELS = index_variants(state_scan_kernel, ("x", "B", "start_states", "chunk_states",
                                             "final_states"))


@dataclass(frozen=True)
class StateScanConfig(KernelVariant):
    VARIANTS = KERNELS

    x_dtype: torch.dtype = torch.bfloat16
    b_dtype: torch.dtype = torch.bfloat16
    start_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.bfloat16
    chunk_size: int = 128
    p_block: int = 64
    n_block: int = 64
    precision: str = "input"
    has_start: bool = False
    wide: bool = False
    occupancy: int | None = None
    chunks_per_step: int = 1

    def constants(self) -> tuple:
        return (self.chunk_size, self.p_block, self.n_block, MODE[self.precision],
                self.has_start, self.chunks_per_step)

    def signature(self):
        f32, i32, w = torch.float32, torch.int32, self.wide
        return kernel_signature([
            array_constraint(self.x_dtype, 4, w), array_constraint(self.b_dtype, 4, w),
            array_constraint(f32, 4), array_constraint(f32, 5),
            array_constraint(self.start_dtype, 4, w), array_constraint(self.state_dtype, 5, w),
            array_constraint(f32, 4, w), *(scalar_constraint(i32) for _ in range(5)),
            *self.constants()])

    def describe(self) -> str:
        return (f"state_scan x={self.x_dtype} B={self.b_dtype} Q={self.chunk_size} "
                f"PB={self.p_block} NB={self.n_block} {self.precision} "
                f"start={self.has_start}:{self.start_dtype} states={self.state_dtype} "
                f"int64={self.wide} occupancy={self.occupancy} step={self.chunks_per_step}")


def state_scan(x, B, dt, log2_decay_cumsum, start_states, cfg: StateScanConfig, stream=None):
    """(chunk_states, final_states, None), as kernels.fwd_pass_state.fwd_pass_state returns them
    for a call without sequence index or varlen states. start_states (b, H, P, N) or None.
    stream: where to launch (default: the current stream of the inputs' device)."""
    b, L, H, P = x.shape
    N = B.shape[3]
    nchunks = -(-L // cfg.chunk_size)
    chunk_states = torch.empty(b, nchunks, H, P, N, device=x.device, dtype=cfg.state_dtype)
    final_states = torch.empty(b, H, P, N, device=x.device, dtype=torch.float32)
    npb, nnb = -(-P // cfg.p_block), -(-N // cfg.n_block)
    start = start_states if start_states is not None else placeholder(x.device, torch.float32, 4)
    ct.launch(launch_stream(x, stream), (b * H * npb * nnb,),
              cfg.kernel,
              (x, B, dt, log2_decay_cumsum, start, chunk_states, final_states, nchunks, H,
               H // B.shape[2], npb, nnb, *cfg.constants()))
    return chunk_states, final_states, None
