"""Stages 2 and 3 in one kernel, for the calls kernels/state_scan.py takes: each block walks the
chunks of one (batch row, head, P_BLOCK channels) with the whole state in registers and writes
the chunk's output where the walk is, so no chunk state reaches memory.

    x (b, L, H, P), B, C (b, L, G, N), dt (b, H, nchunks, Q) and log2_decay_cumsum
    (b, H, nchunks, 2, Q) fp32 (kernels/chunk_cumsum.py), scores (b, nchunks, G, Q, Q) fp32
    (kernels/chunk_scores.py, when shared), start_states (b, H, P, N) or none, D (H, P) fp32,
    z (b, L, H, P)  ->  out (b, L, H, P) x.dtype, final_states (b, H, P, N) fp32

Per chunk c, with h the state entering it (P_BLOCK x N, float32):

    y   = 2^(S_i) C_i . h  +  sum_{j <= i} (C_i . B_j) 2^(S_i - S_j) dt_j x_j  [+ D x_i] [* silu z]
    h  <- 2^(S_last) h + x_c^T (w o B_c),   w_t = dt_t 2^(S_last - S_t)

the first line as compute_out computes one chunk-sized row block (kernels/compute_out.py, not
transposed, one column block), the second as the scan does, STEP chunks a step as the scan walks
(``chunks_per_step``; on sm_90 two chunks a step spill 440 bytes with the compiler's 4 worker
warps and none with 8, 251 registers). In 'input' (the only mode the
dispatcher fuses) the MMA rounds h to x's dtype where compute_out reads the stored bf16 state:
the same products. Why: at chunk 64 the stored states are the largest traffic of the forward
(at the first anchor 537 MB written by the scan and read by compute_out, against 562 MB of
inputs and out), and the walk already holds each state when compute_out needs it. The cost:
a block's chunks run in order, so only b * H * (P / P_BLOCK) blocks run, and C, B and the scores
are read once per head instead of once per tile. On the H200 the walk took the first anchor's
forward from 0.566 to 0.498 ms, to 0.419 with two blocks to an SM (the occupancy hint 2,
``kernels.ssd.scan_out_occupancy``) and to 0.376 storing each chunk's out after its state update
(ce6a7f8, the bench's anchors), and lost where 64 pairs leave SMs idle (kernels/ssd.py, at
SCAN_OUT_MIN_ROW_HEADS, has the figures and what the dispatcher picks).

``state_precision``: the mode of the state update's MMA apart from the output's, so that a
call returning final states walks too, its increments float32-grade in '3xbf16' as
``kernels.ssd.state_precision`` asks of them, its out in 'input' (``walk_state_precision``). On
sm_90 at the first anchor: paired 128 registers with a 72-byte spill frame (10 tensor-core MMAs
against 6), alone 168 registers, no spill, 177,632 bytes of shared memory. fp16 x walks in
'2xfp16' (``kernels.ssd.WALK_MODES``): 168 registers, no spill, 195,528 bytes (one block an SM),
12 MMAs; float32 x in '3xbf16' up to dstate 64, 36 MMAs. On the H200 all three beat the
chunk-256 path those calls took before (0.36-0.77x; kernels/ssd.py, at WALK_MODES, has the
figures). Their blocks too run two to an SM where that pays, fp16's up to dstate 64 (128 on
sm_90, out transposed there: ``kernels.ssd.WALK_PAIRING_SM90``), float32's up to 32 and
bf16's opt-in '2xbf16' up to 128 unsplit (``kernels.ssd.WALK_PAIRING``); one an SM, fp16's
at dstate 64 updates its state in '3xfp16' (``kernels.ssd.WALK_STATE_UPDATE_MODES``: two terms
spill 400 bytes there on sm_90).

Step order (``update_early``): on sm_90 the compiler gives the walk a producer warp that issues
each step's TMA loads in program order, each load behind the release of its single buffer by
the step before (cuobjdump of the first anchor's walk at d3276e1: one buffer per operand, 93.6
KB of shared memory a block paired). With the state update last, B's buffer, and every load
queued behind it, frees only at the step's end. Split walks and walks that return final states
(their update float32-grade) update the state right after the entering state's term and load
x last, which frees B mid-step: on the H200 0.87-0.98x the time at 16 of the 20 shapes the
rule takes, 0.998-1.003x at the other 4 (``kernels.ssd.walk_updates_early``); out alone
unsplit it gained nothing. A latency hint on x's load (``x_latency``) changes that buffering
(``kernels.ssd.walk_x_latency``: 0.82-0.87x out alone one block an SM at dstate 128), and one on
B's (``b_latency``) the split walk's one block an SM and fp16's returning final states one an SM
(``kernels.ssd.walk_b_latency``: 0.86-0.90x, 0.84-0.96x). With the state update last and no z,
B's load is the step's last (``B_LAST``), so that fewer loads queue behind B's buffer (sm_90,
the first anchor's walk: the same registers, 8 bytes more shared memory; its producer warp waits
on three barriers a step where it waited on two). On the H200, outs equal, paired 0.978-0.998x
the time (the first anchor 0.989-0.992x in three runs, 8 x 1,024 and 4 x 4,096 tokens, headdim
128 0.995x, with D per channel 0.982x and 0.987x), one block an SM 0.999-1.003x, fp16
1.001-1.003x, float32 1.000x (experiments/ab_walk_b_last_50ae83a.txt). Not taken: with the
early update (returning final states 1.014x and 1.071x) and with z (z alone 1.011x and 0.999x,
D and z 0.984x, D per channel and z 0.994x; experiments/ab_walk_arms_3739255.txt), so those
walks keep their order.

Orientation (``out_transposed``): out^T (P_BLOCK, CHUNK) per chunk, h . C_c^T and x_c^T . W^T,
stored transposed back. On sm_90 the state is then the entering term's MMA operand straight from
registers, where out's own orientation copies h^T to shared memory and fences it before each
step's first MMA; W^T, half its bytes, is copied instead. The same products: outs bit-equal on
the H200, and paired out alone with the shared scores 0.964-0.980x the time, with D
0.914-0.951x; fp16's paired at dstate 128 fits 128 registers only so
(``kernels.ssd.walk_out_transposed``, where the figures and the walks that lost are).

D's term (``d_term``): D x_i is added to out elementwise (x's tile read outside an MMA too), or, D
per head, put on the diagonal of the chunk's weights, whose MMA with x then adds it. On the
diagonal D is rounded with the weight there to the MMA's operand, a bf16 rounding of D x_i in
'input'; with the weights cut into two 16-bit terms (``weights_precision`` "2xbf16" or "2xfp16":
'diagonal_split' in the records below; one more MMA) D x_i is float32-grade. On sm_90
(reports/cpu/experiments/ab_diag_split_*_sm_90_f2edbb3.json, ab_diag_split_sm_90_5386778.json) the
two-segment walk one block an SM with D per head takes 226,832 bytes of shared memory elementwise,
218,624 on the diagonal, as without D (D cost it 21% of its time on the H100), 175,568 split;
paired walks keep their bytes, but from initial states the first anchor's spills 32 bytes on the
diagonal and split takes 240 registers, and with z and final states 64 and 56 bytes spill where
elementwise spills 16. Timed on the H200 (reports/h200/experiments/ab_dterm_c5f7edd.json, six
shapes with D per head): the diagonal took 0.901-0.985x the elementwise walk's time (two segments
alone at the third anchor's size 0.879x the four paired that D elementwise needs), but in 'input'
out's normwise error against float64 rose from 2.05e-3-2.21e-3 to 2.35e-3-2.43e-3 (mamba_ssm's
2.06e-3-2.11e-3 at the models' layers, D per head, in the H200 bench of the same commit), and the
split, more accurate (1.74e-3-1.86e-3), took 1.030-1.102x; in fp16's split mode both took 0.985x,
errors unchanged, at one shape. Not dispatched: the diagonal's speed costs accuracy the issue does
not let it pay, and fp16's 1.5% at one shape is too little for a rule.

The weights' MMA (``weights_precision``): the MMA of the chunk's weights with x in another mode
than the walk's, "" for the walk's own. In 'input' the weights (C_i . B_j decayed, times dt_j)
are rounded to bf16, about half of out's error at the anchors beyond bf16's rounding of out
itself (reports/cpu/experiments/accuracy_chunk_model_3f1040f.txt); "2xbf16" cuts them into two
bf16 terms (one more MMA), "tf32" rounds them and x to TF32 (x exact, the MMA at TF32's rate).
On the H100 (reports/h100/experiments/ab_weights_45dfe11.txt, seven bf16 shapes) both took out's
normwise error against float64 from 2.44e-3-2.47e-3 to 1.90e-3-1.98e-3 (mamba_ssm's 2.37e-3 at
the anchors on the H200), but "2xbf16" 1.05-1.26x the time (1.21x / 1.26x / 1.19x at the
anchors) and "tf32" 1.11-1.56x, whatever the orientation (at the first anchor "2xbf16" 1.220x out
not transposed, 1.215x transposed: ab_weights_orientation_ad1e78f.txt): not dispatched, 'input'
stays at mamba_ssm's accuracy.

Segments (``segmented``; ``kernels.ssd.walk_segments``, where the H200 figures are): with fewer
(row, head) pairs than SMs the walk leaves SMs idle (64 blocks on the H200's 132 at the third
anchor: 1.83 ms against the scan and compute_out's 1.36). Split, each sequence is walked in
segments of whole steps, a block per (row, segment, head, P block): first the states alone
(``computes_out`` False: no C, scores, z or out) through every segment but the last, from zero;
then kernels/entering_states.py carries those end states across the segments, as the walk
carries its state across chunks; then the walk runs each segment from its entering state. The
states-only walk may take each segment in parts (``kernels.ssd.Plan.segment_split``: more
blocks, shorter walks), whose end states carry the same way. Backward (``backward``; where
``kernels.ssd.walks_states_backward`` takes it) the states-only walk runs a part's chunks last to
first and adds each chunk's increment decayed to the part's end, 2^(later decays + S_last - S_t)
on its weights, to a state it never rescales: its MMAs accumulate as a matmul's K loop does,
none waiting on the decay of the one before. The cost: x and B read once more
for all but the last segment, and the segments' float32 states (a few MB). On sm_90 as
dispatched at one row of 65,536 tokens: 64 heads with final states, the states-only walk in
four parts two to an SM (since 609d542; before, one an SM, 255 registers), 128 registers, no
spill, 43,608 bytes of shared memory, the walk from entering states one an SM, 168 registers, no
spill, 218,656 bytes; 32 heads out alone from initial states, in eight segments, both two to an
SM: the states-only walk 128 registers, no spill, 114,920 bytes, the walk 128 registers, 16 bytes
spilled, 101,040 bytes.
Unsplit (``segmented`` False) it compiles to the machine code it had before the knob.

Varlen states (``varlen``; where ``kernels.ssd.WALK_VARLEN_STATES`` lets the walk take a packed
call that returns each sequence's last state): as it enters a chunk that holds sequence ends
(``varlen_offsets`` lists the ends chunk by chunk), the walk stores its state once for each of
them in ``varlen_states``; then chunk_state, launched over the ends alone
(``kernels.fwd_pass_state.add_sequence_end_increments``), makes each the state after its end,
2^(S_e) h + the increment of the end's chunk up to it, the sum state_passing forms from its
stored states at chunk 256, with the resets read from the cumsum. The walk's state update is
then in the float32-grade mode of returned states. Most chunks hold no end: a chunk costs two
int32 loads more. The ends' stores are ordered among themselves (their loop carries a token),
out's stores are not (tests/test_compile.py). On sm_90 (8 sequences of 16,384 tokens, D per
head) the walk of 128 heads in 8 groups compiles to 168 registers, no spill, 210,424 bytes of
shared memory, one block an SM; the split walk of 80 heads from entering states to the same
with 210,456 bytes; chunk_state over the ends to 255 registers, no spill, 97,480 bytes.
Without ``varlen`` the walks compile to the instructions they had before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.tile as ct
import torch

from kernels.chunk_scores import ChunkScoresConfig, chunk_scores
from kernels.device import launch_stream
from kernels.state_scan import add_state_backward, next_state, step_log2_cumsum
from kernels.tile_ops import (MODE, KernelVariant, array_constraint, exp2_nonpos, index_variants,
                              kernel_signature, latency_hint, load_transposed,
                              log2_decay_between, placeholder, precise_mma, scalar_constraint,
                              silu_gated)

ZERO = ct.PaddingMode.ZERO
# The shared scores' launch with cuTile's occupancy hint 2: on sm_90 the kernel then fits 128
# registers a thread, no spill, where without the hint it takes 255 and one block an SM (ncu on
# the H200: theoretical occupancy 12.5% -> 25%). On the H200 the scores took 0.80x, 0.74x and
# 0.88x the time at the first and third anchors and at dstate 256, bit-equal (the forward
# 0.993x, 0.991x and, with 8 groups' scores, 0.943x). 3 (80 registers at dstate 128, 255 at
# 256) was slower at dstate 256 (experiments/ab_scores_occupancy_3739255.txt).
SCORES_OCCUPANCY = 2
# ScanOutConfig.d_term's values ('D's term' above).
D_TERMS = ("elementwise", "diagonal")


@ct.function
def step_rows(array, batch, step, head, p_block, ROWS: ct.Constant[int],
              P_BLOCK: ct.Constant[int], LATENCY: ct.Constant[int]):
    """One step's (ROWS, P_BLOCK) rows of x or z (b, L, H, P), or of B (b, L, G, N) with head
    the group and P_BLOCK N, zero past the end; LATENCY the load's hint (0: the compiler's)."""
    return ct.load(array, (batch, step, head, p_block), shape=(1, ROWS, 1, P_BLOCK),
                   padding_mode=ZERO, latency=latency_hint(LATENCY)).reshape((ROWS, P_BLOCK))


def scan_out_kernel(x, B, C, scores, dt, log2_decay_cumsum, start_states, D, z, out, final_states,
                    nchunks, nheads, heads_per_group, n_p_blocks, nsegments, segment_steps,
                    varlen_offsets, varlen_states,
                    CHUNK: ct.Constant[int], P_BLOCK: ct.Constant[int], N_PAD: ct.Constant[int],
                    MODE: ct.Constant[int], HAS_START: ct.Constant[bool],
                    HAS_D: ct.Constant[bool], HAS_Z: ct.Constant[bool],
                    SHARED_SCORES: ct.Constant[bool], STEP: ct.Constant[int],
                    STATE_MODE: ct.Constant[int], SEGMENTED: ct.Constant[bool],
                    OUT: ct.Constant[bool], UPDATE_EARLY: ct.Constant[bool],
                    X_LATENCY: ct.Constant[int], B_LATENCY: ct.Constant[int],
                    BACKWARD: ct.Constant[bool], OUT_TRANSPOSED: ct.Constant[bool],
                    D_ON_DIAGONAL: ct.Constant[bool], WEIGHTS_MODE: ct.Constant[int],
                    VARLEN: ct.Constant[bool]):
    # Heads vary fastest: blocks running together read the same C, B and scores tiles.
    pid = ct.bid(0)
    head = pid % nheads
    rest = pid // nheads
    p_block = rest % n_p_blocks
    batch = rest // n_p_blocks
    # SEGMENTED: a block walks the segment_steps steps of one of nsegments segments of the
    # sequence, and start_states and final_states have a row per (batch row, segment).
    state_row = batch
    first_step = 0
    nsteps = (nchunks + STEP - 1) // STEP
    if SEGMENTED:
        segment = batch % nsegments
        batch = batch // nsegments
        first_step = segment * segment_steps
        # A segment past the sequence's end walks no step (a load wholly past the end is
        # undefined) and stores its entering state.
        nsteps = ct.minimum(segment_steps, nsteps - first_step)
    group = head // heads_per_group
    h = ct.zeros((P_BLOCK, N_PAD), dtype=ct.float32)
    if HAS_START:
        h = ct.load(start_states, (state_row, head, p_block, 0), shape=(1, 1, P_BLOCK, N_PAD),
                    padding_mode=ZERO).reshape((P_BLOCK, N_PAD)).astype(ct.float32)
    if HAS_D and D_ON_DIAGONAL:
        d_head = ct.load(D, (head, 0), shape=(1, 1), padding_mode=ZERO)
    elif HAS_D:
        d = ct.load(D, (head, p_block), shape=(1, P_BLOCK), padding_mode=ZERO)
    position = ct.arange(CHUNK, dtype=ct.int32)
    sees = position[None, :] <= position[:, None]
    sees_transposed = position[:, None] <= position[None, :]
    diagonal = position[:, None] == position[None, :]
    # The state update's x columns: the out's x tile transposed where the walk computes out
    # unsplit up to dstate 128 (8 KB less shared memory a block; on the H200 0.91-0.97x the time
    # of a second, transposed load at six shapes, out bit-equal), else a load of their own: the
    # transpose took the segmented walks 1.02x, dstate 256 out alone 1.00x, and spills 680 bytes
    # at dstate 256 with final states on sm_90, where the load spills none
    # (experiments/ab_walk_x_once_6c67a8c.txt).
    X_COLS_LOADED = not OUT or SEGMENTED or N_PAD > 128
    B_LAST = OUT and not UPDATE_EARLY and not HAS_Z
    # BACKWARD (states alone): the steps last to first, each chunk's increment decayed to the
    # walk's end (``add_state_backward``), the decay of the chunks after it summed as it goes.
    later_hi = ct.zeros((1,), dtype=ct.float32)
    later_lo = ct.zeros((1,), dtype=ct.float32)
    # STEP chunks a step, as kernels/state_scan.py walks: each operand of STEP chunks in one load
    # (their latency paid once), then the chunks in order. Chunks past the last are zero-padded
    # (dt 0 and a flat cumsum leave h as it is) and store nothing. Without OUT only the state
    # walks: its operands alone are read.
    for walked in range(first_step, first_step + nsteps):
        step = walked
        if BACKWARD:
            step = 2 * first_step + nsteps - 1 - walked
        if OUT:
            C_all = ct.load(C, (batch, step, group, 0), shape=(1, STEP * CHUNK, 1, N_PAD),
                            padding_mode=ZERO).reshape((STEP * CHUNK, N_PAD))
        # B's load goes last where the state update does, without z (B_LAST: 'Step order').
        if not B_LAST:
            B_all = step_rows(B, batch, step, group, 0, STEP * CHUNK, N_PAD, B_LATENCY)
        if OUT and not UPDATE_EARLY:
            x_all = step_rows(x, batch, step, head, p_block, STEP * CHUNK, P_BLOCK, X_LATENCY)
        if X_COLS_LOADED:
            x_cols_all = load_transposed(x, batch, step, head, p_block, STEP * CHUNK, P_BLOCK,
                                         True, 0)
        dt_all = ct.load(dt, (batch, head, step, 0), shape=(1, 1, STEP, CHUNK),
                         padding_mode=ZERO).reshape((STEP, CHUNK))
        cumsum_all = ct.load(log2_decay_cumsum, (batch, head, step, 0, 0),
                             shape=(1, 1, STEP, 2, CHUNK), padding_mode=ZERO)
        if HAS_Z and OUT:
            z_all = step_rows(z, batch, step, head, p_block, STEP * CHUNK, P_BLOCK, 0)
        if SHARED_SCORES and OUT:
            s_all = ct.load(scores, (batch, step, group, 0, 0),
                            shape=(1, STEP, 1, CHUNK, CHUNK), padding_mode=ZERO)
        if B_LAST:
            B_all = step_rows(B, batch, step, group, 0, STEP * CHUNK, N_PAD, B_LATENCY)
        # UPDATE_EARLY: x's load last. On sm_90 the compiler's producer warp issues a step's loads
        # in this order, each behind the release of its buffer by the step before; x's is
        # released last (the chunk's own term), so the loads ahead of it go early.
        if OUT and UPDATE_EARLY:
            x_all = step_rows(x, batch, step, head, p_block, STEP * CHUNK, P_BLOCK, X_LATENCY)
        for k_walked in ct.static_iter(range(STEP)):
            k = k_walked
            if BACKWARD:
                k = STEP - 1 - k_walked
            # One chunk a step: no chunk passes the last, so out's store needs no guard (its
            # branch cost one block an SM 14% at the second anchor, 7% in fp16: 'mid' in
            # experiments/ab_walk_store_order_ce6a7f8.txt), and the chunk is the loop's own
            # index, the form in which cuTile's token pass (cuda/tile/_passes/token_order.py,
            # loop-parallel stores) lets the stores go without waiting on each other (not in the
            # int64 variant, whose index is the loop's converted; tests/test_compile.py checks).
            if STEP == 1:
                chunk = step
            else:
                chunk = step * STEP + k
            if VARLEN:
                # The state entering the chunk, once for each sequence that ends in it
                # (varlen_offsets[c] to [c + 1] of the ends in order; none past the last chunk):
                # chunk_state adds the ends' own increments ('Varlen states' above).
                first_end = ct.load(varlen_offsets, (ct.minimum(chunk, nchunks),), shape=())
                stop_end = ct.load(varlen_offsets, (ct.minimum(chunk + 1, nchunks),), shape=())
                for end in range(first_end, stop_end):
                    ct.store(varlen_states, (end, head, p_block, 0),
                             h.reshape((1, 1, P_BLOCK, N_PAD)))
            if OUT:
                C_c = ct.extract(C_all, (k, 0), shape=(CHUNK, N_PAD))
            B_c = ct.extract(B_all, (k, 0), shape=(CHUNK, N_PAD))
            if OUT:
                x_c = ct.extract(x_all, (k, 0), shape=(CHUNK, P_BLOCK))
            if X_COLS_LOADED:
                x_cols = ct.extract(x_cols_all, (0, k), shape=(P_BLOCK, CHUNK))
            else:
                x_cols = x_c.transpose()
            dt_c = ct.extract(dt_all, (k, 0), shape=(1, CHUNK)).reshape((CHUNK,))
            hi, lo = step_log2_cumsum(cumsum_all, k, CHUNK)
            if OUT:
                if SHARED_SCORES:
                    s = ct.extract(s_all, (0, k, 0, 0, 0),
                                   shape=(1, 1, 1, CHUNK, CHUNK)).reshape((CHUNK, CHUNK))
                else:
                    s = precise_mma(C_c, B_c.transpose(),
                                    ct.zeros((CHUNK, CHUNK), dtype=ct.float32), MODE, x.dtype)

                # The chunk's output: the entering state's term, then the chunk's own positions.
                # OUT_TRANSPOSED: out^T (P_BLOCK, CHUNK), the state the first MMA's operand in
                # registers ('Orientation' above), turned back before D, z and the store.
                if OUT_TRANSPOSED:
                    y = precise_mma(h, C_c.transpose(),
                                    ct.zeros((P_BLOCK, CHUNK), dtype=ct.float32), MODE,
                                    x.dtype) * exp2_nonpos(hi + lo)[None, :]
                else:
                    y = precise_mma(C_c, h.transpose(),
                                    ct.zeros((CHUNK, P_BLOCK), dtype=ct.float32), MODE,
                                    x.dtype) * exp2_nonpos(hi + lo)[:, None]
                # UPDATE_EARLY: the state update right after its last read of h, which releases
                # B (and with it the next step's loads that wait on B) mid-step, not at its end.
                if UPDATE_EARLY:
                    h = next_state(h, x_cols, B_c, dt_c, hi, lo, x, B, STATE_MODE, P_BLOCK,
                                   N_PAD, CHUNK)
                if OUT_TRANSPOSED:
                    exponent = log2_decay_between(hi[None, :], lo[None, :], hi[:, None],
                                                  lo[:, None])
                    weights = s.transpose() * (ct.where(sees_transposed, exp2_nonpos(exponent),
                                                        0.0) * dt_c[:, None])
                    if HAS_D and D_ON_DIAGONAL:
                        weights = weights + ct.where(diagonal, d_head, 0.0)
                    y = precise_mma(x_cols, weights, y, WEIGHTS_MODE, x.dtype).transpose()
                else:
                    exponent = log2_decay_between(hi[:, None], lo[:, None], hi[None, :],
                                                  lo[None, :])
                    weights = s * (ct.where(sees, exp2_nonpos(exponent), 0.0) * dt_c[None, :])
                    if HAS_D and D_ON_DIAGONAL:
                        weights = weights + ct.where(diagonal, d_head, 0.0)
                    y = precise_mma(weights, x_c, y, WEIGHTS_MODE, x.dtype)
                if HAS_D and not D_ON_DIAGONAL:
                    y = y + d * x_c.astype(ct.float32)
                if HAS_Z:
                    y = silu_gated(y, ct.extract(z_all, (k, 0), shape=(CHUNK, P_BLOCK)).astype(
                        ct.float32), out)
            if BACKWARD:
                h, later_hi, later_lo = add_state_backward(
                    h, later_hi, later_lo, x_cols, B_c, dt_c, hi, lo, x, B, STATE_MODE, P_BLOCK,
                    N_PAD, CHUNK)
            elif not (OUT and UPDATE_EARLY):
                h = next_state(h, x_cols, B_c, dt_c, hi, lo, x, B, STATE_MODE, P_BLOCK, N_PAD,
                               CHUNK)
            # out is stored after the state update, not before it: the same operations and
            # results, on the H200 0.857-0.952x the time at 7 of 9 shapes (the first anchor
            # 0.406 -> 0.371 ms), 0.997x at the third, 1.094x at float32 dstate 32 paired
            # (experiments/ab_walk_store_order_ce6a7f8.txt). A copy with no load in the loop
            # took 0.139 ms at the first anchor, its loads and stores alone 0.284: the walk waits
            # on its step loads (experiments/walk_probe_9679d8d.txt).
            if OUT:
                if STEP == 1 or chunk < nchunks:
                    ct.store(out, (batch, chunk, head, p_block),
                             y.reshape((1, CHUNK, 1, P_BLOCK)).astype(out.dtype))
    ct.store(final_states, (state_row, head, p_block, 0), h.reshape((1, 1, P_BLOCK, N_PAD)))


# x, z, out, B, C and the states can pass 2^31 elements: 64-bit indexing in the wide variant.
KERNELS = index_variants(scan_out_kernel, ("x", "B", "C", "scores", "start_states", "z", "out",
                                           "final_states", "varlen_states"))


@dataclass(frozen=True)
class ScanOutConfig(KernelVariant):
    VARIANTS = KERNELS

    x_dtype: torch.dtype = torch.bfloat16
    b_dtype: torch.dtype = torch.bfloat16
    c_dtype: torch.dtype = torch.bfloat16
    z_dtype: torch.dtype = torch.bfloat16
    start_dtype: torch.dtype = torch.float32
    chunk_size: int = 64
    p_block: int = 64
    n_pad: int = 128
    precision: str = "input"
    state_precision: str = "input"
    has_start: bool = False
    has_d: bool = False
    has_z: bool = False
    shared_scores: bool = True
    wide: bool = False
    occupancy: int | None = None
    worker_warps: int | None = None
    chunks_per_step: int = 1
    # Blocks walk segments of the sequence (``walk_segments``), or, without computes_out, only
    # the state through them (``segment_end_states``).
    segmented: bool = False
    computes_out: bool = True
    # The walk of out updates the state right after the entering state's term and loads x last
    # (``kernels.ssd.walk_updates_early``): the same operations, in another order.
    update_early: bool = False
    # x's load latency hint, 1-10, 0 the compiler's (``kernels.ssd.walk_x_latency``): on sm_90 it
    # changes how the compiler buffers the step loop, not what it computes.
    x_latency: int = 0
    # B's load latency hint, likewise (``kernels.ssd.walk_b_latency``).
    b_latency: int = 0
    # Without computes_out: walk the steps last to first, summing each chunk's increment decayed
    # to the end (``add_state_backward``), where x's dtype holds any decay (not fp16).
    backward: bool = False
    # The walk of out computes each chunk's out transposed (``kernels.ssd.walk_out_transposed``):
    # the same products, the state an MMA operand in registers.
    out_transposed: bool = False
    # How out gets D x ('D's term' above): "elementwise", or D per head added to the weights'
    # diagonal ("diagonal").
    d_term: str = "elementwise"
    # The mode of the MMA of out's in-chunk weights with x ('The weights' MMA' above): "" the
    # walk's (``precision``), else a PRECISIONS name.
    weights_precision: str = ""
    # The walk of out stores the state entering each chunk that holds a sequence's end
    # ('Varlen states' above).
    varlen: bool = False

    def __post_init__(self):
        if self.d_term not in D_TERMS:
            raise ValueError(f"ScanOutConfig.d_term: expected one of {D_TERMS}, got "
                             f"{self.d_term!r}")
        if self.weights_precision and self.weights_precision not in MODE:
            raise ValueError(f"ScanOutConfig.weights_precision: expected '' or one of "
                             f"{tuple(MODE)}, got {self.weights_precision!r}")
        if self.varlen and not self.computes_out:
            raise ValueError("ScanOutConfig.varlen: expected a walk of out (computes_out True), "
                             "got the states-only walk, which stores no entering state")

    @property
    def weights_mode(self) -> int:
        """The mode of the MMA of out's in-chunk weights with x."""
        return MODE[self.weights_precision or self.precision]

    def constants(self) -> tuple:
        return (self.chunk_size, self.p_block, self.n_pad, MODE[self.precision], self.has_start,
                self.has_d, self.has_z, self.shared_scores, self.chunks_per_step,
                MODE[self.state_precision], self.segmented, self.computes_out, self.update_early,
                self.x_latency, self.b_latency, self.backward, self.out_transposed,
                self.d_term != "elementwise", self.weights_mode, self.varlen)

    def scores_config(self) -> ChunkScoresConfig:
        """The shared scores this kernel reads: whole chunks as one tile."""
        return ChunkScoresConfig(x_dtype=self.x_dtype, b_dtype=self.b_dtype,
                                 c_dtype=self.c_dtype, chunk_size=self.chunk_size,
                                 row_block=self.chunk_size, n_pad=self.n_pad,
                                 precision=self.precision, wide=self.wide,
                                 occupancy=SCORES_OCCUPANCY)

    def signature(self):
        f32, i32, w = torch.float32, torch.int32, self.wide
        return kernel_signature([
            array_constraint(self.x_dtype, 4, w), array_constraint(self.b_dtype, 4, w),
            array_constraint(self.c_dtype, 4, w), array_constraint(f32, 5, w),
            array_constraint(f32, 4), array_constraint(f32, 5),
            array_constraint(self.start_dtype, 4, w), array_constraint(f32, 2),
            array_constraint(self.z_dtype, 4, w), array_constraint(self.x_dtype, 4, w),
            array_constraint(f32, 4, w), *(scalar_constraint(i32) for _ in range(6)),
            array_constraint(i32, 1), array_constraint(f32, 4, w), *self.constants()])

    def describe(self) -> str:
        return (f"scan_out x={self.x_dtype} B={self.b_dtype} C={self.c_dtype} z={self.z_dtype} "
                f"Q={self.chunk_size} PB={self.p_block} N={self.n_pad} {self.precision} "
                f"start={self.has_start}:{self.start_dtype} D={self.has_d} z={self.has_z} "
                f"shared_scores={self.shared_scores} int64={self.wide} "
                f"occupancy={self.occupancy} worker_warps={self.worker_warps} "
                f"step={self.chunks_per_step} segmented={self.segmented} "
                f"out={self.computes_out} backward={self.backward} "
                f"transposed={self.out_transposed} d_term={self.d_term} "
                f"weights={self.weights_precision or self.precision} varlen={self.varlen}")


def scan_out(x, B, C, dt, log2_decay_cumsum, start_states, D, z, cfg: ScanOutConfig,
             stream=None, segments: int = 1, segment_steps: int = 0, varlen_offsets=None,
             varlen_states=None):
    """(out, final_states); see the module docstring. D (H, P) fp32 or None; z, start_states
    or None. stream: where to launch (default: the current stream of the inputs' device). With
    ``cfg.segmented``, the blocks walk ``segments`` segments of ``segment_steps`` steps from the
    sequence's start: start_states (b * segments, H, P, N) and final_states likewise, a row per
    (batch row, segment). Without ``cfg.computes_out``, out is None. With ``cfg.varlen`` (batch
    1), varlen_states (nseq, H, P, N) fp32 gets the state entering the chunk of each sequence's
    end, varlen_offsets (nchunks + 1,) int32 holding the ends chunk by chunk
    (``kernels.fwd_pass_state.sequence_end_offsets``)."""
    if (D is not None and cfg.d_term != "elementwise" and D.shape[1] > 1
            and D.stride(1) != 0):
        raise ValueError(f"scan_out: d_term {cfg.d_term!r} puts D per head on the weights' "
                         f"diagonal and needs D (nheads, headdim) of stride 0 along headdim "
                         f"(D per head), got strides {tuple(D.stride())}")
    if cfg.varlen != (varlen_states is not None) or cfg.varlen != (varlen_offsets is not None):
        raise ValueError(f"scan_out: expected varlen_offsets and varlen_states exactly where "
                         f"the config stores varlen states (varlen={cfg.varlen}), got "
                         f"{'none' if varlen_states is None else 'varlen_states'} and "
                         f"{'none' if varlen_offsets is None else 'varlen_offsets'}")
    stream = launch_stream(x, stream)
    b, L, H, P = x.shape
    N = B.shape[3]
    dev, f32 = x.device, torch.float32
    out = (torch.empty(b, L, H, P, device=dev, dtype=x.dtype) if cfg.computes_out
           else placeholder(dev, x.dtype, 4))
    final_states = torch.empty(b * segments, H, P, N, device=dev, dtype=f32)
    npb = -(-P // cfg.p_block)
    scores = (chunk_scores(B, C, x, cfg.scores_config(), stream) if cfg.shared_scores
              else placeholder(dev, f32, 5))
    ct.launch(stream, (b * segments * H * npb,), cfg.kernel,
              (x, B, C, scores, dt, log2_decay_cumsum,
               start_states if start_states is not None else placeholder(dev, f32, 4),
               D if D is not None else placeholder(dev, f32, 2),
               # An absent z's stand-in is not x: an array aliasing x puts the loop's loads in
               # an alias set of two, and then cuTile orders its stores one after another.
               z if z is not None else placeholder(dev, x.dtype, 4), out, final_states,
               -(-L // cfg.chunk_size), H, H // B.shape[2], npb, segments, segment_steps,
               # Without varlen states, stand-ins: those walks compile to the instructions they
               # had before these two (sm_90: only the TMA descriptors' offsets in the parameter
               # space move, by 64 bytes).
               varlen_offsets if cfg.varlen else placeholder(dev, torch.int32, 1),
               varlen_states if cfg.varlen else placeholder(dev, f32, 4),
               *cfg.constants()))
    return (out if cfg.computes_out else None), final_states
