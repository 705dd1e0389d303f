"""Stage 2: the state entering every chunk, in two kernels.

    x (b, L, H, P), B (b, L, G, N), dt (b, H, nchunks, Q) and log2_decay_cumsum
    (b, H, nchunks, 2, Q) fp32 (kernels/chunk_cumsum.py)
    -> chunk_states (b, nchunks, H, P, N) state_dtype: h after c*Q steps (c = 0: the row's start)
       final_states (b, H, P, N) fp32; varlen_states (nseq, H, P, N) fp32 with cu_seqlens

``chunk_state_kernel`` (parallel over chunks, heads and P x N tiles) computes, for every *target*
(the last position e of a chunk, and with cu_seqlens the last position of every sequence), how the
state moves from entering the target's chunk c to after e:

    state_after(e) = carry_weight * state_entering(c) + increment
    increment      = sum_{t in c, t <= e, seq(t) = seq(e)} (x_t dt_t 2^(S_e - S_t)) (outer) B_t
                     [+ H0(seq(e)) 2^(S_e - S_(r-1)) when seq(e) starts at r inside the chunk
                        and starts from its own per-sequence initial state H0]
    carry_weight   = 2^(S_e) when seq(e) is the sequence entering the chunk, else 0

The increment is the (headdim x dstate) matmul x^T (w B) on tensor cores (precision per
``kernels.tile_ops``; r's own step in the exponent per ``log2_decay_since``), stored in float32,
or in bf16 where it was summed in 'input' from bf16 x (a call that returns no states,
``kernels.ssd.state_precision``), as the states it adds up to are stored.
``state_passing_kernel`` then walks the chunks once per (row, head, P x N tile):
h <- carry_weight * h + increment, a few FLOPs per element, so the sequential part is a stream
through memory, not a chain of matmuls, with batch x heads x tiles blocks in flight (the tiles
shrink until there are a few per SM), each loading the next chunk's increment ahead of its update.
Measured on the H200 (bf16 x, chunk 256, the tuner timing both kernels together at (8, 4096,
64 heads); reports/h200/experiments/tune_21181f8_*.json.gz): 0.54 ms with the chunk-state matmul in
three bf16 terms at its best tiles; at the same tiles 0.87 ms in three TF32 terms, and 0.43 ms
in one bf16 MMA, which rounds the weighted operand to bf16 (states no longer float32-grade).
A fused kernel that walked each (row, head, tile) through the chunks, computing every increment
where the walk needs it (none stored), lost at all three anchor shapes: 0.70 vs 0.54, 0.42 vs 0.32
and 2.29 vs 1.22 ms at the best tiles of each (21181f8, since removed): the chunks of a row lose
their parallelism to save a round trip that costs little. With a whole chunk in each MMA (chunk
128, or 64 at two chunks a step), the fused walk wins where many (row, head) pairs run
(kernels/state_scan.py, the dispatcher's pick there since 58226fa, at chunk 64 since 76abcd6);
these two kernels keep the rest. Keeping that parallelism, with chunk_state's blocks taking
tickets chunk by chunk and each adding its increment to the state its predecessor published
through an acquire/release flag (no increments stored, one launch fewer), doubled the states stage
at the first anchor (0.55 vs 0.28 ms; branch perf/chained-states,
experiments/ab_chained_18d1c22.txt): each block's wait, carry round trip and release fence add to
a kernel that holds two blocks an SM. ncu (4f66ebf,
reports/h200/experiments/ncu_anchor1_4f66ebf.txt.gz): state_passing_kernel 0.13 ms at 3.96 TB/s
(82% of DRAM peak). chunk_state_kernel is latency-bound (occupancy 17%,
experiments/ncu_anchor0_6106f85.txt.gz): a latency hint of 6 on its x and B loads took the states
stage from 0.52 to 0.43 ms at the first anchor, 10 from 0.26 to 0.24 at the second (tuner, bf16
chunk states, 5b56790; the sm_90 cubins differ with the hint).
``adds_entering``: chunk_state launched over the sequences' ends alone, after the walk of
kernels/scan_out.py has stored the state entering each end's chunk where the end's state goes
(``add_sequence_end_increments``): each tile adds its carry weight times that state to its
increment in place, the sum state_passing forms, with the resets read from the cumsum (no
sequence index). Where ``kernels.ssd.WALK_VARLEN_STATES`` lets the walk take varlen states.
``persistent`` (a tuner knob, ``KernelVariant.launch_blocks``) launches chunk_state as the
blocks the SMs hold at once, each walking tiles ``ct.num_blocks(0)`` apart; at the first anchor
it lost (0.317 ms against 0.288, experiments/tune_1f159b8_chunk_state_anchor0_out_alone.json.gz).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.device import launch_stream
from kernels.tile_ops import (MODE, KernelVariant, array_constraint, exp2_nonpos, is_16bit,
                              index_variants, kernel_signature, latency_hint, load_log2_cumsum,
                              load_transposed, log2_cumsum_at, log2_decay_between,
                              log2_decay_since, placeholder, precise_mma, scalar_constraint)

ZERO = ct.PaddingMode.ZERO


@ct.function
def split_block_index(pid, nheads, n_p_blocks, n_n_blocks):
    """(head, P block, N block, the rest) of a block index whose heads vary fastest (blocks
    running together read the same rows of B: one group)."""
    head = pid % nheads
    rest = pid // nheads
    p_block = rest % n_p_blocks
    rest = rest // n_p_blocks
    return head, p_block, rest % n_n_blocks, rest // n_n_blocks


@ct.function
def weights_ride_on_x(x, B, P_BLOCK: ct.Constant[int], N_BLOCK: ct.Constant[int]):
    """Whether an increment's decay weights multiply its x operand rather than its B operand.
    The other operand stays as loaded: a 16-bit operand left alone is exact in TF32, so the split
    modes cut only the weighted one, in 3 terms (~2^-33 per product) instead of both in 2
    (~2^-22). Between operands of one kind, weighting the smaller tile costs fewer elementwise
    ops and splits."""
    return is_16bit(x) == is_16bit(B) and P_BLOCK <= N_BLOCK or is_16bit(B) and not is_16bit(x)


@ct.function
def chunk_increment(x, B, dt, log2_decay_cumsum, seq_idx, batch, head, group, p_block, n_block,
                    end, seq_end, hi_end, lo_end, CHUNK: ct.Constant[int],
                    ROW_BLOCK: ct.Constant[int], P_BLOCK: ct.Constant[int],
                    N_BLOCK: ct.Constant[int], MODE: ct.Constant[int],
                    HAS_SEQ: ct.Constant[bool], TRANSPOSED: ct.Constant[bool],
                    ORDERED_LOADS: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """(P_BLOCK, N_BLOCK) float32: sum over the positions t of end's chunk up to ``end`` (and in
    seq_end's sequence) of (x_t dt_t 2^(S_end - S_t)) (outer) B_t. LATENCY: the x and B loads'
    latency hint (``load_transposed``)."""
    chunk = end // CHUNK
    end_local = end - chunk * CHUNK
    # The increment is a contraction over the chunk's positions, the strided axis of both x and
    # B: one operand is transposed (read so by the load with ORDERED_LOADS, else after it).
    # TRANSPOSED accumulates its transpose (N_BLOCK x P_BLOCK) = B^T x instead: the tuner weighs
    # which operand that is and which tile extent the MMA's rows get.
    if TRANSPOSED:
        acc = ct.zeros((N_BLOCK, P_BLOCK), dtype=ct.float32)
    else:
        acc = ct.zeros((P_BLOCK, N_BLOCK), dtype=ct.float32)
    weight_x = weights_ride_on_x(x, B, P_BLOCK, N_BLOCK)
    rows_per_chunk = CHUNK // ROW_BLOCK
    for row_block in range(end_local // ROW_BLOCK + 1):
        local = row_block * ROW_BLOCK + ct.arange(ROW_BLOCK, dtype=ct.int32)
        rows = chunk * rows_per_chunk + row_block
        if TRANSPOSED:
            x_rows = ct.load(x, (batch, rows, head, p_block), shape=(1, ROW_BLOCK, 1, P_BLOCK),
                             padding_mode=ZERO, latency=latency_hint(LATENCY)
                             ).reshape((ROW_BLOCK, P_BLOCK))
            B_cols = load_transposed(B, batch, rows, group, n_block, ROW_BLOCK, N_BLOCK,
                                     ORDERED_LOADS, LATENCY)
        else:
            x_cols = load_transposed(x, batch, rows, head, p_block, ROW_BLOCK, P_BLOCK,
                                     ORDERED_LOADS, LATENCY)
            B_rows = ct.load(B, (batch, rows, group, n_block), shape=(1, ROW_BLOCK, 1, N_BLOCK),
                             padding_mode=ZERO, latency=latency_hint(LATENCY)
                             ).reshape((ROW_BLOCK, N_BLOCK))
        dt_rows = ct.load(dt, (batch, head, chunk, row_block),
                          shape=(1, 1, 1, ROW_BLOCK)).reshape((ROW_BLOCK,))
        hi_rows, lo_rows = load_log2_cumsum(log2_decay_cumsum, batch, head, chunk, row_block,
                                            ROW_BLOCK)
        keep = local <= end_local
        if HAS_SEQ:
            seq_rows = ct.load(seq_idx, (batch, rows), shape=(1, ROW_BLOCK),
                               padding_mode=ZERO).reshape((ROW_BLOCK,))
            keep = keep & (seq_rows == seq_end)
        w = ct.where(keep, dt_rows * exp2_nonpos(log2_decay_between(hi_end, lo_end, hi_rows,
                                                                    lo_rows)), 0.0)
        if TRANSPOSED and weight_x:
            acc = precise_mma(B_cols, x_rows.astype(ct.float32) * w[:, None], acc, MODE, x.dtype)
        elif TRANSPOSED:
            acc = precise_mma(B_cols.astype(ct.float32) * w[None, :], x_rows, acc, MODE, x.dtype)
        elif weight_x:
            acc = precise_mma(x_cols.astype(ct.float32) * w[None, :], B_rows, acc, MODE, x.dtype)
        else:
            acc = precise_mma(x_cols, B_rows.astype(ct.float32) * w[:, None], acc, MODE, x.dtype)
    if TRANSPOSED:
        acc = acc.transpose()
    return acc


@ct.function
def increment_tile(x, B, dt, log2_decay_cumsum, A, seq_idx, start_states, cu_seqlens, target_ends,
                   increment, carry_weight, seqlen, nchunks, ntargets, nheads, heads_per_group,
                   n_p_blocks, n_n_blocks, pid, CHUNK: ct.Constant[int],
                   ROW_BLOCK: ct.Constant[int], P_BLOCK: ct.Constant[int],
                   N_BLOCK: ct.Constant[int], MODE: ct.Constant[int], HAS_SEQ: ct.Constant[bool],
                   PER_SEQ_START: ct.Constant[bool], VARLEN: ct.Constant[bool],
                   TRANSPOSED: ct.Constant[bool], ORDERED_LOADS: ct.Constant[bool],
                   LATENCY: ct.Constant[int], ADDS_ENTERING: ct.Constant[bool]):
    """Tile ``pid``: one target's increment for one head and P x N tile, and its carry weight;
    ADDS_ENTERING: the target's state from the entering state ``increment`` holds, in place."""
    head, p_block, n_block, rest = split_block_index(pid, nheads, n_p_blocks, n_n_blocks)
    target = rest % ntargets
    batch = rest // ntargets
    group = head // heads_per_group

    end = ct.minimum(target * CHUNK + CHUNK, seqlen) - 1
    if VARLEN:
        sequence_end = ct.load(target_ends, (ct.maximum(target - nchunks, 0),), shape=())
        end = ct.where(target >= nchunks, sequence_end, end)
    chunk = end // CHUNK
    first = chunk * CHUNK
    hi_end, lo_end = log2_cumsum_at(log2_decay_cumsum, batch, head, chunk, end - first)
    carried = True
    seq_end = 0
    if HAS_SEQ:
        seq_end = ct.load(seq_idx, (batch, end), shape=(1, 1)).reshape(())
        # Chunk 0's entering state belongs to the row's first sequence.
        seq_before = ct.load(seq_idx, (batch, ct.maximum(first - 1, 0)), shape=(1, 1)).reshape(())
        carried = seq_end == seq_before
    weight = ct.where(carried, exp2_nonpos(hi_end + lo_end), 0.0)
    if not ADDS_ENTERING:
        if p_block == 0 and n_block == 0:
            ct.store(carry_weight, (batch, head, target), weight.reshape((1, 1, 1)))
    acc = chunk_increment(x, B, dt, log2_decay_cumsum, seq_idx, batch, head, group, p_block,
                          n_block, end, seq_end, hi_end, lo_end, CHUNK, ROW_BLOCK, P_BLOCK,
                          N_BLOCK, MODE, HAS_SEQ, TRANSPOSED, ORDERED_LOADS, LATENCY)

    if PER_SEQ_START:
        # seq(e) began at r = cu_seqlens[seq(e)] inside this chunk (when not carried) from its own
        # H0, decayed from just before r.
        start = ct.load(cu_seqlens, (seq_end,), shape=())
        exponent = log2_decay_since(log2_decay_cumsum, dt, A, batch, head, chunk,
                                    ct.maximum(start - first, 0), hi_end, lo_end)
        h0 = ct.load(start_states, (seq_end, head, p_block, n_block),
                     shape=(1, 1, P_BLOCK, N_BLOCK), padding_mode=ZERO).reshape((P_BLOCK, N_BLOCK))
        acc = acc + h0.astype(ct.float32) * ct.where(carried, 0.0, exp2_nonpos(exponent))
    if ADDS_ENTERING:
        # The walk of kernels/scan_out.py left the state entering the end's chunk here: the
        # end's state as state_passing forms it from its own (w_seq * h + inc_seq).
        entering = ct.load(increment, (batch, target, head, p_block, n_block),
                           shape=(1, 1, 1, P_BLOCK, N_BLOCK),
                           padding_mode=ZERO).reshape((P_BLOCK, N_BLOCK))
        acc = weight * entering + acc

    ct.store(increment, (batch, target, head, p_block, n_block),
             acc.reshape((1, 1, 1, P_BLOCK, N_BLOCK)).astype(increment.dtype))


def chunk_state_kernel(x, B, dt, log2_decay_cumsum, A, seq_idx, start_states, cu_seqlens,
                       target_ends, increment, carry_weight,
                       seqlen, nchunks, ntargets, nheads, heads_per_group, n_p_blocks, n_n_blocks,
                       ntiles, CHUNK: ct.Constant[int], ROW_BLOCK: ct.Constant[int],
                       P_BLOCK: ct.Constant[int], N_BLOCK: ct.Constant[int],
                       MODE: ct.Constant[int],
                       HAS_SEQ: ct.Constant[bool], PER_SEQ_START: ct.Constant[bool],
                       VARLEN: ct.Constant[bool], TRANSPOSED: ct.Constant[bool],
                       ORDERED_LOADS: ct.Constant[bool], LATENCY: ct.Constant[int],
                       PERSISTENT: ct.Constant[bool], ADDS_ENTERING: ct.Constant[bool]):
    # PERSISTENT: resident blocks walk the ntiles tiles (KernelVariant.launch_blocks); at the
    # first anchor ncu measured 17% achieved occupancy against 25% possible
    # (experiments/ncu_anchor0_out_alone_5d543e6.txt.gz).
    if PERSISTENT:
        for tile in range(ct.bid(0), ntiles, ct.num_blocks(0)):
            increment_tile(x, B, dt, log2_decay_cumsum, A, seq_idx, start_states, cu_seqlens,
                           target_ends, increment, carry_weight, seqlen, nchunks, ntargets,
                           nheads, heads_per_group, n_p_blocks, n_n_blocks, tile, CHUNK,
                           ROW_BLOCK, P_BLOCK, N_BLOCK, MODE, HAS_SEQ, PER_SEQ_START, VARLEN,
                           TRANSPOSED, ORDERED_LOADS, LATENCY, ADDS_ENTERING)
    else:
        increment_tile(x, B, dt, log2_decay_cumsum, A, seq_idx, start_states, cu_seqlens,
                       target_ends, increment, carry_weight, seqlen, nchunks, ntargets, nheads,
                       heads_per_group, n_p_blocks, n_n_blocks, ct.bid(0), CHUNK, ROW_BLOCK,
                       P_BLOCK, N_BLOCK, MODE, HAS_SEQ, PER_SEQ_START, VARLEN, TRANSPOSED,
                       ORDERED_LOADS, LATENCY, ADDS_ENTERING)


def state_passing_kernel(increment, carry_weight, start_states, varlen_offsets, chunk_states,
                         final_states, varlen_states, nchunks, nheads, n_p_blocks, n_n_blocks,
                         P_BLOCK: ct.Constant[int], N_BLOCK: ct.Constant[int],
                         HAS_START: ct.Constant[bool], VARLEN: ct.Constant[bool],
                         VARLEN_ENTERING: ct.Constant[bool]):
    head, p_block, n_block, batch = split_block_index(ct.bid(0), nheads, n_p_blocks, n_n_blocks)
    tile = (1, 1, 1, P_BLOCK, N_BLOCK)
    h = ct.zeros((P_BLOCK, N_BLOCK), dtype=ct.float32)
    if HAS_START:
        h = ct.load(start_states, (batch, head, p_block, n_block), shape=(1, 1, P_BLOCK, N_BLOCK),
                    padding_mode=ZERO).reshape((P_BLOCK, N_BLOCK)).astype(ct.float32)
    # The walk is latency-bound: chunk c+1's weight and increment are loaded before chunk c's
    # update, so their loads overlap the store and the update instead of following them.
    w = ct.load(carry_weight, (batch, head, 0), shape=(1, 1, 1)).reshape((1, 1))
    inc = ct.load(increment, (batch, 0, head, p_block, n_block), shape=tile).reshape(
        (P_BLOCK, N_BLOCK)).astype(ct.float32)
    for chunk in range(nchunks):
        following = ct.minimum(chunk + 1, nchunks - 1)
        w_next = ct.load(carry_weight, (batch, head, following), shape=(1, 1, 1)).reshape((1, 1))
        inc_next = ct.load(increment, (batch, following, head, p_block, n_block),
                           shape=tile).reshape((P_BLOCK, N_BLOCK)).astype(ct.float32)
        ct.store(chunk_states, (batch, chunk, head, p_block, n_block),
                 h.reshape(tile).astype(chunk_states.dtype))
        if VARLEN:
            # Sequences ending in this chunk (targets nchunks + k, sorted by end): from the fp32 h.
            first = ct.load(varlen_offsets, (chunk,), shape=())
            stop = ct.load(varlen_offsets, (chunk + 1,), shape=())
            for k in range(first, stop):
                if VARLEN_ENTERING:
                    ct.store(varlen_states, (k, head, p_block, n_block),
                             h.reshape((1, 1, P_BLOCK, N_BLOCK)))
                else:
                    w_seq = ct.load(carry_weight, (batch, head, nchunks + k),
                                    shape=(1, 1, 1)).reshape((1, 1))
                    inc_seq = ct.load(increment, (batch, nchunks + k, head, p_block, n_block),
                                      shape=tile).reshape((P_BLOCK, N_BLOCK)).astype(ct.float32)
                    ct.store(varlen_states, (k, head, p_block, n_block),
                             (w_seq * h + inc_seq).reshape((1, 1, P_BLOCK, N_BLOCK)))
        h = w * h + inc
        w, inc = w_next, inc_next
    ct.store(final_states, (batch, head, p_block, n_block), h.reshape((1, 1, P_BLOCK, N_BLOCK)))


# x, B, the increments and the stored states can pass 2^31 elements (e.g. batch 1, 139264
# positions, 256 heads of 64): those arrays get 64-bit indexing in the wide variants.
CHUNK_STATE_KERNELS = index_variants(chunk_state_kernel, ("x", "B", "increment", "start_states"))
STATE_PASSING_KERNELS = index_variants(
    state_passing_kernel, ("increment", "start_states", "chunk_states", "final_states",
                           "varlen_states"))


@dataclass(frozen=True)
class ChunkStateConfig(KernelVariant):
    VARIANTS = CHUNK_STATE_KERNELS

    x_dtype: torch.dtype = torch.float32
    b_dtype: torch.dtype = torch.float32
    seq_dtype: torch.dtype = torch.int32
    start_dtype: torch.dtype = torch.float32
    cu_dtype: torch.dtype = torch.int32
    chunk_size: int = 128
    row_block: int = 64
    p_block: int = 64
    n_block: int = 64
    precision: str = "3xtf32"
    increment_dtype: torch.dtype = torch.float32     # kernels.ssd: bf16 beside 'input' sums
    has_seq: bool = False
    per_seq_start: bool = False
    varlen: bool = False
    transposed: bool = False
    ordered_loads: bool = False
    latency: int = 0          # the x and B loads' latency hint; 0: the compiler's inference
    wide: bool = False
    occupancy: int | None = None
    worker_warps: int | None = None     # tile_ops.with_hints; None: the compiler's (4)
    persistent: bool = False            # KernelVariant.launch_blocks
    # The sequences' ends alone, each added to the state the walk stored for it in place
    # (``add_sequence_end_increments``).
    adds_entering: bool = False

    def constants(self) -> tuple:
        return (self.chunk_size, self.row_block, self.p_block, self.n_block,
                MODE[self.precision], self.has_seq, self.per_seq_start, self.varlen,
                self.transposed, self.ordered_loads, self.latency, self.persistent,
                self.adds_entering)

    def signature(self):
        f32, i32, w = torch.float32, torch.int32, self.wide
        return kernel_signature([
            array_constraint(self.x_dtype, 4, w), array_constraint(self.b_dtype, 4, w),
            array_constraint(f32, 4), array_constraint(f32, 5), array_constraint(f32, 1),
            array_constraint(self.seq_dtype, 2), array_constraint(self.start_dtype, 4, w),
            array_constraint(self.cu_dtype, 1), array_constraint(i32, 1),
            array_constraint(self.increment_dtype, 5, w), array_constraint(f32, 3),
            *(scalar_constraint(i32) for _ in range(8)), *self.constants()])

    def describe(self) -> str:
        return (f"chunk_state x={self.x_dtype} B={self.b_dtype} Q={self.chunk_size} "
                f"RB={self.row_block} PB={self.p_block} NB={self.n_block} "
                f"{self.precision} increment={self.increment_dtype} seq={self.has_seq} "
                f"per_seq_start={self.per_seq_start} varlen={self.varlen} "
                f"transposed={self.transposed} ordered_loads={self.ordered_loads} "
                f"latency={self.latency} int64={self.wide} occupancy={self.occupancy} "
                f"worker_warps={self.worker_warps} persistent={self.persistent} "
                f"adds_entering={self.adds_entering}")


@dataclass(frozen=True)
class StatePassingConfig(KernelVariant):
    VARIANTS = STATE_PASSING_KERNELS

    start_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    increment_dtype: torch.dtype = torch.float32
    p_block: int = 32
    n_block: int = 64
    has_start: bool = False
    varlen: bool = False
    wide: bool = False
    occupancy: int | None = None
    # An A/B knob: the varlen loop stores the state entering each end's chunk, and the host
    # adds the ends' carry-weighted states and increments (``fwd_pass_state``). On sm_90 it
    # takes the loop's spill at occupancy 8 (360-456 bytes at 32-wide tiles) to none.
    varlen_entering: bool = False

    def constants(self) -> tuple:
        return (self.p_block, self.n_block, self.has_start, self.varlen, self.varlen_entering)

    def signature(self):
        f32, i32, w = torch.float32, torch.int32, self.wide
        return kernel_signature([
            array_constraint(self.increment_dtype, 5, w), array_constraint(f32, 3),
            array_constraint(self.start_dtype, 4, w), array_constraint(i32, 1),
            array_constraint(self.state_dtype, 5, w), array_constraint(f32, 4, w),
            array_constraint(f32, 4, w), *(scalar_constraint(i32) for _ in range(4)),
            *self.constants()])

    def describe(self) -> str:
        return (f"state_passing start={self.start_dtype} states={self.state_dtype} "
                f"increment={self.increment_dtype} "
                f"PB={self.p_block} NB={self.n_block} start={self.has_start} "
                f"varlen={self.varlen} int64={self.wide} occupancy={self.occupancy} "
                f"varlen_entering={self.varlen_entering}")


@dataclass
class StateInputs:
    """What stage 2 reads, already on the GPU. A (H,) fp32; seq_idx (b, L) int or None; start_states: the
    row's start states (b, H, P, N), or with per_seq_start the (nseq, H, P, N) per-sequence ones
    (batch 1, cu_seqlens given); cu_seqlens (nseq + 1,) int or None."""

    x: torch.Tensor
    B: torch.Tensor
    dt: torch.Tensor
    log2_decay_cumsum: torch.Tensor
    A: torch.Tensor
    seq_idx: torch.Tensor | None = None
    start_states: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    per_seq_start: bool = False
    varlen: bool = False


def fwd_pass_state(inp: StateInputs, chunk_cfg: ChunkStateConfig, pass_cfg: StatePassingConfig,
                   stream=None):
    """(chunk_states, final_states, varlen_states or None); layouts in the module docstring.
    stream: where to launch (default: the current stream of the inputs' device)."""
    b, L, H, P = inp.x.shape
    N = inp.B.shape[3]
    Q = chunk_cfg.chunk_size
    nchunks = -(-L // Q)
    dev, f32 = inp.x.device, torch.float32
    ends = sequence_ends(inp.cu_seqlens) if inp.varlen else None
    ntargets = nchunks + (0 if ends is None else ends.numel())
    if chunk_cfg.increment_dtype != pass_cfg.increment_dtype:
        raise ValueError(f"the chunk_state and state_passing configs disagree on the increments' "
                         f"dtype: {chunk_cfg.increment_dtype} vs {pass_cfg.increment_dtype}")
    increment = torch.empty(b, ntargets, H, P, N, device=dev, dtype=chunk_cfg.increment_dtype)
    carry_weight = torch.empty(b, H, ntargets, device=dev, dtype=f32)
    # Absent arrays are never read (their flags are off): stand-ins of a fixed dtype.
    placeholder_int = placeholder(dev, torch.int32, 1)
    placeholder_states = placeholder(dev, f32, 4)
    seq_idx = inp.seq_idx if inp.seq_idx is not None else placeholder(dev, torch.int32, 2)
    start = inp.start_states if inp.per_seq_start else placeholder_states
    cu = inp.cu_seqlens if inp.cu_seqlens is not None else placeholder_int
    target_ends = ends if ends is not None else placeholder_int
    npb, nnb = -(-P // chunk_cfg.p_block), -(-N // chunk_cfg.n_block)
    stream = launch_stream(inp.x, stream)
    ntiles = ntargets * b * H * npb * nnb
    ct.launch(stream, (chunk_cfg.launch_blocks(ntiles, dev),), chunk_cfg.kernel,
              (inp.x, inp.B, inp.dt, inp.log2_decay_cumsum, inp.A, seq_idx, start, cu, target_ends,
               increment, carry_weight, L, nchunks, ntargets, H, H // inp.B.shape[2], npb, nnb,
               ntiles, *chunk_cfg.constants()))

    chunk_states = torch.empty(b, nchunks, H, P, N, device=dev, dtype=pass_cfg.state_dtype)
    final_states = torch.empty(b, H, P, N, device=dev, dtype=f32)
    varlen_states = None
    offsets = placeholder_int
    if ends is not None:
        varlen_states = torch.empty(ends.numel(), H, P, N, device=dev, dtype=f32)
        offsets = sequence_end_offsets(ends, nchunks, Q)
    row_start = inp.start_states
    if row_start is not None and inp.per_seq_start:
        row_start = row_start[:1]     # batch 1: the row starts with sequence 0
    npb, nnb = -(-P // pass_cfg.p_block), -(-N // pass_cfg.n_block)
    ct.launch(stream, (b * H * npb * nnb,), pass_cfg.kernel,
              (increment, carry_weight, placeholder_states if row_start is None else row_start,
               offsets, chunk_states, final_states,
               final_states if varlen_states is None else varlen_states,
               nchunks, H, npb, nnb, *pass_cfg.constants()))
    if varlen_states is not None and pass_cfg.varlen_entering:
        # state_passing stored the state entering each end's chunk: each end's state is its
        # carry weight times that plus its increment (targets nchunks + k), one elementwise op.
        with torch.cuda.stream(stream):
            torch.addcmul(increment[0, nchunks:],
                          carry_weight[0, :, nchunks:].t()[..., None, None], varlen_states,
                          out=varlen_states)
    return chunk_states, final_states, varlen_states


def sequence_ends(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The last position of each sequence of cu_seqlens, (nseq,) int32 in order."""
    return (cu_seqlens[1:] - 1).to(torch.int32)


def sequence_end_offsets(ends: torch.Tensor, nchunks: int, chunk_size: int) -> torch.Tensor:
    """(nchunks + 1,) int32: the ends in chunk c are ends[offsets[c]:offsets[c + 1]]."""
    chunk_starts = torch.arange(0, (nchunks + 1) * chunk_size, chunk_size, device=ends.device,
                                dtype=torch.int32)
    return torch.searchsorted(ends, chunk_starts, out_int32=True)


def add_sequence_end_increments(x, B, dt, log2_decay_cumsum, A, ends, varlen_states,
                                cfg: ChunkStateConfig, stream=None) -> None:
    """varlen_states (nseq, H, P, N) fp32, holding the state entering the chunk of each end
    (batch 1; the walk of kernels/scan_out.py stores them), becomes each sequence's state after
    its end: chunk_state launched over the ends alone (``cfg.adds_entering``), the carry weight
    and increment of each as ``fwd_pass_state`` computes them, its resets read from the cumsum
    (kernels/chunk_cumsum.py) rather than a sequence index."""
    if not (cfg.adds_entering and cfg.varlen and not cfg.has_seq and not cfg.per_seq_start
            and cfg.increment_dtype == torch.float32):
        raise ValueError(f"add_sequence_end_increments: expected a chunk_state config over the "
                         f"ends alone (adds_entering and varlen, no sequence index, no "
                         f"per-sequence starts, float32 increments), got {cfg.describe()}")
    _, L, H, P = x.shape
    nseq, N = ends.numel(), B.shape[3]
    dev = x.device
    npb, nnb = -(-P // cfg.p_block), -(-N // cfg.n_block)
    ntiles = nseq * H * npb * nnb
    # No chunk targets before the ends (nchunks 0): target k is end k.
    ct.launch(launch_stream(x, stream), (cfg.launch_blocks(ntiles, dev),), cfg.kernel,
              (x, B, dt, log2_decay_cumsum, A, placeholder(dev, cfg.seq_dtype, 2),
               placeholder(dev, cfg.start_dtype, 4), placeholder(dev, cfg.cu_dtype, 1), ends,
               varlen_states.view(1, nseq, H, P, N), placeholder(dev, torch.float32, 3),
               L, 0, nseq, H, H // B.shape[2], npb, nnb, ntiles, *cfg.constants()))
