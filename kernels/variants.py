"""The kernel variants CI compiles without a GPU, and the compiler driver.

The covering set is a list of problem recipes (``COVERING_KEYS``) run through the dispatcher
(``kernels.ssd.make_plan``), so CI compiles the kernel configs real calls launch: the anchor
shapes in bf16 (plain and as a Mamba-2 layer calls them), the >2^31-element case, and small recipes
chosen so that every dtype, chunk size, headdim, dstate, precision mode and feature flag appears at
least once, several pairwise (a recipe with cu_seqlens has batch 1, as such calls do). Each
target's set is what the dispatcher picks on a GPU of its compute capability
(``covering_variants``): sm_100's differs where ``kernels.ssd.walk_max_dstate`` does, sm_90's
where ``kernels.ssd.walk_pairing`` does.

A variant is a kernel config with the signature its launch specializes it on: the host code runs
each recipe on meta tensors with ct.launch recording (``launch_signatures``), and every array
argument gets the constraints cuTile's JIT reads off a tensor (``tile_ops.launch_constraint``:
unit strides and extents as constants, 16-byte strides and extents divisible by 16 declared),
which reproduce the kernel names ncu recorded on the H200 (tests/test_compile.py). A config's own
``signature()`` declares only what every contiguous tensor guarantees; compiled from it, the
first anchor's compute_out reads its tiles without TMA ("stride not 16-byte aligned").

Each variant is compiled for sm_80, sm_90 and sm_100 from the bytecode
``cuda.tile.compilation.export_kernel`` writes for that signature, by tileiras with cuTile's own
flags (-O3 --lineinfo); on sm_90 tileiras also reports where each MMA landed and how each tile
moves (``--remarks=all``). ``violations`` holds a variant to two promises: a precision mode that
promises tensor cores has every MMA on them, and the MMA kernels move every tile of more than one
element by TMA (the 64-bit-indexed variants excepted: a TMA descriptor cannot encode their
extents). The base address is taken as 16-byte aligned, as torch allocates; a view at an odd
offset launches another specialization than CI compiles. Each compile also reports a thread's
registers and spilled bytes, a block's shared memory and its threads, read from the cubin
(``kernel_resources``).

Beyond the covering set, ``--hinted`` compiles every kernel config with an occupancy hint that
the dispatcher picks over a grid of calls (``HINT_SWEEP``) and the covering set lacks
(``hinted_beyond_covering``), to find hints a compile does not hold (``occupancy_shortfall``)
and the spills they cost; not in CI (~200 configs).

    python3 -m kernels.variants [--target sm_90 ...] [--jobs 2] [--list] [--hinted] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import inspect
import io
import itertools
import linecache
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context

import cuda.tile as ct
import torch
from cuda.tile.compilation import ArrayConstraint, KernelSignature, export_kernel

from kernels.contract import SSDProblem
from kernels.device import tileiras_env, tileiras_path
from kernels.ssd import (DEFAULT_CHUNK_SIZE, REFERENCE_CAPABILITY, STATE_SCAN_CHUNK_SIZE,
                         ProblemKey, StagePipeline, dispatch_rules, launch_stages, make_plan)
from kernels.tile_ops import kernel_signature, launch_constraint

TARGETS = ("sm_80", "sm_90", "sm_100")
# Shared memory one block may use (CUDA C++ Programming Guide, compute capabilities table):
# 163 KB on 8.0, 227 KB on 9.0 and 10.0. A kernel that takes more fails at launch.
MAX_BLOCK_SHARED_BYTES = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024}
# CUDA reserves 1 KB of an SM's shared memory a resident block (the same guide, from 8.0 on), the
# difference between the SM's (164, 228 and 228 KB) and a block's most: an SM holds at most
# SM / (a block's own + 1 KB) blocks at once.
RESERVED_BLOCK_SHARED_BYTES = 1024
SM_SHARED_BYTES = {target: most + RESERVED_BLOCK_SHARED_BYTES
                   for target, most in MAX_BLOCK_SHARED_BYTES.items()}
# An SM's 32-bit registers and resident threads on 8.0, 9.0 and 10.0 (the same table); registers
# go to a warp in units of 256, so a thread's count rounds up to a multiple of 8.
SM_REGISTERS, SM_THREADS, REGISTER_UNIT = 65536, 2048, 256
REMARK_TARGET = "sm_90"
# cuTile's compile flags for a kernel with default options (cuda/tile/_compile.py: compile_cubin).
TILEIRAS_FLAGS = ("-O3", "--lineinfo")
TENSOR_CORE_PRECISIONS = ("3xtf32", "tf32", "input", "2xbf16", "3xbf16", "2xfp16", "3xfp16")
MMA_KERNELS = ("chunk_state", "state_scan", "chunk_scores", "compute_out", "scan_out",
               "segment_states")

f32, bf16, f16, i32, i64 = torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64


def _anchor(batch, seqlen, nheads, ngroups, **kw) -> ProblemKey:
    kw = dict(dict(x_dtype=bf16, b_dtype=bf16, c_dtype=bf16), **kw)
    return ProblemKey(batch=batch, seqlen=seqlen, nheads=nheads, headdim=64, dstate=128,
                      ngroups=ngroups, chunk_size=DEFAULT_CHUNK_SIZE, **kw)


def _small(x, bc, Q, H, P, N, G, **kw) -> ProblemKey:
    b_dtype, c_dtype = bc if isinstance(bc, tuple) else (bc, bc)
    batch = 1 if kw.get("cu_dtype") else 2        # cu_seqlens packs sequences into batch 1
    return ProblemKey(batch=batch, seqlen=1000, nheads=H, headdim=P, dstate=N, ngroups=G,
                      chunk_size=Q, x_dtype=x, b_dtype=b_dtype, c_dtype=c_dtype, **kw)


# A packed call returning varlen states at chunk 64, too few pairs for a fused kernel.
PACKED_VARLEN = _small(bf16, bf16, 64, 8, 128, 32, 2, z_dtype=bf16, seq_dtype=i32, cu_dtype=i32,
                       nseq=4, varlen=True, has_d=True)


# (name, key, state_dtype, precision[, knobs]); None = the default (for precision, what 'auto'
# picks); knobs ({plan field: {config field: value}}) override what the dispatcher picked, their
# "ssd" item ({NAME: value}) plans the recipe under those dispatch constants
# (``kernels.ssd.dispatch_rules``: a rule written but not yet dispatched).
COVERING_KEYS = (
    ("anchor-b8-L4096-h64", _anchor(8, 4096, 64, 1), None, None),
    ("anchor-b4-L8192-h32-g8", _anchor(4, 8192, 32, 8), None, None),
    ("anchor-b1-L65536-h64", _anchor(1, 65536, 64, 1), None, None),
    # A call that returns out alone: chunk_state in 'input' (kernels.ssd.state_precision).
    ("anchor-b8-L4096-h64-out-only", replace(_anchor(8, 4096, 64, 1, has_d=True),
                                             states_returned=False), None, None),
    # D per channel is read as given; D per head as a stride-0 view (kernels.ssd.StagePipeline).
    ("anchor-b8-L4096-h64-z-d-per-channel-out-only",
     replace(_anchor(8, 4096, 64, 1, has_d=True, d_per_channel=True, z_dtype=bf16),
             states_returned=False), None, None),
    # chunk_size=None's pick for these out-alone calls, chunk 64: from 128 (row, head) pairs the
    # walk of kernels/scan_out.py (kernels.ssd.walk_state_precision; shared scores, or its own
    # for 32 heads in 8 groups and at dstate 64), else the fused state scan two chunks a step
    # (kernels.ssd.fuses_state_scan): 64 x 64 tiles for one row of 64 heads
    # (kernels.ssd.state_scan_tiles), 64 x 128 at dstate 256 there. The walk's blocks run two to
    # an SM at the first anchor's 512 (on the reference 132 SMs:
    # kernels.ssd.scan_out_occupancy), and so also with both z and D; one to an SM for 32 heads
    # in 8 groups, and for 2 rows x 64 heads, which with both z and D keep the scan and
    # compute_out. At an explicit chunk 128, the state scan one chunk a step at the chunk-128
    # table's tiles (64 x 64 for 32 heads in 8 groups).
    *((f"anchor-{name}-q{q}-out-only-fused",
       replace(key, chunk_size=q, states_returned=False), None, None)
      for q in (64, 128)
      for name, key in (("b8-L4096-h64", _anchor(8, 4096, 64, 1)),
                        ("b1-L8192-h64", _anchor(1, 8192, 64, 1)),
                        ("b1-L8192-h64-n256", replace(_anchor(1, 8192, 64, 1), dstate=256)),
                        ("b4-L8192-h32-g8", _anchor(4, 8192, 32, 8)))),
    *((f"anchor-b8-L4096-h64-q64-out-only-fused-{name}",
       replace(_anchor(8, 4096, 64, 1), chunk_size=64, states_returned=False, **kw), None, None)
      for name, kw in (("start-d", dict(start_dtype=f32, has_d=True)), ("z", dict(z_dtype=bf16)),
                       ("d-per-channel", dict(has_d=True, d_per_channel=True)),
                       ("z-d-per-channel", dict(has_d=True, d_per_channel=True, z_dtype=bf16)),
                       ("n64", dict(dstate=64)))),
    # 64 heads in 8 groups: the walk's own scores where 8 blocks read each group's tile
    # (kernels.ssd.walk_shares_scores), out transposed without D, in out's orientation with it.
    *((f"anchor-b8-L4096-h64-g8-q64-out-only-fused{name}",
       replace(_anchor(8, 4096, 64, 8), chunk_size=64, states_returned=False, **kw), None, None)
      for name, kw in (("", {}), ("-d", dict(has_d=True)))),
    ("anchor-b2-L4096-h64-q64-out-only-fused-z-d-per-channel",
     replace(_anchor(2, 4096, 64, 1, has_d=True, d_per_channel=True, z_dtype=bf16),
             chunk_size=64, states_returned=False), None, None),
    # Calls that return final states, from 128 (row, head) pairs at chunk 64: the walk with its
    # state update in '3xbf16' (kernels.ssd.walk_state_precision), paired and alone.
    *((f"anchor-{name}-q64-final-states-walk", replace(key, chunk_size=64), None, None)
      for name, key in (("b8-L4096-h64", _anchor(8, 4096, 64, 1)),
                        ("b4-L8192-h32-g8", _anchor(4, 8192, 32, 8)))),
    # dstate 256 walks in bf16, one block an SM (kernels.ssd.WALK_MAX_DSTATE): out alone and
    # with final states, and split where few pairs have long sequences.
    *((f"anchor-b8-L4096-h64-q64-n256-{name}-walk",
       replace(_anchor(8, 4096, 64, 1), dstate=256, chunk_size=64, states_returned=returned),
       None, None)
      for name, returned in (("out-only", False), ("final-states", True))),
    ("b1-L65536-h64-q64-n256-out-only-walk-segments",
     replace(_anchor(1, 65536, 64, 1), dstate=256, chunk_size=64, states_returned=False),
     None, None),
    # Fewer pairs in sequences long enough to split (kernels.ssd.walk_segments): the states-only
    # walk of all segments but the last, then the walk from their entering states; with final
    # states (the third anchor's 64 heads, two segments) and out alone from bf16 initial states
    # (32 heads, four segments; kernels/entering_states.py reads them), out alone with D in four
    # segments paired, B loaded with its latency hint (kernels.ssd.walks_four_paired; after the
    # 32 heads, whose names its shared variants keep), and past 2^31 elements. The states-only
    # walk runs backward from dstate 128, forward at 64 and 32 (kernels.ssd.walks_states_backward).
    ("b1-L65536-h64-q64-final-states-walk-segments", replace(_anchor(1, 65536, 64, 1),
                                                             chunk_size=64), None, None),
    *((f"b1-L65536-h64-q64-n{dstate}-out-only-walk-segments",
       replace(_anchor(1, 65536, 64, 1), dstate=dstate, chunk_size=64, states_returned=False),
       None, None)
      for dstate in (64, 32)),
    ("b1-L65536-h32-q64-out-only-walk-segments-start",
     replace(_anchor(1, 65536, 32, 1, start_dtype=bf16), chunk_size=64, states_returned=False),
     None, None),
    # With z and without D, paired at dstate 128: the state updated at the step's end
    # (kernels.ssd.walk_updates_early), reading the shared scores, or in 8 groups its own with
    # out transposed (kernels.ssd.walk_out_transposed).
    *((f"b1-L65536-h32{name}-q64-z-out-only-walk-segments",
       replace(_anchor(1, 65536, 32, groups, z_dtype=bf16), chunk_size=64,
               states_returned=False), None, None)
      for name, groups in (("", 1), ("-g8", 8))),
    # Unsplit returning final states with z, paired at dstate 128: without D updated at the
    # step's end too, out transposed reading the shared scores (with D too), in out's orientation
    # computing its own in 16 groups (kernels.ssd.walk_out_transposed).
    *((f"anchor-b8-L4096-h64{name}-q64-z-final-states-walk",
       replace(_anchor(8, 4096, 64, groups, z_dtype=bf16, has_d=has_d), chunk_size=64),
       None, None)
      for name, groups, has_d in (("", 1, False), ("-g16", 16, False), ("-d", 1, True))),
    ("b1-L65536-h64-q64-d-out-only-walk-four-segments",
     replace(_anchor(1, 65536, 64, 1, has_d=True), chunk_size=64, states_returned=False),
     None, None),
    ("int64-b1-L524288-h64-q64-out-only-walk-segments",
     replace(_anchor(1, 524288, 64, 1), chunk_size=64, states_returned=False), None, None),
    # fp16 x in its '2xfp16' default walks too (kernels.ssd.WALK_MODES), one block an SM, but
    # two up to dstate 64 (kernels.ssd.WALK_PAIRING), on sm_90 up to 128, out transposed there
    # (kernels.ssd.WALK_PAIRING_SM90): out alone (states in '2xfp16') and with final states
    # ('3xfp16'), at dstate 256 with 8 worker warps (kernels.ssd.WALK_WORKER_WARPS); paired, z
    # and D too. One block an SM at dstate 64 (fewer pairs) its state update runs in '3xfp16'
    # (kernels.ssd.WALK_STATE_UPDATE_MODES).
    *((f"anchor-b8-L4096-h64-q64-fp16{n}-{name}-walk",
       replace(_anchor(8, 4096, 64, 1, x_dtype=f16, b_dtype=f16, c_dtype=f16), chunk_size=64,
               dstate=dstate, states_returned=returned), None, None)
      for n, dstate in (("", 128), ("-n64", 64), ("-n256", 256))
      for name, returned in (("out-only", False), ("final-states", True))),
    ("anchor-b8-L4096-h64-q64-fp16-z-d-walk",
     replace(_anchor(8, 4096, 64, 1, x_dtype=f16, b_dtype=f16, c_dtype=f16, z_dtype=f16,
                     has_d=True), chunk_size=64, states_returned=False), None, None),
    # float32 x walks in '3xbf16' up to dstate 64 (its state update in '3xbf16' with or without
    # final states): one block an SM with 8 worker warps at 64, two with the compiler's 4 at 32
    # (kernels.ssd.WALK_WORKER_WARPS, WALK_PAIRING). On sm_100 it walks up to 32
    # (kernels.ssd.walk_max_dstate): the 64 recipe there runs the two state kernels and
    # compute_out at chunk 64.
    *((f"anchor-b8-L4096-h64-q64-fp32-n{dstate}-out-only-walk",
       replace(_anchor(8, 4096, 64, 1, x_dtype=f32, b_dtype=f32, c_dtype=f32), chunk_size=64,
               dstate=dstate, states_returned=False), None, None)
      for dstate in (64, 32)),
    # One block an SM where two rows of 64 heads take one round either way: fp16's dstate-64
    # walk, its state update in '3xfp16', fp16's dstate-128 walk in out's orientation (with
    # final states B's load latency hint, kernels.ssd.walk_b_latency), and float32's dstate-32
    # walk.
    *((f"anchor-b2-L4096-h64-q64-{name}-walk-alone",
       replace(_anchor(2, 4096, 64, 1, x_dtype=dtype, b_dtype=dtype, c_dtype=dtype),
               chunk_size=64, dstate=dstate, states_returned=returned), None, None)
      for name, dtype, dstate, returned in (
          ("fp16-n64-out-only", f16, 64, False), ("fp16-n128-out-only", f16, 128, False),
          ("fp16-n128-final-states", f16, 128, True), ("fp32-n32-out-only", f32, 32, False))),
    # Packed sequences walk in the unpacked call's kernels, their resets in chunk_cumsum's
    # cumsum (kernels.ssd.walk_state_precision, kernels/chunk_cumsum.py): seq_idx in int32 out
    # alone paired, in int64 split from initial states with final states.
    ("anchor-b8-L4096-h64-q64-packed-out-only-walk",
     replace(_anchor(8, 4096, 64, 1, seq_dtype=i32), chunk_size=64, states_returned=False),
     None, None),
    ("b1-L65536-h64-q64-packed-start-final-states-walk-segments",
     replace(_anchor(1, 65536, 64, 1, seq_dtype=i64, start_dtype=f32), chunk_size=64), None,
     None),
    # Packed prefills by cu_seqlens returning varlen states (bench --shapes packed's layers) where
    # the walk takes them (kernels.ssd.WALK_VARLEN_STATES, off until a GPU runs them): it stores
    # the state entering each end's chunk, chunk_state adds the ends' increments
    # (kernels.fwd_pass_state.add_sequence_end_increments); unsplit at 128 heads in 8 groups,
    # split into four segments at 80 heads.
    *((f"b1-L16384-h{nheads}{name}-q64-packed-varlen-layer-walk{walk}",
       replace(_anchor(1, 16384, nheads, groups, seq_dtype=i32, cu_dtype=i32, nseq=8,
                       varlen=True, has_d=True, has_bias=True, softplus=True), chunk_size=64),
       None, None, {"ssd": {"WALK_VARLEN_STATES": True}})
      for nheads, name, groups, walk in ((128, "-g8", 8, ""), (80, "", 1, "-segments"))),
    ("int64-b1-L139264-h256-q64-out-only-fused",
     replace(_anchor(1, 139264, 256, 1), chunk_size=64, states_returned=False), None, None),
    # Past 65,535 rows x head blocks chunk_cumsum's grid is flat
    # (kernels.chunk_cumsum.needs_flat_grid): a batch of short sequences.
    ("b65536-L64-h8-flat-cumsum-grid", replace(_small(bf16, bf16, 64, 8, 32, 64, 1),
                                               batch=65536, seqlen=64), None, None),
    ("anchor-b8-L4096-h64-layer", _anchor(8, 4096, 64, 1, has_d=True, has_bias=True,
                                          softplus=True), None, None),
    ("int64-b1-L139264-h256", _anchor(1, 139264, 256, 1, has_d=True), None, None),
    ("fp32-q64-ieee-all-flags", _small(f32, f32, 64, 4, 32, 16, 1, z_dtype=f32, has_d=True,
                                       has_bias=True, softplus=True, has_limit=True,
                                       start_dtype=f32, seq_dtype=i32), f32, "ieee"),
    ("fp32-q128-3xtf32-varlen", _small(f32, f32, 128, 8, 64, 32, 2, start_dtype=f32,
                                       seq_dtype=i32, cu_dtype=i32, nseq=5, per_seq_start=True,
                                       varlen=True), f32, "3xtf32"),
    ("fp32-q256-tf32-int64", _small(f32, f32, 256, 8, 128, 256, 8, softplus=True,
                                    start_dtype=bf16, wide=True), bf16, "tf32"),
    ("fp32-q64-3xtf32-int64", _small(f32, f32, 64, 4, 64, 128, 1, has_d=True, wide=True),
     f32, "3xtf32"),
    ("fp16-q64-input", _small(f16, f16, 64, 16, 64, 64, 2, dt_dtype=f16, z_dtype=f16,
                              has_d=True, has_limit=True, start_dtype=f32, seq_dtype=i64),
     f16, "input"),
    ("bf16x-fp32bc-q128-3xtf32-varlen", _small(bf16, f32, 128, 16, 128, 128, 16, dt_dtype=bf16,
                                               z_dtype=bf16, start_dtype=bf16, seq_dtype=i64,
                                               cu_dtype=i64, nseq=3, per_seq_start=True,
                                               varlen=True), f32, "3xtf32"),
    ("bf16-q256-ieee", _small(bf16, bf16, 256, 8, 32, 64, 1, has_d=True, has_bias=True,
                              start_dtype=bf16), bf16, "ieee"),
    ("fp16x-bf16b-fp16c-q128-tf32", _small(f16, (bf16, f16), 128, 8, 64, 16, 4, z_dtype=f16),
     f32, "tf32"),
    ("bf16-q64-input-packed", PACKED_VARLEN, bf16, "input"),
    # state_passing's A/B knob: its varlen loop stores entering states, the host finishes them.
    ("bf16-q64-input-packed-varlen-entering", PACKED_VARLEN, bf16, "input",
     {"state_passing": {"varlen_entering": True}}),
    ("anchor-b8-L4096-h64-2xbf16", _anchor(8, 4096, 64, 1), f32, "2xbf16"),
    # bf16 x walks in '2xbf16' where a call opts in (kernels.ssd.WALK_MODES), its state update in
    # '3xbf16' out alone and with final states (kernels.ssd.state_precision), two blocks an SM up
    # to dstate 128 where that takes fewer rounds (kernels.ssd.WALK_PAIRING: 8 rows of 64 heads),
    # and so with both z and D; one an SM at 256, and at 2 rows of 64 heads.
    *((f"anchor-b{batch}-L4096-h64-q64-2xbf16{n}-{name}-walk",
       replace(_anchor(batch, 4096, 64, 1), chunk_size=64, dstate=dstate,
               states_returned=returned), f32, "2xbf16")
      for batch, n, dstate in ((8, "", 128), (8, "-n64", 64), (8, "-n256", 256), (2, "", 128),
                               (2, "-n64", 64))
      for name, returned in (("out-only", False), ("final-states", True))),
    ("anchor-b8-L4096-h64-q64-2xbf16-z-d-walk",
     replace(_anchor(8, 4096, 64, 1, z_dtype=bf16, has_d=True), chunk_size=64,
             states_returned=False), f32, "2xbf16"),
    # ... from initial states, its scores its own (kernels.ssd.walk_shares_scores) ...
    *((f"anchor-b{batch}-L4096-h64-q64-2xbf16{n}-start-walk",
       replace(_anchor(batch, 4096, 64, 1, start_dtype=f32), chunk_size=64, dstate=dstate,
               states_returned=False), f32, "2xbf16")
      for batch, n, dstate in ((8, "", 128), (8, "-n256", 256), (2, "", 128))),
    # ... and split as 'input' is, never paired: the third anchor's 64 heads in two segments,
    # out alone and with final states, and at dstate 256 with D (kernels.ssd.walk_segments); 80
    # heads with final states in four, their states-only walk paired
    # (kernels.ssd.walks_four_unpaired).
    ("b1-L65536-h80-q64-2xbf16-final-states-walk-four-segments",
     replace(_anchor(1, 65536, 80, 1), chunk_size=64), f32, "2xbf16"),
    *((f"b1-L65536-h64-q64-2xbf16{n}-{name}-walk-segments",
       replace(_anchor(1, 65536, 64, 1, has_d=has_d), chunk_size=64, dstate=dstate,
               states_returned=returned), f32, "2xbf16")
      for n, dstate, has_d, name, returned in (("", 128, False, "out-only", False),
                                               ("", 128, False, "final-states", True),
                                               ("-n256-d", 256, True, "out-only", False))),
    ("fp32-anchor-b8-L4096-h64-3xbf16", _anchor(8, 4096, 64, 1, x_dtype=f32, b_dtype=f32,
                                                c_dtype=f32), f32, "3xbf16"),
    ("fp16-anchor-b8-L4096-h64-3xbf16", _anchor(8, 4096, 64, 1, x_dtype=f16, b_dtype=f16,
                                                c_dtype=f16), f32, "3xbf16"),
    ("fp16-anchor-b8-L4096-h64-2xfp16", _anchor(8, 4096, 64, 1, x_dtype=f16, b_dtype=f16,
                                                c_dtype=f16), f32, "2xfp16"),
    # Out alone in '2xfp16': chunk states in two scaled fp16 terms (kernels.ssd.state_precision).
    ("fp16-anchor-b8-L4096-h64-2xfp16-out-only",
     replace(_anchor(8, 4096, 64, 1, x_dtype=f16, b_dtype=f16, c_dtype=f16, has_d=True),
             states_returned=False), f32, "2xfp16"),
    ("fp16x-bf16b-fp16c-q128-3xfp16", _small(f16, (bf16, f16), 128, 8, 64, 16, 4, z_dtype=f16,
                                             has_d=True), f32, "3xfp16"),
    ("fp16x-bf16b-fp16c-q128-3xbf16", _small(f16, (bf16, f16), 128, 8, 64, 16, 4, z_dtype=f16,
                                             has_d=True), f32, "3xbf16"),
    ("fp32x-bf16bc-q64-3xbf16-packed", _small(f32, bf16, 64, 8, 64, 32, 2, z_dtype=f32,
                                              has_d=True, seq_dtype=i32, start_dtype=f32),
     f32, "3xbf16"),
    # A tuner knob the dispatcher picks only from a table or a user's cache: compiled here too.
    ("anchor-b8-L4096-h64-out-transposed", _anchor(8, 4096, 64, 1), f32, None,
     {"out": {"transposed": True}}),
    ("fp16-anchor-b8-L4096-h64-2xfp16-transposed", _anchor(8, 4096, 64, 1, x_dtype=f16,
                                                           b_dtype=f16, c_dtype=f16), f32,
     "2xfp16", {"out": {"transposed": True}, "chunk_state": {"transposed": True}}),
    ("anchor-b8-L4096-h64-out-only-persistent",
     replace(_anchor(8, 4096, 64, 1, has_d=True), states_returned=False), None, None,
     {"out": {"persistent": True}, "chunk_state": {"persistent": True}}),
    ("anchor-b8-L4096-h64-out-latency", _anchor(8, 4096, 64, 1), None, None,
     {"out": {"latency": 2}}),
    ("anchor-b8-L4096-h64-out-occupancy4", _anchor(8, 4096, 64, 1), None, None,
     {"out": {"occupancy": 4}}),
    ("anchor-b8-L4096-h64-worker-warps8", _anchor(8, 4096, 64, 1), None, None,
     {"out": {"worker_warps": 8}, "chunk_state": {"worker_warps": 8}}),
    ("anchor-b4-L8192-h32-g8-shared-scores-ordered", _anchor(4, 8192, 32, 8), f32, None,
     {"out": {"shared_scores": True, "ordered_loads": True}}),
    ("fp32-q128-3xtf32-packed-shared-scores-transposed",
     _small(f32, f32, 128, 8, 64, 32, 2, seq_dtype=i32, z_dtype=f32, has_d=True), f32, "3xtf32",
     {"out": {"shared_scores": True, "transposed": True}}),
    ("anchor-b8-L4096-h64-states-transposed-ordered", _anchor(8, 4096, 64, 1), f32, None,
     {"chunk_state": {"transposed": True, "ordered_loads": True}}),
    ("fp32-q128-ieee-varlen-states-transposed", _small(f32, f32, 128, 8, 64, 32, 2,
                                                       start_dtype=f32, seq_dtype=i32,
                                                       cu_dtype=i32, nseq=3, per_seq_start=True,
                                                       varlen=True),
     f32, "ieee", {"chunk_state": {"transposed": True}}),
    ("bf16-q128-input-packed-ordered-transposed", _small(bf16, bf16, 128, 8, 128, 32, 2,
                                                         seq_dtype=i32, start_dtype=bf16,
                                                         cu_dtype=i32, nseq=3,
                                                         per_seq_start=True),
     bf16, "input", {"out": {"ordered_loads": True, "transposed": True}}),
    ("bf16x-fp32bc-q128-3xbf16-packed", _small(bf16, f32, 128, 8, 64, 64, 2, z_dtype=bf16,
                                               start_dtype=f32, seq_dtype=i32, cu_dtype=i32,
                                               nseq=3, per_seq_start=True, varlen=True),
     f32, "3xbf16"),
)

@dataclass(frozen=True)
class Variant:
    """One compiled variant: a kernel config, the signature its launches specialize it on
    (``launch_signatures``) and the recipes that launch it."""

    kernel: str
    config: object
    signature: KernelSignature
    recipes: tuple[str, ...]
    precision: str = ""

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.recipes[0]}]"

    @property
    def needs_tensor_cores(self) -> bool:
        return self.kernel in MMA_KERNELS and self.precision in TENSOR_CORE_PRECISIONS


def launch_problem(key: ProblemKey) -> SSDProblem:
    """A call of ``key``'s sizes, dtypes and flags on contiguous tensors of the meta device
    (shapes and strides, no memory): what the host code then passes the kernels is what it
    passes them on a GPU."""
    b, L, H, P, N, G = (key.batch, key.seqlen, key.nheads, key.headdim, key.dstate,
                        key.ngroups)

    def tensor(*shape, dtype):
        return None if dtype is None else torch.empty(*shape, device="meta", dtype=dtype)

    param = key.dt_dtype
    return SSDProblem(
        x=tensor(b, L, H, P, dtype=key.x_dtype), dt=tensor(b, L, H, dtype=param),
        A=tensor(H, dtype=param), B=tensor(b, L, G, N, dtype=key.b_dtype),
        C=tensor(b, L, G, N, dtype=key.c_dtype), chunk_size=key.chunk_size,
        D=tensor(*((H, P) if key.d_per_channel else (H,)), dtype=param if key.has_d else None),
        z=tensor(b, L, H, P, dtype=key.z_dtype),
        dt_bias=tensor(H, dtype=param if key.has_bias else None),
        initial_states=tensor(key.nseq if key.per_seq_start else b, H, P, N,
                              dtype=key.start_dtype),
        seq_idx=tensor(b, L, dtype=key.seq_dtype),
        cu_seqlens=tensor(key.nseq + 1, dtype=key.cu_dtype), dt_softplus=key.softplus,
        dt_limit=(1e-4, 1.0) if key.has_limit else (0.0, math.inf), return_final_states=True,
        return_varlen_states=key.varlen)


@contextlib.contextmanager
def recorded_launches():
    """Within it, ct.launch records (grid, kernel, args) instead of launching and the current
    stream needs no GPU, so the host code runs on CPU or meta tensors."""
    launched = []
    saved = ct.launch, torch.cuda.current_stream
    ct.launch = lambda stream, grid, kernel, args: launched.append((grid, kernel, args))
    torch.cuda.current_stream = lambda device=None: None
    try:
        yield launched
    finally:
        ct.launch, torch.cuda.current_stream = saved


def plan_launches(key: ProblemKey, plan) -> list[tuple]:
    """(grid, kernel, args) of every launch the host code makes for ``plan`` on ``key``'s call,
    run on meta tensors with ct.launch recording (``recorded_launches``)."""
    problem = launch_problem(key)
    pipeline = StagePipeline(problem, plan, problem.A.to(torch.float32), problem.seq_idx,
                             key.varlen)
    with recorded_launches() as launched:
        launch_stages(pipeline)
    return launched


def launch_signatures(key: ProblemKey, plan) -> list[tuple[str, object, KernelSignature]]:
    """(kernel name, config, signature) of every launch of ``plan`` on ``key``'s call, the array
    constraints read off the arguments the host code passes (``tile_ops.launch_constraint``): the
    specialization the JIT compiles on a GPU, where a config's own ``signature()`` declares only
    what every contiguous tensor guarantees (``plan_launches``)."""
    found = []
    for (name, cfg), (_, kernel, args) in zip(plan.named_configs(), plan_launches(key, plan),
                                              strict=True):
        assert kernel is cfg.kernel, cfg.describe()
        parameters = [launch_constraint(arg, c.index_dtype) if isinstance(c, ArrayConstraint)
                      else c for c, arg in zip(cfg.signature().parameters, args, strict=True)]
        found.append((name, cfg, kernel_signature(parameters)))
    return found


def target_capability(target: str) -> int:
    """'sm_100' -> 100, the compute capability ``kernels.ssd.make_plan`` plans for."""
    return int(target.removeprefix("sm_"))


# The grid ``hinted_beyond_covering`` plans: (batch, seqlen, nheads, headdim, ngroups) shapes
# that pair the walk, leave it one block an SM, split it in 2 to 16 segments or in four with
# final states, then x's dtype, dstate, final states, z and D, float32 initial states and the
# precision (bf16's opt-in too).
HINT_SWEEP = dict(
    shapes=((8, 4096, 64, 64, 1), (3, 4096, 64, 64, 1), (8, 4096, 64, 128, 1),
            (8, 4096, 64, 64, 8), (2, 4096, 64, 64, 1), (1, 16384, 80, 64, 1),
            *((1, 65536, nheads, 64, 1) for nheads in (96, 64, 48, 32, 16, 8))),
    dtypes=(bf16, f16, f32), dstates=(128, 64, 32, 16, 256),
    returned=(False, True), gates=("zd", "z", "d", ""), starts=(True, False),
    precisions=(None, "2xbf16"))


def hint_sweep_keys():
    """(recipe name, key, precision) for each call of HINT_SWEEP's grid."""
    grid = HINT_SWEEP
    for (b, seqlen, nheads, headdim, ngroups), dtype, dstate, returned, gate, start, precision \
            in itertools.product(grid["shapes"], grid["dtypes"], grid["dstates"], grid["returned"],
                                 grid["gates"], grid["starts"], grid["precisions"]):
        if precision == "2xbf16" and dtype != bf16:
            continue
        key = ProblemKey(batch=b, seqlen=seqlen, nheads=nheads, headdim=headdim, dstate=dstate,
                         ngroups=ngroups, chunk_size=STATE_SCAN_CHUNK_SIZE, x_dtype=dtype,
                         b_dtype=dtype, c_dtype=dtype, z_dtype=dtype if "z" in gate else None,
                         has_d="d" in gate, start_dtype=f32 if start else None,
                         states_returned=returned)
        flags = "".join(f"-{flag}" for flag, on in (
            ("final-states", returned), ("z", "z" in gate), ("d", "d" in gate),
            ("start", start), (precision, precision)) if on)
        name = (f"sweep-b{b}-L{seqlen}-h{nheads}-p{headdim}-g{ngroups}-"
                f"{str(dtype).removeprefix('torch.')}-n{dstate}{flags}")
        yield name, key, precision


def hinted_beyond_covering(capability: int = REFERENCE_CAPABILITY) -> list[Variant]:
    """Each kernel config with an occupancy hint of 2 or more that ``make_plan`` picks for a GPU
    of compute ``capability`` at HINT_SWEEP's calls (at chunk STATE_SCAN_CHUNK_SIZE, where the
    walk runs), and that no covering variant has, with the launch signature of its first call."""
    covered = {(v.kernel, v.config) for v in covering_variants(capability)}
    found: dict[tuple, Variant] = {}
    for recipe, key, precision in hint_sweep_keys():
        plan = make_plan(key, None, precision, capability=capability)
        for kernel, cfg, signature in launch_signatures(key, plan):
            ident = (kernel, cfg)
            if (getattr(cfg, "occupancy", None) or 1) >= 2 and ident not in covered:
                found.setdefault(ident, Variant(kernel, cfg, signature, (recipe,),
                                                getattr(cfg, "precision", "")))
    return list(found.values())


def covering_variants(capability: int = REFERENCE_CAPABILITY) -> list[Variant]:
    """Every distinct (kernel config, launch signature) the covering recipes launch on a GPU of
    compute ``capability`` (the H200's by default; the plans differ by target only where
    ``kernels.ssd.walk_max_dstate`` does), in first-seen order."""
    found: dict[tuple, Variant] = {}
    for recipe, key, state_dtype, precision, *knobs in COVERING_KEYS:
        knobs = dict(knobs[0]) if knobs else {}
        rules = {(name, None): value for name, value in knobs.pop("ssd", {}).items()}
        with dispatch_rules(rules):
            plan = make_plan(key, state_dtype, precision, capability=capability)
        plan = plan.with_knobs(knobs)
        for kernel, cfg, signature in launch_signatures(key, plan):
            ident = (kernel, cfg, repr(signature.parameters))
            if ident in found:
                found[ident] = replace(found[ident], recipes=found[ident].recipes + (recipe,))
            else:
                found[ident] = Variant(kernel, cfg, signature, (recipe,),
                                       getattr(cfg, "precision", ""))
    return list(found.values())


# The variant sets the compiler driver compiles, by name (``compile_all``, ``--hinted``).
VARIANT_SETS = {"covering": covering_variants, "hinted": hinted_beyond_covering}


@dataclass
class CompileResult:
    variant: str
    target: str
    ok: bool
    seconds: float
    tensor_core_mmas: int = 0
    fma_mmas: list = field(default_factory=list)
    tma_fallbacks: list = field(default_factory=list)
    code_digest: str = ""
    registers: int = 0          # a thread's registers (kernel_resources)
    spill_bytes: int = 0        # a thread's local-memory frame: registers spilled
    shared_bytes: int = 0       # a block's shared memory (kernel_resources)
    threads: int = 0            # a block's threads (kernel_resources; 0: not read)
    error: str = ""


_REMARK = re.compile(r"remark\[(passed|failed)\]: MMA operation[^\n]*\n\s*--> \"([^\"]+)\":(\d+)")


def mma_remarks(remarks: str) -> tuple[int, list[str]]:
    """(MMAs on tensor cores, 'file:line' of MMAs left on FMA units) from tileiras's
    command-line tensor-core remarks."""
    passed, failed = 0, []
    for kind, path, line in _REMARK.findall(remarks):
        if kind == "passed":
            passed += 1
        else:
            failed.append(f"{os.path.basename(path)}:{line}")
    return passed, failed


_MEMORY_REMARK = re.compile(
    r"remark\[(passed|failed)\]: ([^\n]*)\n(.*?)(?=remark\[|in function:|\Z)", re.S)


def tma_fallbacks(remarks: str) -> list[str]:
    """'file:line: why' of every tile load or store that tileiras's memory remarks say did not
    become a TMA copy (a failed TMA selection, or a plain global-memory instruction)."""
    found = set()
    for kind, title, body in _MEMORY_REMARK.findall(remarks):
        where = re.search(r'--> "([^"]+)":(\d+)', body)
        instruction = re.search(r"= note: Instruction = ([^\n]*)", body)
        reason = re.search(r"= reason: (?:loc\([^)]*\): )?([^\n]*)", body)
        memory = "load" in title.lower() or "store" in title.lower()
        if where is None or not memory or (kind == "passed" and instruction is not None
                                           and "TMA" in instruction.group(1)):
            continue
        why = reason.group(1) if reason else instruction.group(1) if instruction else title
        found.add(f"{os.path.basename(where.group(1))}:{where.group(2)}: {why.strip()}")
    return sorted(found)


def _sections(cubin: bytes):
    """(name, offset, size) of each section of an ELF64 cubin."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    for name, _, _, _, offset, size in headers:
        yield cubin[names_offset + name:cubin.index(b"\0", names_offset + name)], offset, size


def code_digest(cubin: bytes) -> str:
    """A digest of what a cubin runs: its machine code (the .text sections' bytes), its kernel
    attributes (.nv.info: registers, barriers, parameter layout) and its shared-memory sizes, in
    an ELF64 cubin; symbol names and line tables are left out, so two configs that compile to the
    same kernel match."""
    digest = hashlib.sha256()
    for section, offset, size in _sections(cubin):
        if section.startswith((b".text", b".nv.info")):
            digest.update(cubin[offset:offset + size])
        elif section.startswith(b".nv.shared"):
            digest.update(size.to_bytes(8, "little"))
    return digest.hexdigest()[:16]


# .nv.info attributes (each: format byte, attribute byte, then by format a 2-byte value or a
# 2-byte size and that many bytes): the kernel's register count and its local-memory frame, which
# holds what did not fit in them (no recursion or local arrays in these kernels). Per kernel
# they are (symbol index, value) pairs of 4 bytes each; the block's extents the kernel requires
# (x, y, z, 4 bytes each) stand in its own .nv.info.<kernel> section.
_INFO_SIZED, _REGCOUNT, _FRAME_SIZE, _REQNTID = 0x04, 0x2F, 0x11, 0x10


def kernel_resources(cubin: bytes) -> tuple[int, int, int, int]:
    """(registers, spill bytes) of a thread of the cubin's kernel, from its .nv.info attributes,
    a block's shared memory (the .nv.shared sections) and its threads (0 where the cubin names
    none; tileiras picks them: 256 for the first anchor's walk paired, 128 for '2xbf16''s split
    walk forced to pair at 16 pairs over 65,536 tokens). Shared memory, not registers, keeps
    kernels/scan_out.py's walk to one block per SM on sm_90 without the occupancy hint (212,520
    bytes at the first anchor; 93,600 with occupancy=2, which kernels/ssd.py sets where two
    blocks an SM pay).
    compute_out at the first anchor's tiles (occupancy 3: 80 registers) keeps a frame of 8 bytes
    a thread on sm_90, 16 with D per head, and on the H200 ncu counted four times the
    local-memory requests with D (experiments/ncu_compute_out_d_a86c27f.txt.gz): the CPU
    compile shows the spills that ncu measures."""
    found, shared = {}, 0
    for section, offset, size in _sections(cubin):
        if section.startswith(b".nv.shared"):
            shared += size
        if not section.startswith(b".nv.info"):
            continue
        i, end = offset, offset + size
        while i + 4 <= end:
            form, attribute = cubin[i], cubin[i + 1]
            length, = struct.unpack_from("<H", cubin, i + 2)
            if form == _INFO_SIZED:
                if attribute in (_REGCOUNT, _FRAME_SIZE) and length >= 8:
                    found[attribute] = struct.unpack_from("<I", cubin, i + 8)[0]
                elif attribute == _REQNTID and length == 12:
                    x, y, z = struct.unpack_from("<III", cubin, i + 4)
                    found[attribute] = x * y * z
                i += 4 + length
            else:
                i += 4
    return found.get(_REGCOUNT, 0), found.get(_FRAME_SIZE, 0), shared, found.get(_REQNTID, 0)


def _write_bytecode(variant: Variant, directory: str) -> str:
    """The variant's target-independent Tile IR bytecode, written under ``directory``: its
    path."""
    bytecode = io.BytesIO()
    export_kernel(variant.config.kernel, [variant.signature], bytecode,
                  output_format="tileir_bytecode")
    source = os.path.join(directory, "kernel.tilebc")
    with open(source, "wb") as f:
        f.write(bytecode.getvalue())
    return source


def tile_ir(variant: Variant) -> str:
    """The variant's Tile IR as text (the tileiras wheel's tileirdisasm): what cuTile's front end
    hands tileiras, its memory-ordering tokens included."""
    with tempfile.TemporaryDirectory() as tmp:
        disasm = os.path.join(os.path.dirname(tileiras_path()), "tileirdisasm")
        return subprocess.run([disasm, _write_bytecode(variant, tmp)], capture_output=True,
                              text=True, timeout=120, env=tileiras_env(), check=True).stdout


def compile_variant(variant: Variant, target: str, out_dir: str | None = None) -> CompileResult:
    """Compile one variant for one target; never raises (the result says what went wrong)."""
    return compile_for_targets(variant, ((target, variant.name),), out_dir)[0]


def compile_for_targets(variant: Variant, named_targets, out_dir: str | None = None
                        ) -> list[CompileResult]:
    """compile_variant for each (target, the variant's name in that target's covering set) of
    ``named_targets``, its target-independent bytecode written once. A front-end or tileiras
    failure is in the results (its message kept), not raised. A result's seconds: the front
    end's and its tileiras run's."""
    start = time.perf_counter()
    results = [CompileResult(name, target, ok=False, seconds=0.0)
               for target, name in named_targets]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            source = _write_bytecode(variant, tmp)
        except Exception as exc:   # a front-end error (TileError) names file:line; keep it
            for result in results:
                result.error = f"{type(exc).__name__}: {exc}"[-4000:]
                result.seconds = time.perf_counter() - start
            return results
        front_end = time.perf_counter() - start
        for result in results:
            started = time.perf_counter()
            try:
                _run_tileiras(source, result, out_dir or tmp)
            except Exception as exc:
                result.error = f"{type(exc).__name__}: {exc}"[-4000:]
            result.seconds = front_end + time.perf_counter() - started
    return results


def _run_tileiras(source: str, result: CompileResult, cubin_dir: str) -> None:
    """Compile ``source`` (Tile IR bytecode) for ``result.target`` into ``result``."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", result.variant).strip("-")
    cubin = os.path.join(cubin_dir, f"{stem}.{result.target}.cubin")
    command = [tileiras_path(), source, "--gpu-name", result.target, *TILEIRAS_FLAGS, "-o", cubin]
    if result.target == REMARK_TARGET:
        command += ["--remark-format=command-line", "--remarks=all"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=tileiras_env())
    if run.returncode != 0:
        # A crash by signal leaves no message: its exit status says which (-4: SIGILL).
        result.error = (run.stderr or run.stdout or f"tileiras exited with {run.returncode} "
                        f"and no message")[-4000:]
    elif not os.path.getsize(cubin):
        result.error = "tileiras wrote an empty cubin"
    else:
        result.ok = True
        with open(cubin, "rb") as f:
            machine_code = f.read()
        result.code_digest = code_digest(machine_code)
        (result.registers, result.spill_bytes, result.shared_bytes,
         result.threads) = kernel_resources(machine_code)
        if result.target == REMARK_TARGET:
            remarks = run.stdout + run.stderr
            result.tensor_core_mmas, result.fma_mmas = mma_remarks(remarks)
            result.tma_fallbacks = tma_fallbacks(remarks)


def _compile_tasks(targets, out_dir: str | None, variant_set: str) -> list[tuple]:
    """A task per distinct variant of the targets' sets (VARIANT_SETS[variant_set]): (set,
    capability, index, ((target, name), ...), out_dir), the variant at ``index`` of
    ``capability``'s set and every target whose set holds it, with its name there. Spawned
    workers get indices, not variants."""
    tasks: dict[tuple, tuple] = {}
    for target in targets:
        capability = target_capability(target)
        for index, v in enumerate(_process_variants(variant_set, capability)):
            ident = (v.kernel, v.config, repr(v.signature.parameters))
            tasks.setdefault(ident, (capability, index, []))[2].append((target, v.name))
    return [(variant_set, capability, index, tuple(named), out_dir)
            for capability, index, named in tasks.values()]


@functools.lru_cache(maxsize=None)
def _process_variants(variant_set: str, capability: int) -> list[Variant]:
    """A variant set, once per process (the covering set ~0.2 s a call, the hinted one ~10 s):
    the driver lists and names it, its compile workers' tasks index it."""
    return VARIANT_SETS[variant_set](capability)


def _compile_task(args) -> list[CompileResult]:
    variant_set, capability, index, named_targets, out_dir = args
    return compile_for_targets(_process_variants(variant_set, capability)[index], named_targets,
                               out_dir)


def compile_all(targets=TARGETS, jobs: int = 2, out_dir: str | None = None,
                variant_set: str = "covering") -> list[CompileResult]:
    """Every target's variants of ``variant_set`` (VARIANT_SETS) for it, ``jobs`` variants at a
    time (spawned processes: cuTile's front end is Python, tileiras is single-threaded per
    kernel), each variant's bytecode written once for the targets that compile it."""
    tasks = _compile_tasks(targets, out_dir, variant_set)
    if jobs <= 1:
        per_task = [_compile_task(task) for task in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            per_task = list(pool.map(_compile_task, tasks))
    return [result for results in per_task for result in results]


_ONE_ELEMENT = re.compile(r"shape=\(\)|shape=\((1, )*1\)|reshape\(\((1, )*1\)\)")
_LOADED_ARRAY = re.compile(r"ct\.load\(\s*(\w+)")


def _broadcast_arrays(variant: Variant) -> set[str]:
    """The kernel's array parameters its launches pass with a stride 0 over more than one element
    (they alias themselves: ``launch_constraint``), D per head broadcast along headdim: a TMA
    descriptor's strides are non-zero, and the tile read (P_BLOCK floats a block) is small.
    Named as in the kernel, which its ``ct.function`` helpers keep."""
    names = inspect.signature(variant.config.VARIANTS[False]._pyfunc).parameters
    return {name for name, constraint in zip(names, variant.signature.parameters)
            if isinstance(constraint, ArrayConstraint) and constraint.may_alias_internally}


def _statement(path: str, line: int) -> str:
    """The Python statement that starts at ``line`` of ``path`` (up to its closing bracket)."""
    text, depth = "", 0
    while True:
        source = linecache.getline(path, line)
        text += source
        depth += source.count("(") - source.count(")")
        if depth <= 0 or not source:
            return text
        line += 1


def violations(variant: Variant, result: CompileResult) -> list[str]:
    """Why a compiled variant breaks a promise (empty when it keeps them): a precision mode that
    promises tensor cores has every MMA on them, and an MMA kernel moves every tile of more than
    one element by TMA (sm_90 remarks), except with 64-bit indexing, whose extents a TMA
    descriptor cannot encode, and from an array passed with a stride 0 (``_broadcast_arrays``)."""
    if not (result.ok and result.target == REMARK_TARGET):
        return []
    problems = []
    if variant.needs_tensor_cores:
        problems += [f"MMA on FMA units at {where}" for where in result.fma_mmas]
        if result.tensor_core_mmas == 0:
            problems.append("no MMA reported on tensor cores")
    if variant.kernel in MMA_KERNELS and not variant.config.wide:
        broadcast = _broadcast_arrays(variant)
        for fallback in result.tma_fallbacks:
            name, line, why = fallback.split(":", 2)
            statement = _statement(os.path.join(os.path.dirname(__file__), name), int(line))
            loaded = _LOADED_ARRAY.search(statement)
            if not (_ONE_ELEMENT.search(statement) or (loaded and loaded[1] in broadcast)):
                problems.append(f"no TMA at {name}:{line} ({why.strip()}): "
                                f"{' '.join(statement.split())}")
    return problems


def occupancy_shortfall(variant: Variant, result: CompileResult) -> str:
    """Why an SM of the target cannot hold the blocks the variant's occupancy hint asks for
    ('' where it can): a block's shared memory plus the 1 KB CUDA reserves, times the blocks,
    past the SM's (on sm_90 two blocks an SM need 115,712 bytes or less each, not the 116,224 of
    half a block's most), or, where the cubin names its block's threads, their registers
    (rounded up to REGISTER_UNIT a warp) or the threads themselves past the SM's
    (tests/test_compile.py lists the variants found past either)."""
    asked = getattr(variant.config, "occupancy", None)
    if not (result.ok and asked):
        return ""
    limits = []
    if result.shared_bytes:
        block = result.shared_bytes + RESERVED_BLOCK_SHARED_BYTES
        limits.append((SM_SHARED_BYTES[result.target] // block,
                       f"{result.shared_bytes:,} bytes of shared memory a block (+ "
                       f"{RESERVED_BLOCK_SHARED_BYTES:,} reserved) against the SM's "
                       f"{SM_SHARED_BYTES[result.target]:,}"))
    if result.threads and result.registers:
        warp = -(-result.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        block = warp * -(-result.threads // 32)
        limits.append((SM_REGISTERS // block,
                       f"{result.registers} registers a thread, {block:,} a block of "
                       f"{result.threads:,} threads, against the SM's {SM_REGISTERS:,}"))
    if result.threads:
        limits.append((SM_THREADS // result.threads,
                       f"{result.threads:,} threads a block against the SM's {SM_THREADS:,}"))
    short = [(held, why) for held, why in limits if held < asked]
    if not short:
        return ""
    held, why = min(short, key=lambda limit: limit[0])
    return f"occupancy {asked} asked, {held} held: {why}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kernels.variants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", choices=TARGETS,
                        help="compile for this target (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--list", action="store_true",
                        help="list the variants (of each --target; default: sm_90's) and exit")
    parser.add_argument("--hinted", action="store_true",
                        help="the hinted variants beyond the covering set (hinted_beyond_covering)"
                             " instead of the covering set")
    parser.add_argument("--out", help="keep the cubins (and results.json) in this folder")
    args = parser.parse_args(argv)
    set_name = "hinted" if args.hinted else "covering"

    def variant_set(capability: int) -> list[Variant]:
        return _process_variants(set_name, capability)
    if args.list:
        for target in args.target or [f"sm_{REFERENCE_CAPABILITY}"]:
            for v in variant_set(target_capability(target)):
                print(f"{target} {v.name:60s} {v.config.describe()}  <- {', '.join(v.recipes)}")
        return 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    targets = tuple(args.target or TARGETS)
    results = compile_all(targets, args.jobs, args.out, set_name)
    variants = {(v.name, t): v for t in targets for v in variant_set(target_capability(t))}
    failures = 0
    for r in results:
        problems = ([r.error] if not r.ok else []) + violations(variants[r.variant, r.target], r)
        failures += bool(problems)
        status = "FAIL" if problems else "ok"
        tc = f" tc={r.tensor_core_mmas}" if r.target == REMARK_TARGET else ""
        spills = f" spill={r.spill_bytes}B" if r.spill_bytes else ""
        print(f"{status:4s} {r.target} {r.seconds:5.1f}s regs={r.registers}{spills} "
              f"smem={r.shared_bytes / 1024:.1f}KB threads={r.threads}{tc} {r.variant}")
        for p in problems:
            print("     " + p.replace("\n", "\n     "))
        if shortfall := occupancy_shortfall(variants[r.variant, r.target], r):
            print("     note: " + shortfall)
    print(f"{len(results)} compiles, {failures} failed, {time.perf_counter() - start:.0f} s")
    if args.out:
        from properties.provenance import write_json  # noqa: PLC0415
        write_json(os.path.join(args.out, "results.json"), [r.__dict__ for r in results])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
