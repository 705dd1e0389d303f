"""``ssd_forward``: Mamba-2's SSD forward pass on the three cuTile kernels, a drop-in for mamba_ssm's
``mamba_chunk_scan_combined`` (same arguments, order, defaults and return convention; the contract
is ``kernels.contract``).

    chunk_cumsum    dt (b, H, nchunks, Q), log2_decay_cumsum               kernels/chunk_cumsum.py
                    (b, H, nchunks, 2, Q) fp32 (hi + lo)
    fwd_pass_state  chunk_states (b, nchunks, H, P, N) state_dtype,        kernels/fwd_pass_state.py
                    final_states (b, H, P, N) fp32, varlen_states fp32     (or in one walk:
                                                                           kernels/state_scan.py)
    compute_out     out (b, L, H, P) in x's dtype                          kernels/compute_out.py
                    (from 8 heads per group, after the scores C.B^T of     kernels/chunk_scores.py
                    each chunk, once per group)

At chunk 64, for bf16 and fp16 calls of many (row, head) pairs that return out alone or with
final states, the last two stages run as one kernel that stores no chunk state (kernels/scan_out.py;
``walk_state_precision``; with varlen states too, chunk_state then over the sequences' ends, where
WALK_VARLEN_STATES lets it: off until a GPU has run it).

Precision (``precision=``; kernels/tile_ops.py says what each mode computes). Errors below are
normwise relative vs float64, measured on the H200 (kernels/gpu_report.py):
  - float32 x: "3xbf16" by default: both float32 operands of every matmul cut in three bf16
    terms, the 6 products above ~2^-27 relative on bf16 tensor cores, each product summed in a
    fresh accumulator (kernels/tile_ops.py): float32-grade. On the H200 (a5536ec) the 80 cases of
    the full grid (the >2^31-element one unfinished) passed the float32 rule with it, and
    ``envelope --check`` passed on the 19 float32 cells against the "ieee" baseline (c091e22):
    worst output 0.335 of the rule, as "ieee"'s, per-cell output errors 0.71x-1.03x of its.
    At (8, 4096, 64 heads) it took 5.2-5.4 ms against "ieee"'s 122 ms
    (reports/h200/experiments/fp32_modes_*.txt); mamba_ssm took 1.9 ms in an earlier run (c091e22),
    at 1.5e-3 normwise against float64 where ours is ~2e-7. "3xtf32" (three TF32 MMAs, each float32
    operand cut into two TF32 terms: ~2^-22 a product) has been about as accurate on the grid
    since its products moved to fresh accumulators (0.28 of the rule at the case where chained
    sums put it at 2.12) and about as fast (5.3-5.6 ms), but it is not float32-grade where an
    output is one product: at the pinned case length-one its out was 1.064x the float32 rule on
    the H200 (ee0a959; a strict xfail in tests/test_properties.py, and the CPU model's figure,
    tests/test_precision_model.py, where 3xbf16 sits at 0.25). "tf32" is the fast opt-in:
    3.3 ms, ~2e-4..3e-4 (operands rounded to 10-bit mantissas; mamba_ssm's 1.2e-3 on float32
    inputs is the same kind). "ieee" (every product in float32 on the FMA units, the float32
    chunked reference's accuracy) is an opt-in.
  - bf16 x: "input" by default: raw 16-bit products (C.B^T) run in the input dtype, exact; the
    computed operands of the output's matmuls (decay-weighted scores, the entering states) are
    rounded to bf16, as mamba_ssm does, while chunk and final states stay float32-grade (below).
    It was "tf32" (those operands rounded to 2^-11, 8x below bf16's own rounding) until the H200
    tuner measured compute_out at 0.77 ms in "input" against 1.27 ms in "tf32" at the best tiles
    of each (8, 4096, 64 heads; reports/h200/experiments/tune_322c7d5.json.gz); a CPU model of the
    rounding puts "input" at 0.11-0.28 of the accuracy rule over the envelope's bf16 cells
    (tests/test_precision_model.py). The H200 envelope (a83356f) measured both in one run: over
    the bf16 cells the worst output error rose from 1.71e-3 to 2.38e-3 normwise (0.216 to 0.283
    of the rule; 1.44x the error of rounding the exact output to bf16, mamba_ssm's level).
    "tf32" stays an opt-in; "2xbf16" cuts those operands into two bf16 terms (~2^-18 relative),
    with the chunk-state matmul in three ("3xbf16"): 1.17 and 1.35 ms in the same run at chunk
    256; since bc870b4 such calls walk at chunk 64 (0.59 ms on the H100, out at bf16's own
    rounding of the exact out; WALK_MODES), since 3e32b85 two blocks an SM where that pays (0.51
    ms; WALK_PAIRING).
  - fp16 x: "2xfp16" by default since 2eef42b (below; it was "3xtf32"). TF32 keeps fp16's own 11
    bits, so rounding the computed operands to it costs an fp16 rounding of every *term* of an
    output, and terms can be far larger than the output they cancel to: on the H200 envelope's
    large-magnitude fp16 cells (terms ~1e7, outputs near 65504) "tf32" gave Inf at 31 and 3
    positions whose exact value is finite. A CPU emulation of compute_out's operand rounding
    reproduces exactly those counts, fails the accuracy rule by 13.7-16.5x at the finite positions,
    and gives 0 Infs and 0.13 of the rule with the split (the model:
    tests/test_precision_model.py). Re-measured on the H200 with the split
    (reports/h200/envelope.md, 4b1e5b9): no Inf, fp16 outputs within 0.25 of the rule. At the first
    anchor in fp16 it ran at 0.32x mamba_ssm's speed (untuned; bench, c091e22). "3xbf16" takes fp16
    x too (widened, cut in bf16 terms): the H200 grid's fp16 cases passed with it as their default
    (21b71eb) and the tuner took the first anchor's states and compute_out to 3.43 ms with it
    (experiments/tune_21b71eb_fp16_3xbf16.json); timed beside "3xtf32" in one search
    (experiments/tune_b3ee563_fp16.json.gz) it was slower, compute_out 2.17 against 2.06 ms and the
    states stage 1.05 against 0.79 at the best tiles, so it stays an opt-in. "2xfp16" and "3xfp16"
    (fp16 x only; kernels/tile_ops.py) cut the computed operands, scaled by a power of two per row
    (or column) of the product, into 2 or 3 fp16 terms against the raw fp16 ones: fp16 tensor cores
    with 16-bit operands in shared memory, where the TF32 terms of "3xtf32" are 32-bit; their
    chunk-state matmul runs in 3 such terms. In that search compute_out took 2.06 ms in "3xtf32",
    0.72 in "input" and 1.41 in "tf32" (one MMA): the MMA count and the operand bytes are the cost.
    The CPU model puts both at "3xtf32"'s accuracy on the envelope's fp16 cells
    (tests/test_precision_model.py). On the H200 (e86b2f1, at "3xtf32"'s best tiles,
    experiments/tune_e86b2f1_fp16_3xtf32.json.gz) compute_out took 1.28 ms in "2xfp16" against
    2.06 in "3xtf32" and the states stage 0.47 against 0.79 in three fp16 terms; the quick grid's
    two fp16-split cases were within the rule. So "2xfp16" became the default: searched in it the
    fp16 key took 1.75 ms against 2.85 in "3xtf32" (experiments/tune_2eef42b_fp16.json.gz), and the
    envelope's 20 fp16 cells passed --check against the "3xtf32" baseline, no Inf, outputs within
    0.241 of the rule (0.25 before; experiments/envelope_fp16_2xfp16_2eef42b/). "3xtf32" and
    "3xfp16" are opt-ins.
  In every 16-bit mode the chunk-state matmul (whose result, final_states, is float32) splits its
  float32 operand in three terms against the exact 16-bit one: float32-grade states at 3 MMAs of
  a small matmul; in 'input' with bf16 x, a call that returns no states runs it in 'input', one
  MMA. The terms are bf16 in the bf16 split modes and for bf16 x in 'input', TF32 otherwise
  (``state_precision``).
State dtype (``state_dtype=``): chunk_states are stored in x's 16-bit dtype in the 'input' mode
(the default for bf16 x), where compute_out rounds every entering state to that dtype before its
matmul anyway: outputs are bit-identical to float32 storage (H200, 6106f85: the three anchor
shapes at chunk 64, 128 and 256, reports/h200/experiments/chunks_probe_6106f85.txt; the
envelope's bf16 cells' out and final_states metrics unchanged to the last digit, 79bdf52) and
the states' traffic, the largest after x and out, halves. With the tables retuned for it the
anchors ran 0.98x / 1.14x / 1.04x mamba_ssm's time against 0.95x / 1.01x / 1.02x with float32
storage (benches at 79bdf52 and 2051bb9, reports/h200/experiments/bench_anchors_*): the state
stage gained at all three, compute_out at the second (0.39 -> 0.33 ms) but not at the first.
Only the stage ``ssd_forward_stages`` hands back changes: chunk_states there are bf16-grade
(~2^-9 relative) in 'input'; final_states and varlen_states stay float32, summed from the
float32 states. In every other mode they are stored in float32, the better envelope; bf16
storage asked for there rounds every entering state to 2^-8: chunk_states' error grows from
~2e-7 to ~1.7e-3 normwise, bf16 outputs' by ~20% (2.05e-3 vs ~1.7e-3 in 'tf32'), and float32
outputs would lose float32 grade entirely.

Tiles and occupancy hints: from kernels/tuned.json where a call matches one of its keys (padded
headdim and dstate, chunk size, x dtype, precision mode, shared scores), else the heuristics in
``make_plan``. The table is written by ``python3 -m kernels.tune`` from H200 measurements (bf16,
headdim 64, dstate 128, chunk 256): the state passing's tiles from reports/h200/tune.json
(occupancy 2 for the matmul kernels was its largest single gain), compute_out's from
reports/h200/experiments/tune_322c7d5.json.gz, which searched its layout knobs in TF32 and probed
every bf16 mode at the four fastest (each probed mode has its own entries), then for the default
'input' from experiments/tune_21b71eb_input.json.gz (searched in 'input' at the first two anchors;
the second anchor's compute_out went from 0.43 to 0.39 ms in the bench), chunk_state's from
reports/h200/experiments/tune_21181f8_gpu{0,1}.json.gz (its layout knobs, with the 3-term bf16
split), then with its load latency hint and bf16 chunk states from experiments/
tune_5b56790_chunk_state.json.gz, and the first anchor's compute_out again, reading bf16 states,
from experiments/tune_79bdf52_compute_out.json.gz (``--table-from`` merges the runs, each stage
from the latest run that searched it; that run's probes of 'tf32', '2xbf16' and '3xbf16' read
'input''s bf16 states, so those modes' compute_out tiles at the shared-scores key are
provisional: the tuner now stores each probed mode's own). Two variant keys in 'input' (and
their probed modes) come from searches at (8, 4096, 64 heads): headdim 128 (chunk_state from
experiments/tune_1008d4f_headdim128.json.gz, compute_out from
tune_96d9c8b_headdim128_compute_out.json.gz; the bench went from 4.14 to 2.14 ms, 0.41x ->
0.80x mamba_ssm) and dstate 64
(tune_96d9c8b_dstate64_{chunk_state,compute_out}.json.gz; 0.82x mamba_ssm in the bench,
experiments/bench_variants_96d9c8b). Other keys are untuned. A user tunes their own
shapes with ``python3 -m kernels.tune --shape B,L,H,P,N,G[,dtype] --out DIR --cache``: the winners
go to a per-user cache (``tuning_cache_path()``, kept per GPU model), which takes precedence over
the table on that GPU model. Nothing is searched at call time.

Chunk size: 256 where the fused state scan does not apply (64 where it does:
``STATE_SCAN_CHUNK_SIZE``): on the H200 the anchor shapes ran 3-8% faster than at 128 and 15-30%
faster than at 64 (bf16, TF32 mode, same TF32 chunk-state configuration; gpu_report --sweep);
in 'input' with bf16 states, the tuned states stage at the first anchor takes 0.73 ms at chunk
128 against 0.43 at 256, compute_out 0.57 against 0.63 (experiments/tune_6106f85_q128.json).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernels.chunk_cumsum import (ChunkCumsumConfig, chunk_cumsum, head_block_for,
                                  needs_flat_grid)
from kernels.chunk_scores import ChunkScoresConfig
from kernels.compute_out import ComputeOutConfig, OutInputs, compute_out
from kernels.contract import SSDInputError, SSDProblem, pack_outputs, validate
from kernels.device import compute_capability, launch_stream, require_gpu, sm_count
from kernels.fwd_pass_state import (ChunkStateConfig, StateInputs, StatePassingConfig,
                                    add_sequence_end_increments, fwd_pass_state,
                                    sequence_end_offsets, sequence_ends)
from kernels.entering_states import (ENTERING_P_BLOCK, EnteringStatesConfig,
                                     segment_entering_states)
from kernels.scan_out import ScanOutConfig, scan_out
from kernels.state_scan import StateScanConfig, state_scan
from kernels.tile_ops import INT32_LIMIT, PRECISIONS, needs_int64, next_pow2
from oracles.common import SSDResult

SUPPORTED_CHUNK_SIZES = (64, 128, 256)
DEFAULT_CHUNK_SIZE = 256
# chunk_size=None picks STATE_SCAN_CHUNK_SIZE where the fused state scan applies
# (``fuses_state_scan``, ``default_chunk_size``), else DEFAULT_CHUNK_SIZE. The scan walks the
# chunks of a (row, head) in one block, so it needs at least STATE_SCAN_MIN_ROW_HEADS of them in
# flight. On the H200 (kernels/state_scan.py has the figures) 64 to 512 pairs ran faster fused
# at chunk 128 than chunk 256's two kernels (64 pairs walking 512 chunks each too: 1.37 against
# 1.54 ms a forward); 32 pairs lost (0.96 against 0.86 ms). Chunk 64 is faster again where its
# steps take two chunks (STATE_SCAN_STEP_POSITIONS): compute_out's causal blocks halve, and the
# scan's loads are issued for two chunks at once, so its walk takes about as long as chunk 128's
# (0.261 against 0.284 ms at the first anchor, 0.739 against 0.717 at the third;
# experiments/ab_scan_chunk_steps_4e052d9.txt). Explicit chunk_size=128 calls fuse too (one
# chunk a step).
STATE_SCAN_CHUNK_SIZE = 64
STATE_SCAN_CHUNK_SIZES = (64, 128)
STATE_SCAN_STEP_POSITIONS = 128
STATE_SCAN_MIN_ROW_HEADS = 64
# The scan's tiles start from the table's (else STATE_SCAN_TILES) and halve their state columns,
# down to 64, while fewer than STATE_SCAN_MIN_BLOCKS blocks would walk (``state_scan_tiles``):
# larger tiles read x and B fewer times, and one block per SM (132 on the H200) is what 64 pairs
# need. Measured there at 64 pairs: 64 x 64 tiles (128 blocks) 0.62 ms, 64 x 128 (64 blocks)
# 1.06, the 256-block tilings 1.11-1.29; at 128 pairs 64 x 128 and 64 x 64 within 1%; at 512
# pairs 64 x 128 0.315 against 0.340 (experiments/ab_fused_64pairs_e85c35f.txt,
# ab_state_scan_436fba5.txt). Halved only where the blocks still fit one round (one block an
# SM): on the H100 at one row of 68 to 88 heads over 2,048 and 8,192 tokens the halved tiles'
# 136-176 blocks took the forward 1.11-1.30x chunk 256's time, 64 x 128 tiles 0.93-1.05x; at 64
# and 66 heads (128 and 132 blocks halved) 0.91-0.97x (reports/h100/experiments/
# packed_fused_9adcafb.txt, run 2).
STATE_SCAN_TILES = (64, 128)
STATE_SCAN_MIN_BLOCKS = 128
# From compute capability 10.0 the scan with a 32-bit B at chunk 128 takes at most 64 state
# columns a block: tileiras 13.4 buffers that B tile deeper for sm_100 than for sm_90, and the
# 64 x 128 tiles of a call past 2^31 elements (its 64-bit indexing) took 232,652 bytes of shared
# memory a block there (169,024 on sm_90), past the 232,448 a block may use, so the call would
# fail at launch; 64 x 64 take 201,972 (200,084 at 64 x 128 with 32-bit indexing, 2 KB short of
# the limit). Found compiling the plans tests/test_plans.py draws; never run on an sm_100 GPU.
STATE_SCAN_SM100_FLOAT32_B_N_BLOCK = 64
# The scan and compute_out as one walk (kernels/scan_out.py, ``walk_state_precision``): no chunk
# state stored, but one block per (row, head, P block) walks every chunk in order, with the whole
# state (dstate up to WALK_MAX_DSTATE of its mode) in registers. Measured on the H200 against
# the fused scan then compute_out, both at chunk 64, one block per SM: 0.84-0.89x from 128 to
# 1024 (row, head) pairs at H64 (first anchor 0.568 -> 0.500 ms), a tie at the second anchor's 128 pairs
# (H32, G8: own scores), 1.35x slower at the third's 64 pairs (64 blocks for 132 SMs). Its
# scores are its own at dstate 64, where it was 0.366 ms against 0.422 reading the shared ones
# (default 0.503). Two chunks a step with 8 worker warps (0.523 ms at the first anchor),
# 32-channel blocks (0.97) and own scores at dstate 128 (0.62) lost
# (experiments/ab_scan_out_1a72178.txt, ab_scan_out_shapes_1a72178.txt); own scores above
# dstate 64 lost again at 6a2f034, 1.008-1.228x at six shapes (the first anchor 1.182x;
# experiments/ab_own_scores_6a2f034.txt).
SCAN_OUT_MIN_ROW_HEADS = 128
SCAN_OUT_OWN_SCORES_MAX_DSTATE = 64
# Above dstate 64 the walk of out reads the shared scores, unless few of its blocks read each
# group's tile (``walk_shares_scores``): heads per group times P blocks up to
# WALK_OWN_SCORES_MAX_READERS, out alone at dstate 128, unsplit, two blocks an SM, or one
# without D and z. There the scores kernel's (b, L, G, Q) tiles cost more than one more MMA a
# step. On the H200 at 662371b, outs equal bit for bit (experiments/
# ab_walk_own_scores_662371b.txt), 8 readers: two blocks an SM in bf16 0.957-0.989x the time
# at five shapes (8 x 4096 x 64 heads in 8 groups 0.969x), with D per head 0.933x, per channel
# 0.966x, z 0.946x, both 0.930x (``walk_out_transposed`` as changed with them); one block an
# SM 0.880-0.891x at two shapes, fp16 0.860x and 0.884x. Lost: one block an SM with D (1.145x,
# 1.275x) or z (1.230x), split in segments (1.116x, 1.142x), dstate 256 (1.130x), 16 readers
# (8 groups at headdim 128 1.027x, 4 groups 1.026x), 32 (1.052x), 64 (the first anchor,
# 1.061-1.069x). As dispatched at 02d4d8c, 0.862-0.971x the old dispatch's time at the 13
# calls it changed there (same record).
WALK_OWN_SCORES_MAX_READERS = 8
# dstate 256 walks in 'input' (bf16) only, one block an SM. On the H200 against the fused scan
# and compute_out out alone 0.465-0.909x at ten shapes (0.621x at 8 x 4096 x 64 heads, 0.85x at
# one row of 65,536 tokens split in two segments), with final states 0.528-0.581x chunk 256
# (experiments/ab_walk_dstate256_1b268f7.txt). On sm_90 its block takes 168 registers, no
# spill, and 159,264 bytes of shared memory out alone (151,048 with final states, '3xbf16'),
# whatever the occupancy hint, so two never share an SM; tileiras 13.4 fails to compile the
# hint 2 for sm_100 (none: 168 registers, 8-32 bytes spilled) and spills on sm_80 (264 / 984
# bytes). fp16's '2xfp16' walk at dstate 256 spills 472 bytes on sm_90 with the compiler's 4
# worker warps (227,304 bytes of shared memory); with 8 (WALK_WORKER_WARPS) 168 registers, no
# spill, 216,168 bytes out alone, 224,360 with final states ('3xfp16'). On the H200 it took
# 0.491-0.511x the time of chunk 256, which those calls ran before, at three shapes, out alone
# and with final states (experiments/ab_fp16_walk_n256_db095c0.txt); 8 worker warps at dstate
# 128 lost (1.34-1.35x the compiler's 4), so only dstate 256 takes them. float32 x walks up to
# dstate 64 ('3xbf16', WALK_MODES has the figures); '2xbf16' up to 256 as 'input'.
WALK_MAX_DSTATE = {"input": 256, "2xbf16": 256, "2xfp16": 256, "3xbf16": 64}
# tileiras 13.4 fails to compile float32's walk at dstate 64 for sm_100 ("failed to compile Tile
# IR program" within seconds, with 4 or 8 worker warps, its own or the shared scores, 64- or
# 32-channel blocks; dstate 32 and 128 compile there, as do the bf16 and fp16 walks at 64), so
# from compute capability 10.0 on a mode walks up to these (``walk_max_dstate``).
WALK_MAX_DSTATE_FROM_SM100 = {"3xbf16": 32}
# (worker warps, the least padded dstate that takes them) of the walk by mode; elsewhere the
# compiler's 4 (``walk_worker_warps``). bf16's walk at dstate 64 took 1.25x its time with 8.
WALK_WORKER_WARPS = {"2xfp16": (8, 256), "3xbf16": (8, 64)}
# The walk's state update by (the chunk states' mode, padded dstate) where it runs in another,
# one block an SM (``walk_state_precision``): fp16's out alone at dstate 64 in three scaled fp16
# terms, as with final states, though two suffice there (on sm_90 two spill 400 bytes, three
# 8). On the H200 at 3d22b7b that took 0.853-0.884x the walk's time at six shapes (8 x 4096 x
# 64 heads 1.134 -> 0.974 ms, 8 x 8192 x 64, 2 x 8192 x 64, 4 x 8192 x 32 heads in 8 groups,
# headdim 128), out 2.5-3.0e-6 from two terms' and as far from float64 (2.07e-4 normwise,
# equal to 1e-11); it lost at dstate 32 (1.027x), 16 (1.351x), 128 (1.04-1.05x; on sm_90 56
# bytes spilled) and 256 (1.058x with 8 worker warps) (experiments/ab_fp16_walk_state_3d22b7b.txt,
# ab_fp16_walk_state_ed99326.txt). Paired (WALK_PAIRING) two terms won: 0.627-0.633x one block
# an SM against three's 0.656-0.658x (experiments/ab_walk_pairing_50fd6c2.txt).
WALK_STATE_UPDATE_MODES = {("2xfp16", 64): "3xfp16"}
# Alone, a walk block takes 212,520 bytes of shared memory on sm_90 (the first anchor), so one
# runs per SM; compiled with occupancy=2 it takes 93,600 bytes and 128 registers, no spill, and
# two share an SM, which then finishes both in SCAN_OUT_PAIRED_COST times one block's time
# alone (2 x 0.419 / 0.498 at the first anchor). So it measured on the H200 (132 SMs): at the
# first anchor's 512 blocks 0.419 ms paired against 0.498 alone (2 rounds against 4; 0.74x the
# default forward against 0.88x), at 1024 (headdim 128) 0.66x against 0.84x, at 256 and 192
# (one paired round against two) 0.74x and 0.80x against 0.87x and 0.98x; alone stayed faster
# at 384 blocks (3 rounds against 2 paired: 0.88x against 0.94x) and at 128, where pairing only
# costs (1.03-1.12x slower). So the walk pairs its blocks where fewer rounds at that cost win
# (``scan_out_occupancy``). Paired, it also wins with both z and D (0.71x at 256 and 512
# blocks), where alone it lost 1-5% (0.98x at 2 x 4096 x 64 heads), so only a paired walk
# takes both (experiments/ab_scan_out_zd_a7cf504.txt, ab_scan_out_occupancy_2d1c4d7.txt,
# ab_scan_out_occupancy_256_2d1c4d7.txt).
SCAN_OUT_PAIRED_COST = 1.68
# By mode, the most padded dstate at which the walk's blocks may run two to an SM, and a paired
# round's cost in one block's time alone (``walk_occupancy``); elsewhere one block an SM. On
# the H200 at 50fd6c2 against one block an SM (experiments/ab_walk_pairing_50fd6c2.txt): fp16
# ('2xfp16') at dstate 64 0.628x at 512 blocks (8 x 4096 x 64 heads 0.965 -> 0.606 ms), 0.658x
# at 256, 0.816x at 384 (cost 1.22-1.32 a paired round), 0.634x at headdim 128, 0.655x with
# final states, 0.596x at dstate 32, 0.774x at 16; with both z and D, which only a paired walk
# takes, 0.30-0.32x the chunk 256 such calls took; lost at dstate 128 (1.11-1.16x) and at 128
# blocks (1.085-1.095x, one round either way). float32 ('3xbf16') at dstate 32 0.819x at 512
# blocks, 0.823x at 256 (cost 1.64-1.65), 0.821x with final states, at 16 0.893x, both z and D
# 0.343x chunk 256's; lost at 384 blocks (1.071x: cost 1.61) and did nothing at dstate 64
# (1.002x, 8 worker warps).
# Outs bit-equal paired and alone. On sm_90 with the hint 2 fp16's dstate-64 walk takes 128
# registers, 8 bytes spilled, 70,248 bytes of shared memory; float32's dstate-32 walk 128
# registers, no spill, 113,272 bytes; fp16's dstate-128 walk 253 registers, 95,024 bytes.
# bf16's opt-in '2xbf16' up to dstate 128, on the H100 against one block an SM (ab_p2_p2o2*
# _02fdbf4.json, ab_p2_pp_*_74e38a2.json under reports/h100/experiments/): at dstate 128 0.871x
# at 512 and 1,024 blocks, 0.874x at 192, 0.825x from initial states, 0.827x with final states
# too, 1.127x at 384 (cost ~1.72 a paired round); at 64 0.779x and at 32 0.660x (512 blocks);
# with both z and D, which only a paired walk takes, 0.417x and 0.406x chunk 256's '2xbf16' (D
# per head and per channel). Outs' errors equal paired and alone (1.66e-3 normwise). On sm_90
# its block takes 128 registers, no spill, 109,976 bytes at dstate 128 (109,224 with z and D;
# 16 bytes spilled from initial states with final states), 128 at 64 (255 alone).
WALK_PAIRING = {"input": (128, SCAN_OUT_PAIRED_COST), "2xfp16": (64, 1.32), "3xbf16": (32, 1.64),
                "2xbf16": (128, 1.72)}
# The most padded dstate at which the split walk (``walk_segments``) pairs its blocks, by bf16
# mode (``_pairs_up_to``); elsewhere it runs one block an SM. '2xbf16' does not pair split: on
# the H100 at 74e38a2 its segments doubled to run paired took 1.10-1.14x the time of as many
# alone (8 to 32 pairs over 32,768 and 65,536 tokens, with final states too) and 1.63x from two
# to four paired with D per head at the third anchor's size; the third anchor's states-only walk
# in four paired parts 0.967x its two alone (reports/h100/experiments/ab_p2_pp_walk_74e38a2.json).
# Where 'input' doubles two segments to pair and then, returning final states, walks four alone
# (``walks_four_segments``), '2xbf16' walks those four too (``walks_four_unpaired``), against
# chunk 256, which such calls took before, 0.719x at 80 pairs over 16,384 tokens, 0.713x over
# 65,536, 0.779x at 72 over 32,768; out alone, two segments paired lost there (1.055x, 1.065x;
# H100 at 1907565, reports/h100/experiments/ab_p2_c256_ss_1907565.json).
WALK_SPLIT_PAIRING = {"input": WALK_PAIRING["input"][0]}
# On compute capability 9.x fp16's walk pairs up to dstate 128 too, there computing out transposed
# (``walk_out_transposed``): on sm_90 its block then takes 128 registers, no spill, 93,384 bytes of
# shared memory (in out's orientation 252 and 95,024, which lost paired at 50fd6c2 above). On the
# H200 at ee6262e against one block an SM, whole forward, outs equal bit for bit
# (experiments/ab_fp16_walk_paired_n128_ee6262e.txt): 0.730-0.736x the time at 192, 256, 512 and
# 1,024 blocks (8 x 4096 x 64 heads 1.035 -> 0.756 ms; headdim 128; 8 rows of 2,048 tokens), 0.924x
# at 384, 0.828x in 8 groups (its own scores, ``walk_shares_scores``), with z 0.605x, D per head
# 0.507x, per channel 0.691x, final states 0.768x (their update in '3xfp16'); paired in out's
# orientation 1.19-1.58x (z 0.999x, D per head 0.875x). With both z and D, which only a paired walk
# takes, 0.22-0.24x the two state kernels and compute_out at chunk 64, out's error against float64
# equal to 9 digits; chunk 256, which such calls took by default before, was not timed beside it
# (new device loans paused): at ebba46f it took fp16's first anchor 1.486 ms out alone and 1.712
# with z, against this walk's 0.874 with z and D (different runs). A paired round's cost ~1.47 (1.39
# at 384 blocks; whole forwards): any cost between 1 and 1.5 pairs the same block counts (the fewest
# rounds alone over paired above one round is 3/2). With both z and D it takes 128 registers, no
# spill, 101,568 bytes. On the H100 at ee6262e the paired transposed walk took 0.63-0.93x at seven
# calls (reports/h100/experiments/ab_t2_t2s_ee6262e.json). On sm_100 it takes 255 registers and
# 118,108 bytes (two do not fit an SM's 228 KB) and on sm_80 spills 1,448 bytes, so only 9.x takes
# this reach.
WALK_PAIRING_SM90 = {"2xfp16": (128, 1.47)}
# The modes the walk runs in, each with the x dtype it takes there (torch's name): each dtype's
# default, and bf16's opt-in '2xbf16' (below). Measured on the H200 against chunk 256 and the two
# state kernels, which such calls took before: fp16 x (its '2xfp16' default) 0.41-0.77x (first
# anchor 1.49 -> 1.09 ms out alone), bf16 x returning final states (their update in '3xbf16')
# 0.55-0.77x (first anchor 0.93 -> 0.56 ms), the final states 4-5e-8 apart
# (experiments/ab_walk_modes_ebba46f.txt). float32 x ('3xbf16', 36 MMAs a chunk) up to dstate 64:
# there 0.504-0.517x with 8 worker warps at four shapes of 128 to 512 pairs, out alone and with
# final states (first anchor at dstate 64 3.48 -> 1.79 ms; 0.642-0.665x with the compiler's 4), at
# dstate 32 0.377x and 16 0.357x with 4 (0.55x and 0.64x with 8); out 3-6% further from float64
# than chunk 256's (~1.5e-7 normwise), final states 2% nearer
# (experiments/ab_fp32_walk_rule_b85bfdb.txt). At dstate 128 it lost: 1.38x with 8 worker warps
# (242 registers, no spill on sm_90), 1.23x with 4 (1,192 bytes spilled), 1.85x at 32 heads in 8
# groups (experiments/ab_fp32_walk_9b7a531.txt). On sm_90 8 worker warps at dstate 64 take 168
# registers, no spill (the compiler's 4: 255, none); at 32 both 168.
# bf16 x opting in to '2xbf16' (every computed operand in two bf16 terms, the state update in
# '3xbf16') walks too, one block an SM (168 registers, no spill, 194,000 bytes at dstate 128 on
# sm_90; 255 registers at 64, an 8-byte spill at 256), unsplit two where that pays
# (WALK_PAIRING): on the H100 at e33b16b one an SM took 0.39-0.45x the time of chunk 256's
# '2xbf16', which such calls took before (first anchor 1.49 -> 0.59 ms; 1.69x the default's
# 0.35 ms in 'input'), out alone and with final states, dstate 64 to 256 (256: 0.40-0.41x,
# ab_p2_n256_bc870b4.json), out as far from float64 as there (1.66e-3 normwise; 'input' 2.46e-3;
# reports/h100/experiments/ab_p2_p2s_c256_e33b16b.json). Its state update in '2xbf16' saved
# nothing (0.99-1.17x).
WALK_MODES = {"input": "bfloat16", "2xbf16": "bfloat16", "2xfp16": "float16",
              "3xbf16": "float32"}
# Whether the walk takes calls that return varlen states (packed prefills by cu_seqlens): it
# stores the state entering each chunk that holds a sequence's end, then chunk_state adds the
# ends' increments (kernels/scan_out.py's ``varlen``, ``kernels.fwd_pass_state.
# add_sequence_end_increments``). Off until a GPU has run them: written on 2026-12-08 and
# compiled for sm_80, sm_90 and sm_100 (CI), never run, so such calls keep chunk 256's three
# kernels, which GPUs have tested (1.11-1.15x mamba_ssm's replays on the H100,
# reports/h100/packed/). tests/test_kernels_gpu.py's prefill tests run them under this rule
# (``dispatch_rules``), as does ``mamba2-cutile ab --arm 'walk ssd.WALK_VARLEN_STATES=true'``.
WALK_VARLEN_STATES = False
# Modes whose walk from a start state (the call's initial states, or a segment's entering state
# where the walk splits) computes its own scores (``walk_shares_scores``). In '2xbf16' at dstate
# 128, one block an SM, reading the shared scores, the first chunk's out raced on the H100 at
# 73422c9 (reports/h100/experiments/walk_start_race_73422c9.txt): 0.43 normwise against float64
# from initial states at 2 x 2,048 x 64 heads, 1 of 6 runs bit-equal; split as 'input''s walk
# (48 heads over 257 chunks) 0.023, only in the second segment's first chunk (6f12069's fault,
# then unexplained). The start's load off TMA or with a latency hint raced alike; the walk's
# own scores, out transposed or two blocks an SM were right (1.660e-3, bf16's own rounding of
# out) and bit-equal in 6 of 6 runs, from initial states and split. Own scores took 0.484x chunk
# 256's '2xbf16' time from initial states at the first anchor's size and 0.579x split at the
# third's (out transposed 0.594x, 0.682x). The rule holds at every dstate the walk would read
# shared scores at, 256 too, where 6f12069's split was right; own scores there took 0.412x chunk
# 256's time from initial states at 2 x 8,192 x 64 heads (H100 at 02fdbf4,
# reports/h100/experiments/ab_p2_n256_start_02fdbf4.json).
WALK_OWN_SCORES_FROM_START_MODES = ("2xbf16",)
# Modes whose walk from initial states, where it reads its own scores only for them (above
# SCAN_OUT_OWN_SCORES_MAX_DSTATE), pairs (WALK_PAIRING) with neither or both of z and D, not one
# (``walk_occupancy``). In '2xbf16' on the H100 at 3e32b85, 8 x 4,096 x 64 heads at dstate 128
# from initial states, paired against one block an SM (reports/h100/experiments/
# ab_p2_start_3e32b85.json, ab_p2_alone_p2_3e32b85.json): plain 0.831x; with z 1.466x (on sm_90
# tileiras fits two such blocks an SM at 128 threads and 251 registers each, where the other
# paired walks take 256 threads at 128 registers and alone 384 at 168), with D per head 1.091x
# (128 registers, 256 threads, no spill); with both, which walk only paired (128 threads at 242
# registers), 0.661x chunk 256's time, which such calls take otherwise. At dstate 64, its scores
# its own from the start or not, z from initial states paired took 0.876x.
WALK_ALONE_FROM_START_WITH_Z_OR_D = ("2xbf16",)
# Below SCAN_OUT_MIN_ROW_HEADS pairs a bf16 walk splits each sequence of WALK_SPLIT_MIN_CHUNKS
# chunks or more into segments (``walk_segments``): a states-only walk gives each segment's end
# state from zero, a sum over the segments gives the state entering each one
# (kernels/entering_states.py), and the walk then runs every segment from its entering state,
# b * H * segments blocks. The most segments (a power of two, at most WALK_MAX_SEGMENTS, the
# most the H200 A/Bs below timed) whose blocks fit one round on the SMs, one block an SM, each
# of WALK_SEGMENT_MIN_CHUNKS chunks or more; the
# walk takes the call where its pairs times its segments reach WALK_MIN_SPLIT_ROW_HEADS
# (``walk_takes_few_pairs``), and its states-only walk takes each segment in the most parts (a
# power of two) whose blocks fit one round two to an SM (``segment_split``; one an SM at dstate
# 256, where the walk does not pair). Measured on the H200 against
# main's path (experiments/ab_segments_16780b5.txt, ab_segments2_16780b5.txt,
# ab_prepass_dacde8e.txt): one round alone was the fastest split at every bf16 shape (64 pairs
# in 2 segments 0.857x chunk 256 with final states against 0.952x in 4, one paired round); 96
# pairs unsplit 0.775x the fused scan out alone and 0.743x chunk 256 with final states; 32 pairs
# in 4 segments 0.833x and 0.842x, 16 in 8 0.804x, 8 in 16 0.703-0.808x. In parts the
# states-only walk turned 64 pairs out alone from no gain over the fused scan (0.988-1.06x in
# one part) into a win at 8 of 9 shapes of 16,384 to 131,072 tokens (0.831-0.969x in two parts;
# the third anchor 0.867x; lost: 2 x 32 heads in 8 groups, 1.03-1.04x), and with final states
# 0.708-0.771x; 48 pairs in two parts 0.955x out alone, 0.905x with final states, where in one
# part they lost (1.09-1.10x). Then more parts than the fewest with 96 blocks, the rule until
# 609d542, did not pay (out alone 0.2-6% slower, with final states 0.1% slower to
# 3.8% faster: 64 and 48 pairs in four, 32 pairs in two); at adb1575 the most parts that fill
# a paired round took 0.930-0.976x the time at 9 of 11 shapes (the third anchor 1.139 -> 1.093
# ms, 0.960x, with final states 0.975x; 16,384 tokens 0.969x; 2 x 32 heads in 8 groups 0.963x;
# dstate 64 0.961x; 48 pairs out alone 0.976x; 32 pairs in four segments 0.930x and 0.957x, 16
# in eight 0.953x), 48 pairs with final states 1.000x, 8 pairs in sixteen segments 1.005x, outs
# and final states equal bit for bit (experiments/ab_segment_split_adb1575.txt). Lost: sequences
# of 128 chunks (8,192 tokens, segments of 64: out alone 1.05-1.09x), segments of 32 chunks
# (1.04-1.09x), fewer than 96 blocks (8 pairs in 4 segments 2.2x), and fp16's walk ('2xfp16',
# one block an SM: 0.96-1.03x), which keeps SCAN_OUT_MIN_ROW_HEADS.
WALK_SPLIT_MIN_CHUNKS = 256
WALK_SEGMENT_MIN_CHUNKS = 64
WALK_MAX_SEGMENTS = 16
WALK_MIN_SPLIT_ROW_HEADS = 96
# From four segments of one round alone, twice as many, paired (``walk_segments``): each
# doubling adds 1 / (2 x segments) of the sequence to the states-only walk and takes the walk
# of out to one paired round of half the steps. On the H200 at 6a2f034, against the most
# segments of one round alone, both with segment_split's parts (experiments/ab_double_6a2f034
# .txt): 0.807-0.979x the time at all 9 shapes it doubles (32 pairs over 65,536 tokens 0.939x
# out alone, 0.966x with final states; over 32,768 and 131,072 0.936x; 16 pairs with final
# states 0.979x; 32 heads in 8 groups 0.807x), outs and final states equal bit for bit. From
# two segments (the third anchor's 64 pairs) four paired took 1.032x there (0.995x / 1.036x out
# alone / with final states at adb1575, ab_split_adb1575.txt).
WALK_PAIRED_SEGMENTS_FROM = 4
# Where the split of one round alone leaves the walk fewer than WALK_MIN_SPLIT_ROW_HEADS blocks
# (it does not take the call) or no split (one segment: the unsplit walk's blocks more than half
# the SMs, 67 to 127 pairs at headdim 64), twice the segments, paired, from
# WALK_MIN_PAIRED_SPLIT_ROW_HEADS pairs times segments:
# - one segment to two. On the H200 at d677366 over 16,384 to 65,536 tokens at 72 and 80 pairs,
#   which ran the fused state scan out alone and chunk 256 with final states: out alone
#   0.763-0.810x the fused scan and 0.853-0.953x chunk 256 (which beat the scan there,
#   0.850-0.894x; the unsplit walk 1.000-1.022x the scan), with final states 0.903-0.915x chunk
#   256 (the unsplit walk 1.058-1.078x), out as near float64 (2.26e-3 normwise;
#   experiments/ab_gap_d677366.json). On the H100 at 900e124 from 96 pairs, against the unsplit
#   walk: 0.759x and 0.772x at 96 and 112 pairs over 65,536 and 32,768 tokens, 0.819x at 4 x 24
#   heads over 16,384, 0.862x with final states (reports/h100/experiments/ab_s2_900e124.json).
# - two segments to four at 34 to 47 pairs, which ran chunk 256 (ssd_forward's pick where the
#   walk does not take the call). On the H100 at 900e124 against chunk 256: 0.807x and 0.810x
#   at 40 pairs over 65,536 tokens, 0.822x at 2 x 20 heads over 32,768, 0.903x at 36 pairs over
#   16,384, 0.794x with final states at 44 pairs over 32,768, out's error 2.05-2.19e-3
#   normwise against chunk 256's 2.01-2.14e-3 (ab_s4_900e124.json, ab_s4b_900e124.json). From 48
#   pairs, where two alone take the call, out alone walks in four paired since 0def9fb's
#   measures (``walks_four_segments``, below).
# - four segments to eight at 17 to 23 pairs and eight to sixteen at 9 to 11, which ran chunk
#   256 (68 to 92 blocks alone, too few for the walk). On the H100 at 96fe790 against chunk
#   256: 0.834x at 20 pairs over 65,536 tokens, 0.865x with final states at 22 over 32,768,
#   0.745x and 0.684x at 10 and 9 over 65,536; out's error 2.01-2.27e-3 normwise against chunk
#   256's 2.01-2.21e-3 (reports/h100/experiments/ab_g_96fe790.json, ab_g2_96fe790.json). So
#   from WALK_PAIRED_SEGMENTS_FROM segments this is the threshold too. As dispatched at cec75d2
#   on the H100, 0.608-0.867x chunk 256 at 11 shapes of 9 to 23 pairs (17 over 32,768 tokens
#   0.867x, 10 over 131,072 0.721x, dstate 64 0.608x, 2 x 5 and 3 x 7 heads, z and D, final
#   states), out's error 1.95-2.27e-3 against 1.92-2.21e-3 (ab_split_dispatch_cec75d2.json,
#   ab_split_dispatch2_cec75d2.json).
# On the H200 at 0def9fb as dispatched (experiments/ab_split_dispatch_0def9fb.json), D per head:
# two paired 0.756x the unsplit walk at 96 pairs over 65,536 tokens, 0.777x at 112 over 32,768,
# 0.869x with final states at 96 over 16,384; against chunk 256 four segments 0.830x at 40 pairs
# over 65,536, 0.818x with final states at 44 over 32,768, eight 0.854x at 20 and 0.884x with
# final states at 22 over 32,768, sixteen 0.761x at 10 over 65,536; out's error 2.01e-3 to
# 2.27e-3 normwise, chunk 256's 2.01e-3 to 2.21e-3.
WALK_MIN_PAIRED_SPLIT_ROW_HEADS = 66
# Two segments to four (``walks_four_segments``) up to WALK_FOUR_MAX_ROUNDS rounds alone:
# - With final states from two paired, four alone: the walk's float32-grade state update
#   ('3xbf16') pays more for pairing than out alone's (on sm_90 paired it spills 16 bytes at 128
#   registers, out alone's none; alone 168 registers:
#   reports/cpu/experiments/ab_two_sm_90_736457b.json). On the H100 at bb59be5
#   (reports/h100/experiments/ab_s4_bb59be5x.json to ab_s4d_bb59be5x.json: an uncommitted knob
#   doubling the segments once more, as ab arms) against two paired: 0.854x at 72 pairs over
#   16,384 tokens, 0.862x at 80 (three runs, the Mamba-2 2.7B prefill's heads), 0.834x at 80 over
#   32,768 (2.2 to 2.4 rounds alone); lost at 96 over 65,536, 2.9 rounds (1.045x). Four paired
#   instead took 0.915-0.933x, two alone 1.323x. Out's error unchanged (2.05e-3 to 2.11e-3
#   normwise in both). On the H200 at 0def9fb as dispatched against two paired: 0.856x at 80
#   pairs, 0.825x at 72 over 32,768 (experiments/ab_split_dispatch_0def9fb.json). From two alone
#   at 48 and 64 pairs four paired lost on the H100 (1.165-1.176x): not dispatched. With z and
#   no D on the H100 at 4286b41 (reports/h100/experiments/ab_four_z_4286b41.json): 0.689x at 80
#   pairs over 16,384 tokens, 0.659x at 72 over 32,768.
# - Out alone with D and without z, from two alone (48 to 66 pairs) or two paired, four paired even
#   past one paired round (``walks_four_paired``), B loaded with WALK_B_LATENCY. On the H200 at
#   0def9fb (experiments/ab_s4_out_alone_0def9fb.json; the knob above), D per head, with dt's bias
#   and softplus, against two: from two alone 0.903-0.911x at 56 and 64 pairs over 16,384 and 32,768
#   tokens, at the third anchor's size (64 pairs over 65,536) 0.911x (1.132 -> 1.031 ms); from two
#   paired, with B's hint, 0.948x and 0.934x at 80 over 16,384 and 32,768, 0.951x at 2 x 40 heads,
#   lost at 88 (1.013x; 1.33 paired rounds); four alone 1.004-1.031x. On the H100 at 4286b41
#   (reports/h100/experiments/ab_four_paired_4286b41.json and beside it), with B's hint:
#   0.899-0.916x from two alone at 48 and 64 pairs over 16,384 and 65,536 tokens, 0.943x at 4 x 16
#   heads, 0.856x at dstate 64 (no hint there); 0.923-0.953x from two paired at 72, 80 and 82 pairs,
#   0.972x at 2 x 40; D per channel 0.907-0.940x. Without B's hint past one paired round it lost
#   (1.036-1.058x at 80 and 82 pairs and 2 x 40 heads). Out's error equal to three digits. Not
#   taken: without D (1.046-1.066x at 48 and 64 pairs, the third anchor as the bench runs it 1.066x;
#   0.981x at 80), where two alone run faster than with D (0.952 against 1.156 ms at the third
#   anchor's size); with z and no D (with B's hint 1.079x at 56 pairs, 0.771x at 80).
WALK_FOUR_MAX_ROUNDS = 2.5
# The SMs the dispatch assumes off a GPU (the host code on CPU or meta tensors; CI's compile of
# the variants calls launch): the H200's, where the rule above was measured.
REFERENCE_SM_COUNT = 132
# Its compute capability (10 * major + minor), which the dispatch assumes off a GPU too.
REFERENCE_CAPABILITY = 90
MAX_HEADDIM = 256
MAX_DSTATE = 256
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNSUPPORTED_FEATURES: dict[str, str] = {}
# Blocks the sequential state passing should have in flight: a few per SM of an H100/H200 (132).
STATE_PASSING_MIN_BLOCKS = 4 * 132
MIN_TILE = 16
ROW_BLOCK = 64
P_BLOCK = 64
STATE_N_BLOCK = 64
TUNED_TABLE = os.path.join(os.path.dirname(__file__), "tuned.json")
# What precision='auto' means per x dtype (module docstring says why).
AUTO_PRECISION = {torch.float32: "3xbf16", torch.bfloat16: "input", torch.float16: "2xfp16"}
# Heads per group from which compute_out shares the scores C_i . B_j^T across them. On the H200
# (tuner, bf16, reports/h200/experiments/tune_322c7d5.json.gz) sharing won with 64 heads per group
# (tf32 1.27 vs 1.43 ms at the best tiles: freed registers let 4 blocks share an SM) and lost
# with 4 (0.80 vs 0.70 ms: the (b, L, G, Q) scores traffic outweighs 4 small MMAs); 8 is between.
SHARED_SCORES_MIN_HEADS = 8
# Modes that cut float32 MMA operands into bf16 terms (kernels/tile_ops.py): 2xbf16 for bf16 x
# (against raw bf16 operands), 3xbf16 for any x (fp16 and float32 operands are cut too). Their
# chunk-state matmul runs 3xbf16. The fp16 splits cut them, scaled, into fp16 terms against raw
# fp16 operands; their chunk-state matmul runs 3xfp16.
BF16_SPLITS = ("2xbf16", "3xbf16")
FP16_SPLITS = ("2xfp16", "3xfp16")
# x dtypes each split mode takes, and what it does with them (for the error a mismatch gets).
_FP16_SPLIT = ((torch.float16,), "it multiplies raw fp16 operands by float32 ones cut into scaled "
                                 "fp16 terms")
SPLIT_X_DTYPES = {
    "2xbf16": ((torch.bfloat16,), "it multiplies raw bf16 operands by float32 ones cut into bf16 "
                                  "terms; '3xbf16' cuts both and takes any x"),
    "3xbf16": ((torch.bfloat16, torch.float16, torch.float32), ""),
    "2xfp16": _FP16_SPLIT,
    "3xfp16": _FP16_SPLIT,
}


@dataclass(frozen=True)
class ProblemKey:
    """What decides the kernel variants and tiles of a call: sizes, dtypes, feature flags."""

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    chunk_size: int
    x_dtype: torch.dtype
    b_dtype: torch.dtype
    c_dtype: torch.dtype
    dt_dtype: torch.dtype = torch.float32
    z_dtype: Optional[torch.dtype] = None
    start_dtype: Optional[torch.dtype] = None
    seq_dtype: Optional[torch.dtype] = None
    cu_dtype: Optional[torch.dtype] = None
    nseq: int = 0
    has_d: bool = False
    d_per_channel: bool = False   # D (nheads, headdim): compiled apart from D per head's broadcast
    has_bias: bool = False
    softplus: bool = False
    has_limit: bool = False
    per_seq_start: bool = False
    varlen: bool = False
    wide: Optional[bool] = None       # None: decided from the sizes, as for contiguous tensors
    # The call hands back final or varlen states (or every stage): else the chunk states only
    # feed compute_out (``state_precision``).
    states_returned: bool = True
    # Every stage is handed back, the chunk states too (``ssd_forward_stages``): no walk.
    chunk_states_returned: bool = False

    def __post_init__(self):
        # Varlen states computed are states returned: their sums float32-grade
        # (``state_precision``), whatever the caller said of the rest.
        if self.varlen and not self.states_returned:
            object.__setattr__(self, "states_returned", True)

    @classmethod
    def from_problem(cls, p: SSDProblem, varlen: bool, wide: bool,
                     states_returned: Optional[bool] = None,
                     chunk_states_returned: bool = False) -> "ProblemKey":
        """states_returned None: whether ``p`` asks for final or varlen states."""
        if states_returned is None:
            states_returned = p.return_final_states or p.return_varlen_states
        packed = p.seq_idx is not None or p.cu_seqlens is not None
        seq_dtype = None
        if packed:
            seq_dtype = p.seq_idx.dtype if p.seq_idx is not None else p.cu_seqlens.dtype
        return cls(batch=p.batch, seqlen=p.seqlen, nheads=p.nheads, headdim=p.headdim,
                   dstate=p.dstate, ngroups=p.ngroups, chunk_size=p.chunk_size,
                   x_dtype=p.x.dtype, b_dtype=p.B.dtype, c_dtype=p.C.dtype, dt_dtype=p.dt.dtype,
                   z_dtype=None if p.z is None else p.z.dtype,
                   start_dtype=None if p.initial_states is None else p.initial_states.dtype,
                   seq_dtype=seq_dtype,
                   cu_dtype=None if p.cu_seqlens is None else p.cu_seqlens.dtype,
                   nseq=p.nseq or 0, has_d=p.D is not None,
                   d_per_channel=p.D is not None and p.D.dim() == 2,
                   has_bias=p.dt_bias is not None,
                   softplus=p.dt_softplus, has_limit=p.has_dt_limit,
                   per_seq_start=p.per_sequence_initial_states, varlen=varlen, wide=wide,
                   states_returned=states_returned,
                   chunk_states_returned=chunk_states_returned)

    @property
    def nchunks(self) -> int:
        return -(-self.seqlen // self.chunk_size)

    def needs_int64(self) -> bool:
        """Whether some array spans 2^31 elements or more (contiguous layouts)."""
        if self.wide is not None:
            return self.wide
        states = self.batch * (self.nchunks + self.nseq) * self.nheads * self.headdim * self.dstate
        sizes = (self.batch * self.seqlen * self.nheads * self.headdim,
                 self.batch * self.seqlen * self.ngroups * self.dstate, states)
        return max(sizes) >= INT32_LIMIT


@dataclass(frozen=True)
class Plan:
    """The compiled variant and tiles of each kernel for one call."""

    cumsum: ChunkCumsumConfig
    chunk_state: ChunkStateConfig
    state_passing: StatePassingConfig
    out: ComputeOutConfig
    # When set, stage 2 is this one kernel instead of chunk_state and state_passing.
    state_scan: Optional[StateScanConfig] = None
    # When set, stages 2 and 3 are this one kernel (after the scores, when shared).
    scan_out: Optional[ScanOutConfig] = None
    # With scan_out, the segments it walks each sequence in (``walk_segments``), and, split, the
    # states-only walk that gives the segments' end states before it, in segment_split parts a
    # segment (more blocks: the walk's segments fill the SMs, its first segments alone do not),
    # and the kernel that carries their end states to the segments' entering states.
    segment_states: Optional[ScanOutConfig] = None
    walk_segments: int = 1
    segment_split: int = 1
    entering_states: Optional[EnteringStatesConfig] = None

    def named_configs(self) -> tuple[tuple[str, object], ...]:
        """(kernel name, config) in launch order; the scores kernel only when compute_out shares
        its scores (kernels/chunk_scores.py)."""
        named = [("chunk_cumsum", self.cumsum)]
        if self.segment_states is not None:
            named += [("segment_states", self.segment_states),
                      ("entering_states", self.entering_states)]
        if self.scan_out is not None:
            if self.scan_out.shared_scores:
                named.append(("chunk_scores", self.scan_out.scores_config()))
            named.append(("scan_out", self.scan_out))
            if self.scan_out.varlen:
                named.append(("varlen_states", self.chunk_state))
            return tuple(named)
        if self.state_scan is not None:
            named.append(("state_scan", self.state_scan))
        else:
            named += [("chunk_state", self.chunk_state), ("state_passing", self.state_passing)]
        if self.out.shared_scores:
            named.append(("chunk_scores", ChunkScoresConfig.for_out(self.out)))
        return (*named, ("compute_out", self.out))

    def configs(self):
        return tuple(cfg for _, cfg in self.named_configs())

    def with_knobs(self, knobs: dict) -> "Plan":
        """This plan with ``knobs`` ({plan field: {config field: value}}) overriding what the
        dispatcher picked (kernels/variants.py's covering recipes, ``mamba2-cutile ab``'s arms)."""
        return replace(self, **{field_name: replace(getattr(self, field_name), **changes)
                                for field_name, changes in knobs.items()})


def resolve_precision(precision: Optional[str], x_dtype: torch.dtype) -> str:
    """The mode of the output's matmuls (module docstring)."""
    if precision is None or precision == "auto":
        return AUTO_PRECISION[x_dtype]
    if precision not in PRECISIONS:
        raise SSDInputError(f"precision: expected 'auto' or one of {PRECISIONS}, got {precision!r}")
    if precision == "input" and x_dtype == torch.float32:
        raise SSDInputError("precision: expected 'input' only with bf16/fp16 x (it rounds MMA "
                            "operands to x's 16-bit dtype), got 'input' with float32 x; use "
                            "'tf32' for a fast float32 mode")
    allowed, why = SPLIT_X_DTYPES.get(precision, ((x_dtype,), ""))
    if x_dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise SSDInputError(f"precision: expected {precision!r} only with {names} x ({why}), got "
                            f"it with {str(x_dtype).replace('torch.', '')} x")
    return precision


def resolve_state_dtype(state_dtype: Optional[torch.dtype], mode: str,
                        x_dtype: torch.dtype) -> torch.dtype:
    """The stored chunk states' dtype: ``state_dtype`` when given, else x's 16-bit dtype in the
    'input' mode, where compute_out rounds the entering states to it anyway (so no output
    changes), else float32 (module docstring)."""
    if state_dtype is not None:
        return state_dtype
    return x_dtype if mode == "input" else torch.float32


def state_precision(mode: str, x_dtype: torch.dtype, states_returned: bool = True) -> str:
    """The mode of the chunk-state matmul. In 'input' with bf16 x, for a call that returns no
    states, 'input' too: the chunk states then only feed compute_out, which rounds each entering
    state to bf16 before its matmul, so float32-grade sums would buy the outputs little (the CPU
    model: normwise output errors within 1.5% of the float32-grade states', max errors equal,
    over the envelope's bf16 cells) at three MMAs instead of one. On the H200 (benches at
    9c63aa5 and d69d2e3, experiments/bench_anchors_*) the first anchor's states stage went from
    0.434 to 0.301 ms, its normwise output error from 2.35e-3 to 2.38e-3 (mamba_ssm 2.37e-3),
    its max error unchanged (7.89e-2). (fp16 x keeps the split there: the weighted x rounded to
    fp16 could overflow past 65504.) Likewise in '2xfp16' (fp16 x's default), two scaled fp16
    terms instead of three: compute_out cuts each entering state into two such terms before its
    matmul (the CPU model: output max errors equal to three-term states' at seven of the
    envelope's fp16 cells, the states' own error within 1% at six). On the H200 (5d543e6) the
    quick grid's fp16 out-only case passed (32 cases, none breaking the rule) and the fp16
    bench's states stage took 0.435 ms against three terms' 0.470 (d69d2e3, another run; forward
    1.612 -> 1.574 ms, 0.68x -> 0.70x mamba_ssm's in each run, errors unchanged:
    experiments/bench_variants_5d543e6/). Else float32-grade for 16-bit x (final_states are
    float32), in three bf16 terms for bf16 x in the bf16 modes (~2^-27 per product against the
    exact bf16 operand; at (8, 4096, 64 heads) the states stage took 0.54 ms this way against
    0.87 ms in three TF32 terms at the same tiles, reports/h200/experiments/
    tune_21181f8_gpu0.json.gz; over the H200 envelope's bf16 cells the states errors changed by
    0.72x to 1.01x, the worst unchanged), in three scaled fp16 terms in the fp16 splits, the
    user's mode for float32 x."""
    if not states_returned and mode == "input" and x_dtype == torch.bfloat16:
        return "input"
    if not states_returned and mode == "2xfp16":
        return "2xfp16"
    if mode in BF16_SPLITS or (mode == "input" and x_dtype == torch.bfloat16):
        return "3xbf16"
    if mode in FP16_SPLITS:
        return "3xfp16"
    return "3xtf32" if x_dtype != torch.float32 and mode in ("tf32", "input") else mode


def shares_scores(key: ProblemKey) -> bool:
    """Whether compute_out reads C_i . B_j^T from kernels/chunk_scores.py (once per group) rather
    than computing it per head: when at least SHARED_SCORES_MIN_HEADS heads share a group."""
    return key.nheads // key.ngroups >= SHARED_SCORES_MIN_HEADS


def walk_shares_scores(key: ProblemKey, mode: str, n_pad: int, occupancy: Optional[int],
                       segments: int) -> bool:
    """Whether the walk of out reads kernels/chunk_scores.py's tiles (``shares_scores``, above
    dstate SCAN_OUT_OWN_SCORES_MAX_DSTATE) rather than computing C_c . B_c^T itself: not in
    WALK_OWN_SCORES_FROM_START_MODES from a start state (initial states, or split), nor where
    at most WALK_OWN_SCORES_MAX_READERS of its blocks (``walk_blocks`` per group) would read
    each tile, out alone at dstate 128 in 'input' or '2xfp16', unsplit, two blocks an SM or one
    without D and z."""
    if not shares_scores(key) or n_pad <= SCAN_OUT_OWN_SCORES_MAX_DSTATE:
        return False
    if mode in WALK_OWN_SCORES_FROM_START_MODES and (key.start_dtype is not None
                                                     or segments > 1):
        return False
    few_readers = walk_blocks(key) // (key.batch * key.ngroups) <= WALK_OWN_SCORES_MAX_READERS
    return not (few_readers and n_pad == 128 and segments == 1 and not key.states_returned
                and mode in ("input", "2xfp16")
                and (occupancy == 2 or (not key.has_d and key.z_dtype is None)))


def tuning_key(key: ProblemKey, mode: str) -> dict:
    """What kernels/tuned.json's entries match on: the padded tile extents, chunk, dtype, mode,
    and whether the scores are shared (a different kernel, with its own best tiles)."""
    return dict(headdim=max(MIN_TILE, next_pow2(key.headdim)),
                dstate=max(MIN_TILE, next_pow2(key.dstate)), chunk_size=key.chunk_size,
                x_dtype=str(key.x_dtype).replace("torch.", ""), precision=mode,
                shared_scores=shares_scores(key))


def load_tuning_entries(path: str) -> list[dict]:
    """The entries of a tuning table (kernels/tuned.json) or of a user's tuning cache; none when
    the file is absent. A file that is not such a table is an error, never silently ignored."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
        for e in entries:
            json.dumps(e["key"], sort_keys=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"tuning table {path}: expected the JSON that python3 -m kernels.tune "
                           f"writes ({{'entries': [{{'key': ..., ...}}]}}), got an unreadable "
                           f"file ({type(exc).__name__}: {exc}); delete it or point "
                           f"${TUNING_CACHE_ENV} elsewhere") from exc
    return entries


def _by_key(entries: list[dict]) -> dict[str, dict]:
    return {json.dumps(e["key"], sort_keys=True): e for e in entries}


TUNED = _by_key(load_tuning_entries(TUNED_TABLE))
# A user's own winners (python3 -m kernels.tune --shape ... --cache), per GPU model.
TUNING_CACHE_ENV = "MAMBA2_CUTILE_TUNING_CACHE"


def tuning_cache_path() -> str:
    """$MAMBA2_CUTILE_TUNING_CACHE, else $XDG_CACHE_HOME (default ~/.cache)/mamba2-cutile/
    tuned.json."""
    return _cache_path(os.environ.get(TUNING_CACHE_ENV), os.environ.get("XDG_CACHE_HOME"),
                       os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _cache_path(explicit: Optional[str], xdg_cache: Optional[str], home: Optional[str]) -> str:
    """Remembered per environment: every call looks the path up (``tuning_sources``)."""
    if explicit:
        return explicit
    cache = xdg_cache or os.path.join(home or os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mamba2-cutile", "tuned.json")


def current_device() -> Optional[str]:
    """The GPU model calls run on (tuning cache entries are kept per model); None without CUDA."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


@functools.lru_cache(maxsize=8)
def _cached_entries(path: str, modified: float, device: str) -> dict[str, dict]:
    return _by_key([e for e in load_tuning_entries(path) if e.get("device") == device])


class _ByIdentity:
    """Hashes and compares as the object it holds, by identity, and keeps it alive: a cache key
    for a dict that can never match a later dict at the same address."""

    __slots__ = ("held",)

    def __init__(self, held):
        self.held = held

    def __hash__(self):
        return id(self.held)

    def __eq__(self, other):
        return isinstance(other, _ByIdentity) and other.held is self.held


def tuning_sources() -> tuple:
    """What decides the entries a call sees: the repository's table (by identity), the user's
    tuning cache (path and modification time; None when absent) and the GPU model reading it.
    Every call passes here: one stat when there is no cache, nothing more."""
    path = tuning_cache_path()
    try:
        modified = os.path.getmtime(path)
    except OSError:
        return _ByIdentity(TUNED), path, None, None
    return _ByIdentity(TUNED), path, modified, current_device()


def tuned_entry(tkey: dict, sources: Optional[tuple] = None) -> dict:
    """The tiles for a tuning key: the user's tuning cache entry for this GPU model, else
    kernels/tuned.json's, else none (the heuristics of make_plan decide). Without a CUDA device
    (CI compiling variants) only the repository's table counts."""
    key = json.dumps(tkey, sort_keys=True)
    _, path, modified, device = sources or tuning_sources()
    found = None
    if modified is not None and device is not None:
        found = _cached_entries(path, modified, device).get(key)
    return TUNED.get(key, {}) if found is None else found


def _state_passing_tiles(key: ProblemKey, p_pad: int, n_pad: int,
                         start: tuple[int, int]) -> tuple[int, int]:
    """Tiles from ``start`` down, small enough that the sequential walk over chunks has enough
    blocks in flight."""
    p_block, n_block = min(p_pad, start[0]), min(n_pad, start[1])
    while key.batch * key.nheads * (p_pad // p_block) * (n_pad // n_block) < STATE_PASSING_MIN_BLOCKS:
        if n_block > MIN_TILE:
            n_block //= 2
        elif p_block > MIN_TILE:
            p_block //= 2
        else:
            break
    return p_block, n_block


def state_scan_tiles(row_heads: int, p_pad: int, n_pad: int, start: tuple[int, int],
                     sms: int = REFERENCE_SM_COUNT) -> tuple[int, int]:
    """The fused scan's tiles for ``row_heads`` (batch row, head) pairs: ``start`` within the
    padded state, its state columns halved (not below 64) while fewer than STATE_SCAN_MIN_BLOCKS
    blocks would walk the chunks and twice as many still fit one round on ``sms`` SMs."""
    p_block, n_block = min(p_pad, start[0]), min(n_pad, start[1])
    while n_block > 64:
        blocks = row_heads * (p_pad // p_block) * (n_pad // n_block)
        if blocks >= STATE_SCAN_MIN_BLOCKS or 2 * blocks > sms:
            break
        n_block //= 2
    return p_block, n_block


def fuses_state_scan(key: ProblemKey, states_mode: str) -> bool:
    """Whether stage 2 runs as kernels/state_scan.py: at its chunk size, with enough (row, head)
    pairs, the increments summed in one 'input' MMA (a call that returns no states, bf16 x:
    ``state_precision``; the modes that sum float32-grade states were not measured fused), and
    none of what only the two kernels handle (per-sequence starts, varlen states; packed
    sequences' resets are in the cumsum, kernels/chunk_cumsum.py)."""
    return (key.chunk_size in STATE_SCAN_CHUNK_SIZES and states_mode == "input"
            and key.batch * key.nheads >= STATE_SCAN_MIN_ROW_HEADS
            and not key.per_seq_start and not key.varlen)


def scan_out_occupancy(blocks: int, sms: int,
                       paired_cost: float = SCAN_OUT_PAIRED_COST) -> Optional[int]:
    """2 where the walk's blocks finish sooner two to an SM (occupancy=2), at ``paired_cost``
    times one block's time a pair, than one to an SM; else None (the compiler's choice, one)."""
    rounds_alone = -(-blocks // sms)
    rounds_paired = -(-blocks // (2 * sms))
    return 2 if rounds_paired * paired_cost < rounds_alone else None


def walk_blocks(key: ProblemKey) -> int:
    """The unsplit walk's blocks: one per (row, head, P_BLOCK channels)."""
    p_block = min(max(MIN_TILE, next_pow2(key.headdim)), P_BLOCK)
    return key.batch * key.nheads * -(-key.headdim // p_block)


def walk_segments(key: ProblemKey, sms: int, mode: str = "input") -> int:
    """The segments the walk in bf16's ``mode`` ('input', the default, or '2xbf16') splits each
    sequence into: 1 from SCAN_OUT_MIN_ROW_HEADS pairs or below WALK_SPLIT_MIN_CHUNKS chunks, else
    the most (a power of two, up to WALK_MAX_SEGMENTS) whose blocks fit one round on ``sms`` SMs,
    one block an SM, with WALK_SEGMENT_MIN_CHUNKS chunks or more each; twice as many, in one round
    two to an SM, where they are as long, pairs times segments reach
    WALK_MIN_PAIRED_SPLIT_ROW_HEADS and the mode's walk pairs at the call's dstate
    (``_pairs_up_to``): from WALK_PAIRED_SEGMENTS_FROM such segments always, below only where the
    walk would not take the call (or there is no split); four instead of two, alone or paired,
    where ``walks_four_segments``. At headdim 64 over 65,536 tokens on 132 SMs in 'input': two
    segments paired from 67 to 127 pairs (four from 67 to 82 with final states, alone, or out
    alone with D, paired), two alone from 48 to 66 (four paired out alone with D), four from 34
    to 47, eight from 17 to 33, sixteen from 9 to 16; '2xbf16' never pairs split
    (WALK_SPLIT_PAIRING): one segment from 67 pairs (four with final states up to 82,
    ``walks_four_unpaired``), two from 34 to 66, four from 17 to 33, eight from 9 to 16, sixteen
    below."""
    if walks_four_unpaired(key, sms, mode):
        return 4
    segments, doubled = _walk_segments_by_rounds(key, sms, mode)
    return 4 if segments == 2 and walks_four_segments(key, sms, doubled, mode) else segments


def walks_four_unpaired(key: ProblemKey, sms: int, mode: str) -> bool:
    """Whether a call returning final states walks in four segments in a bf16 ``mode`` whose
    split never pairs (not in WALK_SPLIT_PAIRING), where 'input' walks four from two doubled
    to pair (``walks_four_segments``): '2xbf16' at 67 to 82 pairs on 132 SMs."""
    return (WALK_MODES.get(mode) == "bfloat16" and mode not in WALK_SPLIT_PAIRING
            and key.states_returned and _walk_segments_by_rounds(key, sms, "input") == (2, True)
            and walks_four_segments(key, sms, True, "input"))


def _pairs_up_to(mode: str) -> int:
    """The most padded dstate at which the split walk in bf16's ``mode`` pairs its blocks
    (WALK_SPLIT_PAIRING; 0: never)."""
    return WALK_SPLIT_PAIRING.get(mode, 0)


def _walk_segments_by_rounds(key: ProblemKey, sms: int, mode: str) -> tuple[int, bool]:
    """``walk_segments`` before ``walks_four_segments``: (segments, whether they were doubled to
    run paired)."""
    if (key.batch * key.nheads >= SCAN_OUT_MIN_ROW_HEADS
            or key.nchunks < WALK_SPLIT_MIN_CHUNKS):
        return 1, False

    def fits(segments: int, per_sm: int) -> bool:
        return (segments < WALK_MAX_SEGMENTS and walk_blocks(key) * segments * 2 <= per_sm * sms
                and key.nchunks >= 2 * segments * WALK_SEGMENT_MIN_CHUNKS)

    pairs = key.batch * key.nheads
    segments = 1
    while fits(segments, 1):
        segments *= 2
    if segments >= WALK_PAIRED_SEGMENTS_FROM:
        doubles = pairs * segments >= WALK_MIN_PAIRED_SPLIT_ROW_HEADS
    else:
        doubles = (pairs * segments >= WALK_MIN_PAIRED_SPLIT_ROW_HEADS
                   and (segments == 1 or pairs * segments < WALK_MIN_SPLIT_ROW_HEADS))
    doubled = doubles and fits(segments, 2) and next_pow2(key.dstate) <= _pairs_up_to(mode)
    return (2 * segments if doubled else segments), doubled


def walks_four_segments(key: ProblemKey, sms: int, from_paired: bool, mode: str) -> bool:
    """Whether a call that would walk in two segments, alone in one round or (``from_paired``)
    doubled from one to run paired, walks in four instead: not with both z and D, and where the
    four segments' blocks take at most WALK_FOUR_MAX_ROUNDS rounds one block an SM (up to 82
    pairs on 132 SMs). With final states only from two paired, and the four run one block an SM
    (past one paired round, ``walk_occupancy`` runs them alone); out alone from either with D
    and without z, paired (``walks_four_paired``). The sequence makes four segments:
    WALK_SPLIT_MIN_CHUNKS is 4 x WALK_SEGMENT_MIN_CHUNKS."""
    if key.has_d and key.z_dtype is not None:
        return False
    if walk_blocks(key) * 4 > WALK_FOUR_MAX_ROUNDS * sms:
        return False
    if key.states_returned:
        return from_paired
    return key.has_d and next_pow2(key.dstate) <= _pairs_up_to(mode)


def walks_four_paired(key: ProblemKey, sms: int, mode: str = "input") -> bool:
    """Whether out alone walks in four segments from two (``walks_four_segments``), which run
    two blocks an SM even past one paired round."""
    segments, doubled = _walk_segments_by_rounds(key, sms, mode)
    return (not key.states_returned and segments == 2
            and walks_four_segments(key, sms, doubled, mode))


def segment_split(key: ProblemKey, segments: int, sms: int, mode: str = "input") -> int:
    """The parts each of the first ``segments - 1`` segments' states-only walk takes: the most
    (a power of two) whose blocks fit one round on ``sms`` SMs, two blocks an SM up to the
    dstate at which the walk in bf16's ``mode`` pairs (``_pairs_up_to``), else one; 1 unsplit."""
    if segments == 1:
        return 1
    slots = sms * (2 if next_pow2(key.dstate) <= _pairs_up_to(mode) else 1)
    blocks = walk_blocks(key) * (segments - 1)
    split = 1
    while blocks * split * 2 <= slots:
        split *= 2
    return split


# x's load latency hint in the walk of out (``walk_x_latency``): on sm_90 3 changes how the
# compiler buffers the step loop (the second anchor's walk 163,280 -> 171,504 bytes of shared
# memory, x's tile being 8 KB; no spill). On the H200 at be65b73, outs and final states equal
# bit for bit (experiments/ab_load_latency_be65b73.txt, ab_load_latency2_be65b73.txt,
# ab_load_latency3_be65b73.txt): bf16 at dstate 128 out alone one block an SM 0.823-0.869x the
# time in four runs of three shapes (the second anchor 0.268 -> 0.221 ms); walks that update
# early, paired, 0.932-0.966x at seven shapes, 1.001x at 16 pairs in sixteen segments; one an
# SM early 0.997x (the second anchor with final states) and 1.000x (the third anchor). Not
# taken: out alone paired, 1.058-1.084x (the first anchor 1.078x), dstate 64 one an SM 1.015x,
# 256 0.999x, fp16 1.046x. The hints 6 and 10 on x, C or the scores lost at the first anchor
# (1.105-1.135x). Nor with D paired: on sm_90 the hint takes the first anchor's walk with D and
# final states from no spill to 136 bytes (D per head; 128 per channel), and on the H100 at
# 7df05c1 without it, outs and final states equal bit for bit, that walk took 0.868x the time
# with D per head, 0.659x per channel, 0.670x at headdim 128 per channel, 0.869x at 3 rows
# (192 blocks); 1.000x from initial states, 0.987x split in two paired segments with final
# states (96 pairs), 0.998x out alone in four paired (the third anchor's size); without D
# 1.039x, so the hint stays there (reports/h100/experiments/ab_x0_tr_final_7df05c1.json,
# ab_x0_d_7df05c1.json). The split walk paired with z updating late (walk_updates_early) takes
# none: with it 0.994-1.004x at six shapes (ab_late_z_split_89a6f1e.json).
WALK_X_LATENCY = 3
WALK_X_LATENCY_DSTATE = 128


def walk_x_latency(mode: str, n_pad: int, occupancy: Optional[int], update_early: bool,
                   has_d: bool) -> int:
    """x's load latency hint in the walk of out (``ScanOutConfig.x_latency``): WALK_X_LATENCY in
    'input' (bf16) at padded dstate WALK_X_LATENCY_DSTATE where the walk runs one block an SM, or
    updates early paired without D; else 0 (the compiler's)."""
    if mode == "input" and n_pad == WALK_X_LATENCY_DSTATE and (
            occupancy is None or (update_early and not has_d)):
        return WALK_X_LATENCY
    return 0


# B's load latency hint in the walk of out (``walk_b_latency``): on sm_90 3 takes the third
# anchor's split walk (one block an SM) from 228,936 to 218,624 bytes of shared memory and from
# 48 bytes of spill to none. On the H200 at fdd7e22, outs and final states equal bit for bit
# (experiments/ab_walk_hints_fdd7e22.txt, ab_b_latency_fdd7e22.txt), split walks one block an SM:
# 0.858-0.865x the time out alone at dstate 128 (1, 16,384-65,536 tokens, 64 heads; the third
# anchor's cumsum and walk 1.090 -> 0.936 ms), 0.879x there with final states, 0.902x at dstate
# 256. Out alone in four segments paired (``walks_four_paired``), on the H100 at 4286b41
# (reports/h100/experiments/ab_four_paired_4286b41.json): 0.890-0.918x past one paired round (80
# and 82 pairs), 0.975x at 72, 0.976-0.996x within one; D per channel 0.892-0.993x. Not
# taken: other split walks paired (1.032x, 1.095x), split at dstate 64 (1.101x), unsplit out
# alone one an SM (0.940x at the second anchor but 1.105x at 2 x 48 heads) and unsplit with final
# states (1.081x paired, 1.098x alone). Of the other hints swept (C, the scores, dt and the cumsum
# at 1-10, x at 6 and 10), none won at the first anchor (0.992-1.41x; B at 10 0.992x) and none
# beat B's 3 at the third, alone or combined (C at 3 0.897x, the cumsum at 6 0.922x).
WALK_B_LATENCY = 3
WALK_B_LATENCY_MIN_DSTATE = 128
# fp16's walk ('2xfp16') with final states (its state update '3xfp16') one block an SM at padded
# dstate 128 loads B with the hint 10, which ran faster there on the H200 at 691633e, outs and
# final states equal bit for bit (experiments/ab_fp16_states_691633e.txt, after the sweep of x's
# and B's hints at 1-10 in ab_fp16_hints_691633e.txt): 0.856x at (8, 4096, 64 heads), 0.963x
# at (4, 8192, 32 heads, 8 groups), 0.841x at (2, 16384, 64 heads); x's hint at 1 or 2
# 0.87-1.00x, both 0.84-0.95x, no better than B's alone. No effect at dstate 256 (1.001x) nor
# paired at 64 (1.002x); out alone B at 10 took the first anchor's size 1.220x (0.947x at the
# second's), so out alone keeps the compiler's.
WALK_B_LATENCY_FP16_STATES = 10
WALK_B_LATENCY_FP16_DSTATE = 128


def walk_b_latency(mode: str, n_pad: int, occupancy: Optional[int], segmented: bool,
                   state_mode: str, four_paired: bool) -> int:
    """B's load latency hint in the walk of out (``ScanOutConfig.b_latency``): WALK_B_LATENCY in
    'input' (bf16) where the walk is split into segments and runs one block an SM, or in four
    segments paired out alone (``four_paired``: ``walks_four_paired``), at padded dstate
    WALK_B_LATENCY_MIN_DSTATE or more; WALK_B_LATENCY_FP16_STATES in '2xfp16' with its state
    update in '3xfp16' (final states) one block an SM at padded dstate
    WALK_B_LATENCY_FP16_DSTATE; else 0 (the compiler's)."""
    if (mode == "input" and segmented and (occupancy is None or four_paired)
            and n_pad >= WALK_B_LATENCY_MIN_DSTATE):
        return WALK_B_LATENCY
    if (mode == "2xfp16" and state_mode == "3xfp16" and occupancy is None
            and n_pad == WALK_B_LATENCY_FP16_DSTATE):
        return WALK_B_LATENCY_FP16_STATES
    return 0


# The walk of out computes each chunk's out transposed (``walk_out_transposed``,
# ``ScanOutConfig.out_transposed``): on sm_90 the state is then the entering state's MMA's left
# operand, read from registers, where out's own orientation copies h^T (16 KB in bf16) to shared
# memory and fences it before that MMA each step; W^T (8 KB) is copied instead, before the
# chunk's own MMA. The first anchor's paired walk: 4 matrix stores a thread a step against 12,
# 84,672 bytes of shared memory against 93,584, 128 registers, no spill. On the H200 at 991db3f,
# outs equal bit for bit (experiments/ab_walk_out_transposed_991db3f.txt): bf16 out alone, two
# blocks an SM, with the shared scores, 0.964-0.980x the time at six shapes (the first anchor
# 0.972x and 0.973x in two runs, 0.3516 -> 0.3416 ms; 8 rows of 1,024 and 16,384 tokens, 4 of
# 4,096, headdim 128, 8 groups), and at 5e68434 with D 0.914-0.931x per channel and
# 0.945-0.951x per head at three of them (the first anchor's walk with D per channel 0.4037 ->
# 0.3703 ms). Not taken:
# with z (1.048x, 1.053x; with D too 1.007x, 1.010x), one block an SM (1.27x at (2, 16384, 64
# heads), 1.36x at the second anchor, 1.33x in the third's split walk; 160-240 bytes spilled on
# sm_90, none with 8 worker warps, which lost more: 1.40-1.69x, 1.19-1.68x in out's
# orientation), its own scores (dstate 64, 1.065x) and with the early update (1.016-1.041x).
# The split walk paired with z updating late (walk_updates_early) and its own scores (32 heads
# in 8 groups, 96 in 32) transposed took 0.889x and 0.876x the early walk's time on the H100 at
# 89a6f1e, in out's orientation 1.000x and 1.001x (reports/h100/experiments/
# ab_late_z_split_89a6f1e.json). Unsplit with final states, updating late (walk_updates_early),
# the H100 found the opposite at be29531 (ab_late_z_final_be29531.json, ab_late_z_final2_*): out
# transposed where the walk reads the shared scores (0.956-0.961x the early walk's time against
# 1.002-1.006x in out's orientation), in out's orientation where it computes its own (0.880-0.916x
# against 0.946-0.977x). With z and D such walks update late anyway; reading the shared scores
# transposed took 0.974-0.977x the time with D per head, 0.988x / 0.989x per channel at six
# shapes on the H100 at aab4aca, outs and final states bit-equal (reports/h100/experiments/
# ab_zd_final_tr_aab4aca.json, ab_zd_final_tr2_aab4aca.json); not from initial states (1.024x)
# nor with their own scores (16 groups, 1.026x).
# With its own scores at dstate 128 (662371b, ``walk_shares_scores`` above) the walk paired
# computes out transposed without D, with z or not: 4 readers 0.901x the time of out's
# orientation, 8 readers 0.885x (0.969 / 1.095), with z 0.914x (0.946 / 1.035); with D it keeps
# out's orientation (8 readers: transposed 1.063x per head, 1.038x per channel, 1.025x with z).
# fp16's walk paired at dstate 128 computes out transposed whatever it reads and adds
# (WALK_PAIRING_SM90 has the figures); paired at dstate 64 transposed lost on the H200 at ee6262e:
# 1.353x out alone, 1.377x with z, 1.260x with D per channel, 1.351x with final states at 4 rows
# (on sm_90 32 bytes spilled; experiments/ab_fp16_walk_paired_n128_ee6262e.txt).


def walk_out_transposed(mode: str, occupancy: Optional[int], shared_scores: bool, n_pad: int,
                        update_early: bool, has_d: bool, has_z: bool,
                        final_from_zero: bool) -> bool:
    """Whether the walk of out computes out transposed (``ScanOutConfig.out_transposed``): in
    'input' (bf16) two blocks an SM, updating the state last, reading the shared scores without
    z or, unsplit returning final states from no initial states (``final_from_zero``), with z
    too (with D or without), or computing its own above dstate SCAN_OUT_OWN_SCORES_MAX_DSTATE
    without D (with z or without) but not unsplit returning final states; in '2xfp16' two blocks
    an SM at padded dstate 128 (WALK_PAIRING_SM90), whatever it reads and adds."""
    if mode == "2xfp16":
        return occupancy == 2 and n_pad == 128
    if mode != "input" or occupancy != 2 or update_early:
        return False
    if shared_scores:
        return not has_z or final_from_zero
    return n_pad > SCAN_OUT_OWN_SCORES_MAX_DSTATE and not has_d and not final_from_zero


# The split walk's states-only walk backward (``ScanOutConfig.backward``: chunks last to first,
# each increment decayed to the part's end, the carried state never rescaled), where it ran faster
# on the H200 (experiments/ab_backward_6a5f910.txt; one process against the forward walk, outs
# within 1e-4 normwise of it and their errors against float64 equal to 4 digits): out alone at
# one row of 65,536 tokens, dstate 256 (one block an SM) the states-only walk 0.566x, cumsum and
# walk 0.880x; at dstate 128 the states-only walk 0.975-0.988x, cumsum and walk 0.992-0.999x at
# six shapes (the third anchor's 0.997x, 0.994x with final states). Lost at dstate 64 (1.373x,
# 1.051x). fp16 x keeps the forward walk: its range does not hold the decays to a part's end.
WALK_BACKWARD_MIN_DSTATE = 128


def walks_states_backward(key: ProblemKey, n_pad: int) -> bool:
    """Whether the split walk's states-only walk runs its chunks last to first
    (``ScanOutConfig.backward``): from padded dstate WALK_BACKWARD_MIN_DSTATE, where x is not
    fp16."""
    return key.x_dtype != torch.float16 and n_pad >= WALK_BACKWARD_MIN_DSTATE


# The walk's early state update (x loaded last), where it won on the H200 at d3276e1, outs and
# final states equal bit for bit (experiments/ab_update_early_d3276e1.txt, second round
# ab_update_early2_d3276e1.txt): split walks 0.929-0.938x the time at eight paired shapes (32
# pairs over 32,768-131,072 tokens, 16 and 12 pairs, dstate 64, final states), 0.970x with z and
# D per channel, 1.000x at the third anchor's two segments, 0.998x in 8 groups; unsplit with
# final states 0.867x at the second anchor, 0.967-0.977x at four paired shapes, dstate 64 1.003x.
# Not taken: out alone unsplit (the first anchor 0.994x, headdim 128 0.994x, the second 1.001x,
# dstate 64 1.009x, fp16 1.003x, float32 1.017x) and z with D unsplit (1.028x, with final
# states too). Nor split two blocks an SM at padded dstate 128 with z and without D, where the
# update at the step's end ran faster on the H100 at be29531, outs bit-equal
# (reports/h100/experiments/ab_ne_split_be29531.json, ab_ne_z_split_be29531.json): 0.780-0.790x
# the time at 32 pairs in 8 segments and 96 in 2, from initial states too, with final states
# 0.923x; on sm_90 the early walk spilled 144 bytes there, the late one 24. As dispatched since
# (no x hint: walk_x_latency; out transposed with its own scores: walk_out_transposed), against
# the early walk (ab_late_z_split_89a6f1e.json): 0.777-0.828x at four shapes (16 to 96 pairs),
# 0.923x with final states, own scores 0.889x and 0.876x. The other split walks keep it: with z
# and D 1.018-1.045x late, D alone 1.120x, out alone 1.194x; with z one block an SM
# 0.997-1.000x and at dstate 64 1.001x. Unsplit with final states the same walks (paired at
# dstate 128, z, no D) ran faster updating late on the H100 at be29531, outs and final states
# bit-equal (reports/h100/experiments/ab_late_z_final_be29531.json, ab_late_z_final2_*; the
# orientations timed there: walk_out_transposed). As dispatched since f45a613, against the early
# walk (ab_late_z_final_aab4aca.json): own scores 0.896-0.922x (2 and 4 heads a group, headdim
# 128), the shared scores 0.957-0.966x. They keep the early update at one head a group (late
# 1.007x, late and transposed 0.997x / 0.999x: ab_g64_ltr_aab4aca.json) and from initial states
# (1.305x).
WALK_LATE_PAIRED_Z_DSTATE = 128


def walk_updates_early(key: ProblemKey, mode: str, state_mode: str, segments: int,
                       occupancy: Optional[int], n_pad: int) -> bool:
    """Whether the walk of out updates its state right after the entering state's term and loads
    x last (``ScanOutConfig.update_early``): in 'input' (bf16), split into ``segments`` or with
    its state update in a finer mode than out's (final states returned) but not both z and D;
    neither where it runs paired at padded dstate WALK_LATE_PAIRED_Z_DSTATE with z and without
    D, split or, from no initial states, with more than one head a group."""
    if mode != "input":
        return False
    late_z = (occupancy == 2 and n_pad == WALK_LATE_PAIRED_Z_DSTATE and key.z_dtype is not None
              and not key.has_d)
    if segments > 1:
        return not late_z
    return state_mode != mode and not (key.has_d and key.z_dtype is not None) and not (
        late_z and key.start_dtype is None and key.nheads > key.ngroups)


def walk_takes_few_pairs(key: ProblemKey, mode: str, segments: int) -> bool:
    """Whether the walk takes a call of fewer than SCAN_OUT_MIN_ROW_HEADS (row, head) pairs in
    ``segments`` segments: in a bf16 mode ('input' or '2xbf16', WALK_MODES), with
    WALK_MIN_SPLIT_ROW_HEADS pairs times segments or more."""
    return (WALK_MODES.get(mode) == "bfloat16"
            and key.batch * key.nheads * segments >= WALK_MIN_SPLIT_ROW_HEADS)


def walk_pairing(mode: str, capability: int) -> tuple[int, Optional[float]]:
    """(the most padded dstate at which the walk in ``mode`` pairs its blocks, a paired round's
    cost) on a GPU of compute ``capability``: WALK_PAIRING, or on 9.x WALK_PAIRING_SM90 where it
    names the mode; (0, None) for a mode that never pairs."""
    if capability // 10 == 9 and mode in WALK_PAIRING_SM90:
        return WALK_PAIRING_SM90[mode]
    return WALK_PAIRING.get(mode, (0, None))


def walk_occupancy(key: ProblemKey, mode: str, sms: int, capability: int,
                   copies: int = 1) -> Optional[int]:
    """``scan_out_occupancy`` of ``copies`` times the unsplit walk's blocks (``walk_blocks``:
    one copy a segment, or a part of one) at the mode's paired cost, up to its most dstate
    (``walk_pairing`` on a GPU of compute ``capability``), unless from initial states with one
    of z and D in a mode of WALK_ALONE_FROM_START_WITH_Z_OR_D above SCAN_OUT_OWN_SCORES_MAX_DSTATE;
    else None: one block an SM."""
    max_dstate, paired_cost = walk_pairing(mode, capability)
    if next_pow2(key.dstate) > max_dstate:
        return None
    if (mode in WALK_ALONE_FROM_START_WITH_Z_OR_D and key.start_dtype is not None
            and next_pow2(key.dstate) > SCAN_OUT_OWN_SCORES_MAX_DSTATE
            and key.has_d != (key.z_dtype is not None)):
        return None
    return scan_out_occupancy(walk_blocks(key) * copies, sms, paired_cost)


def walk_worker_warps(mode: str, n_pad: int) -> Optional[int]:
    """The walk's worker-warps hint in ``mode`` at padded dstate ``n_pad`` (WALK_WORKER_WARPS),
    else None: the compiler's."""
    warps, least_n_pad = WALK_WORKER_WARPS.get(mode, (None, 0))
    return warps if n_pad >= least_n_pad else None


def walk_max_dstate(mode: str, capability: int) -> int:
    """The most dstate the walk takes in ``mode`` on a GPU of compute ``capability``:
    WALK_MAX_DSTATE, or from 10.0 on WALK_MAX_DSTATE_FROM_SM100 where it names the mode."""
    if capability >= 100:
        return WALK_MAX_DSTATE_FROM_SM100.get(mode, WALK_MAX_DSTATE[mode])
    return WALK_MAX_DSTATE[mode]


def walk_state_precision(key: ProblemKey, mode: str, states_mode: str,
                         occupancy: Optional[int], segments: int,
                         capability: int) -> Optional[str]:
    """The mode of the walk's state update where stages 2 and 3 run as kernels/scan_out.py,
    else None: a bf16 call in 'input' (or its opt-in '2xbf16'), an fp16 one in '2xfp16' or a
    float32 one in '3xbf16' (``WALK_MODES``) at chunk STATE_SCAN_CHUNK_SIZE, with
    SCAN_OUT_MIN_ROW_HEADS (row, head) pairs or more, or fewer split in ``segments``
    (``walk_segments``) where ``walk_takes_few_pairs``, dstate up to the mode's
    ``walk_max_dstate`` on a GPU of compute ``capability`` (the state in registers), packed
    sequences without per-sequence starts (their resets in the cumsum, kernels/chunk_cumsum.py;
    varlen states, where WALK_VARLEN_STATES lets it, from the states it enters their ends'
    chunks with, kernels/scan_out.py), not both z and D unless the walk's blocks run paired
    (``walk_occupancy``), and no chunk states handed back. The state update is in the mode
    ``state_precision`` gives the chunk states (out alone, 'input' (bf16), '2xfp16' or
    '3xbf16'; returning final states, their float32-grade mode), or, one block an SM, in the one
    WALK_STATE_UPDATE_MODES names for it at the call's padded dstate."""
    if not (WALK_MODES.get(mode) == str(key.x_dtype).removeprefix("torch.")
            and key.chunk_size == STATE_SCAN_CHUNK_SIZE
            and (key.batch * key.nheads >= SCAN_OUT_MIN_ROW_HEADS
                 or walk_takes_few_pairs(key, mode, segments))
            and next_pow2(key.dstate) <= walk_max_dstate(mode, capability)
            and not key.per_seq_start and (WALK_VARLEN_STATES or not key.varlen)
            and not key.chunk_states_returned
            and (occupancy == 2 or not (key.has_d and key.z_dtype is not None))):
        return None
    if occupancy is None:
        return WALK_STATE_UPDATE_MODES.get((states_mode, next_pow2(key.dstate)), states_mode)
    return states_mode


def walk_dispatch(key: ProblemKey, mode: str, states_mode: str, sms: int,
                  capability: int) -> tuple[Optional[str], Optional[int], int]:
    """(state update mode, occupancy hint, segments) of the walk where it takes the call on
    ``sms`` SMs of compute ``capability`` (``walk_state_precision``, ``walk_occupancy``,
    ``walk_segments``), else (None, None, 1)."""
    segments = walk_segments(key, sms, mode)
    occupancy = walk_occupancy(key, mode, sms, capability, segments)
    if walks_four_paired(key, sms, mode):
        occupancy = 2
    walk_mode = walk_state_precision(key, mode, states_mode, occupancy, segments, capability)
    return (None, None, 1) if walk_mode is None else (walk_mode, occupancy, segments)


def make_plan(key: ProblemKey, state_dtype: Optional[torch.dtype] = None,
              precision: Optional[str] = None, sms: Optional[int] = None,
              capability: Optional[int] = None) -> Plan:
    """The kernels' variants and tiles for a problem: a function of the key, of the GPU's SM
    count ``sms`` (default REFERENCE_SM_COUNT) and compute ``capability`` (default
    REFERENCE_CAPABILITY) and, on a GPU, of the user's tuning cache (CI, without a GPU,
    compiles the variants it picks for the anchor shapes on each target).
    Remembered per key and tuning sources: building one was a third of the host path's Python
    time (36 of ~114 us on a 2-core CPU machine, launches stubbed), which small problems pay in
    full (reports/h200/experiments/host_and_fp32_probe_c091e22.txt)."""
    if state_dtype is None:     # stage_pipeline passes it resolved
        state_dtype = resolve_state_dtype(None, resolve_precision(precision, key.x_dtype),
                                          key.x_dtype)
    return _plan(key, state_dtype, precision, tuning_sources(), sms or REFERENCE_SM_COUNT,
                 capability or REFERENCE_CAPABILITY)


@functools.lru_cache(maxsize=256)
def _plan(key: ProblemKey, state_dtype: torch.dtype, precision: Optional[str],
          sources: tuple, sms: int, capability: int) -> Plan:
    mode = resolve_precision(precision, key.x_dtype)
    states_mode = state_precision(mode, key.x_dtype, key.states_returned)
    fused = fuses_state_scan(key, states_mode)
    tuned = tuned_entry(tuning_key(key, mode), sources)
    if fused and not tuned:
        # A key not searched at the scan's chunk size (kernels/tune.py): compute_out takes chunk
        # 256's tiles, as the H200 A/Bs first timed them (at the first anchor 0.364 ms at chunk
        # 128, 0.291 at chunk 64; kernels/state_scan.py).
        chunk_256 = tuning_key(replace(key, chunk_size=DEFAULT_CHUNK_SIZE), mode)
        tuned = {"compute_out": tuned_entry(chunk_256, sources).get("compute_out", {})}
    wide = key.needs_int64()
    Q = key.chunk_size
    row_block = min(ROW_BLOCK, Q)
    p_pad = max(MIN_TILE, next_pow2(key.headdim))
    n_pad = max(MIN_TILE, next_pow2(key.dstate))
    p_block = min(p_pad, P_BLOCK)
    int32 = torch.int32
    has_seq = key.seq_dtype is not None
    f32 = torch.float32
    cumsum = ChunkCumsumConfig(dt_dtype=key.dt_dtype, chunk_size=Q,
                               head_block=head_block_for(key.nheads), has_bias=key.has_bias,
                               softplus=key.softplus, has_limit=key.has_limit, wide=wide,
                               flat_grid=needs_flat_grid(key.batch, key.nheads))
    per_seq_start_dtype = key.start_dtype if key.per_seq_start else f32
    # Increments summed in 'input' (bf16 x, a call that returns no states) are stored in bf16, as
    # the states they add up to are: half the traffic between the two kernels.
    increment_dtype = torch.bfloat16 if states_mode == "input" else f32
    chunk_state = ChunkStateConfig(
        x_dtype=key.x_dtype, b_dtype=key.b_dtype, seq_dtype=key.seq_dtype or int32,
        start_dtype=per_seq_start_dtype, cu_dtype=key.cu_dtype or int32, chunk_size=Q,
        row_block=row_block, p_block=p_block, n_block=min(n_pad, STATE_N_BLOCK),
        precision=states_mode, increment_dtype=increment_dtype, has_seq=has_seq,
        per_seq_start=key.per_seq_start, varlen=key.varlen, wide=wide)
    chunk_state = replace(chunk_state, **tuned.get("chunk_state", {}))
    passing_tuned = dict(tuned.get("state_passing", {}))
    start_tiles = (passing_tuned.pop("p_block", 32), passing_tuned.pop("n_block", STATE_N_BLOCK))
    pass_p, pass_n = _state_passing_tiles(key, p_pad, n_pad, start_tiles)
    passing = StatePassingConfig(start_dtype=key.start_dtype or f32, state_dtype=state_dtype,
                                 increment_dtype=increment_dtype, p_block=pass_p, n_block=pass_n,
                                 has_start=key.start_dtype is not None, varlen=key.varlen,
                                 wide=wide, **passing_tuned)
    out = ComputeOutConfig(
        x_dtype=key.x_dtype, b_dtype=key.b_dtype, c_dtype=key.c_dtype,
        z_dtype=key.z_dtype or key.x_dtype, state_dtype=state_dtype,
        seq_dtype=key.seq_dtype or int32, start_dtype=per_seq_start_dtype,
        cu_dtype=key.cu_dtype or int32, chunk_size=Q, row_block=row_block, p_block=p_block,
        n_pad=n_pad, precision=mode,
        has_d=key.has_d, has_z=key.z_dtype is not None, has_seq=has_seq,
        per_seq_start=key.per_seq_start, shared_scores=shares_scores(key), wide=wide)
    out = replace(out, **tuned.get("compute_out", {}))
    scan = None
    if fused:
        scan_tiled = tuned.get("state_scan", {})
        scan_p, scan_n = state_scan_tiles(key.batch * key.nheads, p_pad, n_pad, (
            scan_tiled.get("p_block", STATE_SCAN_TILES[0]),
            scan_tiled.get("n_block", STATE_SCAN_TILES[1])), sms)
        if capability >= 100 and key.b_dtype == f32 and Q == 128:
            scan_n = min(scan_n, STATE_SCAN_SM100_FLOAT32_B_N_BLOCK)
        scan = StateScanConfig(x_dtype=key.x_dtype, b_dtype=key.b_dtype,
                               start_dtype=key.start_dtype or f32, state_dtype=state_dtype,
                               chunk_size=Q, p_block=scan_p, n_block=scan_n,
                               chunks_per_step=STATE_SCAN_STEP_POSITIONS // Q,
                               precision=states_mode, has_start=key.start_dtype is not None,
                               wide=wide)
    walk = segment_states = entering = None
    walk_states_mode, occupancy, segments = walk_dispatch(key, mode, states_mode, sms,
                                                          capability)
    parts = segment_split(key, segments, sms, mode)
    if walk_states_mode is not None:
        # Split, every segment starts from a float32 state (the first from the call's own).
        split = segments > 1
        early = walk_updates_early(key, mode, walk_states_mode, segments, occupancy, n_pad)
        shared_scores = walk_shares_scores(key, mode, n_pad, occupancy, segments)
        walk = ScanOutConfig(x_dtype=key.x_dtype, b_dtype=key.b_dtype, c_dtype=key.c_dtype,
                             z_dtype=key.z_dtype or key.x_dtype,
                             start_dtype=f32 if split else key.start_dtype or f32,
                             chunk_size=Q, p_block=p_block, n_pad=n_pad, precision=mode,
                             state_precision=walk_states_mode,
                             has_start=split or key.start_dtype is not None, has_d=key.has_d,
                             has_z=key.z_dtype is not None,
                             shared_scores=shared_scores, wide=wide, occupancy=occupancy,
                             segmented=split, worker_warps=walk_worker_warps(mode, n_pad),
                             update_early=early,
                             x_latency=walk_x_latency(mode, n_pad, occupancy, early, key.has_d),
                             b_latency=walk_b_latency(mode, n_pad, occupancy, split,
                                                       walk_states_mode,
                                                       walks_four_paired(key, sms, mode)),
                             out_transposed=walk_out_transposed(
                                 mode, occupancy, shared_scores, n_pad, early, key.has_d,
                                 key.z_dtype is not None,
                                 not split and walk_states_mode != mode
                                 and key.start_dtype is None),
                             varlen=key.varlen)
        if key.varlen:
            # The sequences' ends alone, added to the states the walk enters their chunks with
            # (kernels.fwd_pass_state.add_sequence_end_increments); resets from the cumsum.
            chunk_state = replace(chunk_state, has_seq=False, seq_dtype=int32, cu_dtype=int32,
                                  adds_entering=True)
        if split:
            # The segments but the last, in parts, their state alone from zero.
            segment_states = replace(
                walk, start_dtype=f32, has_start=False, has_d=False, has_z=False,
                shared_scores=False, computes_out=False, update_early=False, x_latency=0,
                b_latency=0, out_transposed=False, varlen=False,
                backward=walks_states_backward(key, n_pad),
                occupancy=walk_occupancy(key, mode, sms, capability, (segments - 1) * parts))
            entering = EnteringStatesConfig(start_dtype=key.start_dtype or f32, chunk_size=Q,
                                            p_block=min(p_pad, ENTERING_P_BLOCK), n_pad=n_pad,
                                            has_start=key.start_dtype is not None, wide=wide)
    if key.seq_dtype is not None and (walk is not None or scan is not None):
        # Packed sequences: their resets in the cumsum, which every walk and the fused scan with
        # compute_out read (kernels/chunk_cumsum.py); their kernels are the unpacked call's.
        cumsum = replace(cumsum, seq_dtype=key.seq_dtype)
        out = replace(out, has_seq=False, seq_dtype=int32)
    return Plan(cumsum, chunk_state, passing, out, scan, walk, segment_states, segments, parts,
                entering)


@contextlib.contextmanager
def dispatch_rules(rules: dict):
    """This module's dispatch constants as ``rules`` ({(NAME, dict key or None): value}) set
    them, within (a dict's item in a copy of the dict); the plan caches (``_plan``, ssd_forward's
    ``_PREPARED``) are emptied going in and coming out, so that a plan made within is the rules'
    and one made after is the dispatcher's. ``mamba2-cutile ab``'s ``ssd.<NAME>=`` arms, CI's
    covering recipes and the tests of a rule not yet dispatched plan under it. No rules: the
    caches kept."""
    if not rules:
        yield
        return
    saved = []
    try:
        for (name, key), value in rules.items():
            current = globals()[name]
            saved.append((name, current))
            globals()[name] = value if key is None else {**current, key: value}
        _plan.cache_clear()
        _PREPARED.clear()
        yield
    finally:
        for name, current in reversed(saved):
            globals()[name] = current
        _plan.cache_clear()
        _PREPARED.clear()


def _check_supported(problem: SSDProblem, state_dtype) -> None:
    if problem.headdim > MAX_HEADDIM:
        raise SSDInputError(f"x: expected headdim (dimension 3) <= {MAX_HEADDIM} (the cuTile "
                            f"kernels' tiles), got headdim={problem.headdim}; split the heads")
    if problem.dstate > MAX_DSTATE:
        raise SSDInputError(f"B: expected dstate (dimension 3) <= {MAX_DSTATE} (the cuTile "
                            f"kernels hold a state row in one tile), got dstate={problem.dstate}")
    if state_dtype not in STATE_DTYPES:
        raise SSDInputError(f"state_dtype: expected one of {STATE_DTYPES}, got {state_dtype}")


def _key(problem: SSDProblem, varlen: bool, states_returned: Optional[bool],
         chunk_states_returned: bool = False) -> ProblemKey:
    """The call's key; ``wide`` when any array the kernels touch spans 2^31 elements, strides of
    the inputs included (else left to the sizes, which decide it alike for contiguous outputs)."""
    key = ProblemKey.from_problem(problem, varlen=varlen, wide=None,
                                  states_returned=states_returned,
                                  chunk_states_returned=chunk_states_returned)
    if not key.needs_int64() and needs_int64(problem.x, problem.B, problem.C, problem.z,
                                             problem.initial_states):
        key = replace(key, wide=True)
    return key


@dataclass
class StagePipeline:
    """The three kernel launches of one problem, each on the outputs of the stages before it.

    ``run_stages`` chains them; the benchmarks time each one alone with the same arguments.
    """

    problem: SSDProblem
    plan: Plan
    A: torch.Tensor
    seq_idx: Optional[torch.Tensor]
    varlen: bool

    def cumsum(self, stream=None):
        p, config = self.problem, self.plan.cumsum
        return chunk_cumsum(p.dt, self.A, config, dt_bias=p.dt_bias, dt_limit=p.dt_limit,
                            stream=stream,
                            seq_idx=self.seq_idx if config.seq_dtype is not None else None)

    def states(self, dt, log2_cumsum, stream=None):
        """(chunk_states, final_states, varlen_states); all None where kernels/scan_out.py
        computes the states and the output in one walk (``walk``), storing no chunk state."""
        p = self.problem
        if self.plan.scan_out is not None:
            return None, None, None
        if self.plan.state_scan is not None:
            return state_scan(p.x, p.B, dt, log2_cumsum, p.initial_states, self.plan.state_scan,
                              stream)
        return fwd_pass_state(
            StateInputs(x=p.x, B=p.B, dt=dt, log2_decay_cumsum=log2_cumsum, A=self.A,
                        seq_idx=self.seq_idx, start_states=p.initial_states,
                        cu_seqlens=p.cu_seqlens, per_seq_start=p.per_sequence_initial_states,
                        varlen=self.varlen),
            self.plan.chunk_state, self.plan.state_passing, stream)

    def _d(self):
        # D per head reaches the kernels as a (nheads, headdim) view of stride 0 along headdim:
        # out equal bit for bit to a copied D, without the copy's launch (24 us of host time a
        # call on the H200, reports/h200/experiments/host_parts_2302d94.txt).
        p = self.problem
        if p.D is None:
            return None
        return p.D.to(torch.float32).reshape(p.nheads, -1).expand(p.nheads, p.headdim)

    def walk(self, dt, log2_cumsum, stream=None):
        """(out, final_states, varlen_states or None) of kernels/scan_out.py's walk, where the
        plan has one; split in ``plan.walk_segments``, after the states-only walk (of
        ``plan.segment_split`` parts a segment) and the segments' entering states; varlen
        states from the states the walk enters their ends' chunks with, and chunk_state over
        the ends (``plan.scan_out.varlen``)."""
        p, plan = self.problem, self.plan
        varlen = {}
        if plan.scan_out.varlen:
            ends = sequence_ends(p.cu_seqlens)
            Q = plan.scan_out.chunk_size
            varlen = dict(varlen_offsets=sequence_end_offsets(ends, -(-p.seqlen // Q), Q),
                          varlen_states=torch.empty(p.nseq, p.nheads, p.headdim, p.dstate,
                                                    device=p.x.device, dtype=torch.float32))
        out, finals = self._walk_out(dt, log2_cumsum, stream, varlen)
        if not varlen:
            return out, finals, None
        add_sequence_end_increments(p.x, p.B, dt, log2_cumsum, self.A, ends,
                                    varlen["varlen_states"], plan.chunk_state, stream)
        return out, finals, varlen["varlen_states"]

    def _walk_out(self, dt, log2_cumsum, stream, varlen: dict):
        """(out, final_states) of the walk (``walk``); ``varlen``: scan_out's varlen arrays."""
        p, plan = self.problem, self.plan
        segments, split = plan.walk_segments, plan.segment_split
        if segments == 1:
            return scan_out(p.x, p.B, p.C, dt, log2_cumsum, p.initial_states, self._d(), p.z,
                            plan.scan_out, stream, **varlen)
        # Parts of whole steps, ``split`` a segment (kernels/entering_states.py).
        steps = -(-p.seqlen // (plan.scan_out.chunk_size * plan.scan_out.chunks_per_step))
        part_steps = -(-steps // (segments * split))
        parts = (segments - 1) * split
        _, ends = scan_out(p.x, p.B, p.C, dt, log2_cumsum, None, None, None,
                           plan.segment_states, stream, parts, part_steps)
        entering = segment_entering_states(ends, log2_cumsum, p.initial_states, segments, split,
                                           part_steps * plan.scan_out.chunks_per_step,
                                           plan.entering_states, stream)
        out, finals = scan_out(p.x, p.B, p.C, dt, log2_cumsum, entering, self._d(), p.z,
                               plan.scan_out, stream, segments, split * part_steps, **varlen)
        return out, finals.view(p.batch, segments, *finals.shape[1:])[:, -1].contiguous()

    def out(self, dt, log2_cumsum, chunk_states, stream=None):
        p = self.problem
        if self.plan.scan_out is not None:
            return self.walk(dt, log2_cumsum, stream)[0]
        return compute_out(
            OutInputs(x=p.x, B=p.B, C=p.C, dt=dt, log2_decay_cumsum=log2_cumsum, A=self.A,
                      chunk_states=chunk_states, D=self._d(), z=p.z,
                      seq_idx=self.seq_idx if self.plan.out.has_seq else None,
                      start_states=p.initial_states if p.per_sequence_initial_states else None,
                      cu_seqlens=p.cu_seqlens),
            self.plan.out, stream)


def stage_pipeline(problem: SSDProblem, state_dtype=None, precision: Optional[str] = None,
                   varlen: Optional[bool] = None,
                   states_returned: Optional[bool] = None,
                   chunk_states: bool = False) -> StagePipeline:
    """Check what the kernels support and pick their variants for a validated problem.

    varlen: compute varlen_states (default: whenever cu_seqlens is given). states_returned:
    whether the caller uses any states (default: whether the problem asks for final or varlen
    states; ``ProblemKey.states_returned``). chunk_states: the chunk states are wanted too (no
    walk of kernels/scan_out.py, which stores none).
    """
    state_dtype = resolve_state_dtype(state_dtype, resolve_precision(precision, problem.x.dtype),
                                      problem.x.dtype)
    _check_supported(problem, state_dtype)
    require_gpu(problem.x)
    varlen = problem.cu_seqlens is not None if varlen is None else bool(varlen and
                                                                       problem.cu_seqlens is not None)
    device = problem.x.device
    plan = make_plan(_key(problem, varlen, states_returned, chunk_states), state_dtype,
                     precision, sm_count(device), compute_capability(device))
    return StagePipeline(problem, plan, problem.A.to(torch.float32), kernel_seq_idx(problem),
                         varlen)


def kernel_seq_idx(p: SSDProblem) -> Optional[torch.Tensor]:
    """The sequence index the kernels read: seq_idx, or the one cu_seqlens implies (offsets that
    passed validate's checks, or ``kernels.contract.PackedIndex``'s stand-ins)."""
    if p.seq_idx is not None or p.cu_seqlens is None:
        return p.seq_idx
    return p.resolved_seq_idx(p.cu_seqlens.dtype)


def run_stages(problem: SSDProblem, state_dtype=None, precision: Optional[str] = None,
               varlen: Optional[bool] = None, states_returned: Optional[bool] = None,
               chunk_states: bool = False) -> SSDResult:
    """All three kernels on a validated problem; every stage in ``stages`` (chunk_states None
    where the walk of kernels/scan_out.py runs, unless ``chunk_states`` asks for them)."""
    return launch_stages(stage_pipeline(problem, state_dtype, precision, varlen, states_returned,
                                        chunk_states))


def launch_stages(pipeline: StagePipeline) -> SSDResult:
    """``run_stages`` on a pipeline already planned."""
    # Looked up once, not per launch: 23 us a lookup under cProfile on the H200's host, of the
    # ~650 us a profiled b1 L512 call took there, which small problems pay in full
    # (reports/h200/experiments/host_profile_cc5b8d4.txt).
    stream = launch_stream(pipeline.problem.x)
    dt, log2_cumsum = pipeline.cumsum(stream)
    if pipeline.plan.scan_out is not None:
        chunk_states = None
        out, final_states, varlen_states = pipeline.walk(dt, log2_cumsum, stream)
    else:
        chunk_states, final_states, varlen_states = pipeline.states(dt, log2_cumsum, stream)
        out = pipeline.out(dt, log2_cumsum, chunk_states, stream)
    return SSDResult(out=out, final_states=final_states, varlen_states=varlen_states,
                     stages={"dt": dt, "log2_decay_cumsum": log2_cumsum[..., 0, :],
                             "chunk_states": chunk_states})


@torch.compiler.disable
def ssd_forward_stages(problem: SSDProblem, *, state_dtype=None,
                       precision: Optional[str] = None) -> SSDResult:
    """The kernels on a validated ``SSDProblem`` (``kernels.contract.validate`` or
    ``properties.problems.build_problem``): out, final_states, varlen_states (when cu_seqlens is
    given) and the stages dt, log2_decay_cumsum, chunk_states in their shared layouts, the
    states computed as for a call that returns them (whatever the problem's return flags).
    Inputs that require grad are read detached; nothing here has a grad_fn."""
    if problem.chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise SSDInputError(f"chunk_size: expected one of {SUPPORTED_CHUNK_SIZES} (the cuTile "
                            f"kernels), got {problem.chunk_size}")
    return run_stages(NoBackward.detached(problem)[0], state_dtype=state_dtype,
                      precision=precision, states_returned=True, chunk_states=True)


def default_chunk_size(problem: SSDProblem, precision: Optional[str] = None) -> int:
    """The chunk size ``ssd_forward(chunk_size=None)`` runs ``problem`` at (its own chunk_size
    is ignored; its return_varlen_states counts): STATE_SCAN_CHUNK_SIZE where the fused state
    scan or the walk of kernels/scan_out.py takes the call (``fuses_state_scan``,
    ``walk_state_precision``), else DEFAULT_CHUNK_SIZE."""
    # The rule reads no index width: the key skips _key's 2^31 checks of the tensors.
    key = ProblemKey.from_problem(replace(problem, chunk_size=STATE_SCAN_CHUNK_SIZE),
                                  problem.return_varlen_states and problem.cu_seqlens is not None,
                                  wide=False)
    mode = resolve_precision(precision, key.x_dtype)
    states_mode = state_precision(mode, key.x_dtype, key.states_returned)
    device = problem.x.device
    fused = (fuses_state_scan(key, states_mode)
             or walk_dispatch(key, mode, states_mode, sm_count(device) or REFERENCE_SM_COUNT,
                              compute_capability(device) or REFERENCE_CAPABILITY)[0] is not None)
    return STATE_SCAN_CHUNK_SIZE if fused else DEFAULT_CHUNK_SIZE


# torch.compile runs both entry points as they run eagerly instead of tracing their host code
# at every call site: validation, plans memoized in lru_caches (which dynamo ignores, warning of
# silent incorrectness), pinned copies and events, then launches it cannot trace. The price:
# this module imports torch._dynamo (1.3 -> 2.6 s to import it on a 2-core CPU).
@torch.compiler.disable
def ssd_forward(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None,
                initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                dt_limit=(0.0, math.inf), return_final_states=False, return_varlen_states=False,
                *, state_dtype=None, precision: Optional[str] = None):
    """Mamba-2 SSD forward: out [, final_states] [, varlen_states], as mamba_ssm returns them.

    Arguments as ``mamba_chunk_scan_combined`` (kernels.contract documents them). chunk_size None
    picks per call (``default_chunk_size``: 64 with the fused state scan for calls with many
    (row, head) pairs that return out alone, or from 128 pairs the walk of kernels/scan_out.py
    for bf16 and fp16 calls that return out alone or with final states, and for bf16 calls with
    fewer pairs and long enough sequences the walk split along the sequence
    (``walk_segments``), else 256); an explicit one is honoured, so a drop-in call passing
    mamba_ssm's 256 runs none of the chunk-64 kernels (README, 'Using the kernels'); supported:
    64, 128, 256. headdim and dstate up to 256. Inputs may be non-contiguous (the kernels read
    through strides).
    state_dtype: dtype of the stored chunk states (default: x's dtype in 'input', else float32);
    precision: 'auto' (default), 'ieee', '3xtf32', 'tf32', 'input', '2xbf16', '3xbf16', '2xfp16'
    or '3xfp16' (see the module docstring).
    CUDA graphs: a call can be captured (``torch.cuda.graph``) after a warm-up call of its
    signature outside capture (which compiles its kernels); under capture A's values are not read
    back, a head with A > 0 makes its outputs NaN, and seq_idx and cu_seqlens are refused
    (kernels.contract, 'Decay').
    Forward only: inputs that require grad are read detached, and where grad mode is on the
    outputs carry a backward that raises (``NoBackward``), so no gradient goes silently missing.
    """
    problem = validate(x, dt, A, B, C, DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size,
                       D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                       cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit,
                       return_final_states=return_final_states,
                       return_varlen_states=return_varlen_states,
                       supported_chunk_sizes=SUPPORTED_CHUNK_SIZES,
                       implementation="the cuTile kernels", defer_value_checks=True)
    problem, graded = NoBackward.detached(problem)
    if graded and torch.is_grad_enabled():
        launch = functools.partial(_launch_validated, problem, chunk_size is None, state_dtype,
                                   precision)
        return NoBackward.apply(launch, tuple(graded), *graded.values())
    return _launch_validated(problem, chunk_size is None, state_dtype, precision)


def _launch_validated(problem: SSDProblem, chunk_picked: bool, state_dtype, precision):
    """ssd_forward's outputs for a validated call (its chunk size picked here if ``chunk_picked``,
    planned once per signature)."""
    prepared_key = _prepared_key(problem, chunk_picked, state_dtype, precision)
    try:
        prepared = _PREPARED.get(prepared_key) if prepared_key is not None else None
    except TypeError:     # an unhashable option: the unmemoized path says what is wrong with it
        prepared_key = prepared = None
    if prepared is None:
        if chunk_picked:
            picked = default_chunk_size(problem, precision)
            if picked != problem.chunk_size:
                problem = replace(problem, chunk_size=picked)
        pipeline = stage_pipeline(problem, state_dtype=state_dtype, precision=precision,
                                  varlen=problem.return_varlen_states)
        if prepared_key is not None:
            if len(_PREPARED) >= PREPARED_MAX:
                _PREPARED.clear()
            _PREPARED[prepared_key] = (problem.chunk_size, pipeline.plan)
    else:
        picked, plan = prepared
        if picked != problem.chunk_size:
            problem = replace(problem, chunk_size=picked)
        pipeline = StagePipeline(problem, plan, problem.A.to(torch.float32),
                                 kernel_seq_idx(problem), problem.return_varlen_states)
    result = launch_stages(pipeline)
    # The kernels are queued; the verdicts on A's, seq_idx's and cu_seqlens' values decide
    # whether their outputs are returned.
    problem.confirm_values()
    return pack_outputs(problem, result.out, result.final_states, result.varlen_states)


class NoBackward(torch.autograd.Function):
    """ssd_forward's outputs as autograd sees them where grad mode is on and an input requires
    grad. The kernels have no backward pass: outputs without a grad_fn would leave those inputs'
    gradients silently missing (x's, say, while the rest of a model still trains), so a
    backward that reaches these raises, naming the inputs. The forward is the plain call's."""

    DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

    @staticmethod
    def detached(problem: SSDProblem) -> tuple[SSDProblem, dict]:
        """(the problem with its inputs that require grad detached, name -> each such input).
        The kernels get the detached ones (the same memory), under no_grad too: cuTile may read
        a tensor through __cuda_array_interface__, which torch refuses for one that requires
        grad. The call's signature describes nothing detach changes."""
        graded = {name: t for name in NoBackward.DIFFERENTIABLE
                  if (t := getattr(problem, name)) is not None and t.requires_grad}
        if not graded:
            return problem, graded
        return replace(problem, **{name: t.detach() for name, t in graded.items()}), graded

    @staticmethod
    def forward(ctx, launch, names, *inputs):
        ctx.names = names
        return launch()

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"ssd_forward: expected no backward through its outputs (the cuTile kernels are "
            f"forward-only), got one for {', '.join(ctx.names)}, which require grad. Call it "
            f"under torch.no_grad() or torch.inference_mode() for inference; to train, take the "
            f"gradients from an implementation with a backward (mamba_ssm's "
            f"mamba_chunk_scan_combined)")


# ssd_forward's chunk size and plan by the call's signature (kernels.contract.call_signature:
# everything about a call but its tensors' values) and what else picks them. A call seen before
# skips default_chunk_size and stage_pipeline, which read no values either. With validate's own
# memo of passed signatures, on the H200's host a b1 L512 call's host time went from 479 to 324
# us, and calls whose GPU waits on the host, timed alone, 0.67-0.71x (b1 L512 0.448 -> 0.307 ms;
# reports/h200/experiments/host_ab_443387c.txt).
_PREPARED: dict = {}
PREPARED_MAX = 256


def _prepared_key(problem: SSDProblem, chunk_picked: bool, state_dtype, precision):
    """ssd_forward's memo key for a validated call, or None where it has no signature."""
    if problem.signature is None:
        return None
    return problem.signature, chunk_picked, state_dtype, precision, tuning_sources()
