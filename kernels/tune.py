"""The offline tuner behind ``kernels/tuned.json``: each stage's kernel timed alone over candidate
tiles and occupancy hints, at given shapes, on the GPU.

    python3 -m kernels.tune --out DIR [--jobs 8] [--shapes 0,1] [--stages compute_out] [--write-table]
    python3 -m kernels.tune --out DIR --shape 2,2048,32,64,128,1,bfloat16 --cache   # your own shape

Per shape (``SHAPES``: the performance anchors, bf16, and the first in float32) it times, with
CUDA-event medians on the same inputs: the states stage over every chunk_state candidate (state
passing at the dispatcher's choice), then over every state_passing candidate with the best
chunk_state, then compute_out over its candidates. Where the shape's plan runs the fused state
scan instead (``--chunk-size 64`` or ``128`` with ``--out-alone``, at enough (row, head) pairs:
``ssd.fuses_state_scan``) the states stage is searched over the scan's tiles, then compute_out.
Results and the dispatcher's own choice go to DIR/tune.json; ``--write-table`` also writes the
winners, keyed by what the dispatcher matches on (padded headdim and dstate, chunk size, x
dtype, precision mode), to kernels/tuned.json with provenance. A mode probed in compute_out
stores the chunk states as that mode does (bf16 in 'input', float32 otherwise:
``kernels.ssd.resolve_state_dtype``); ``--chunk-size`` tunes another chunk size (a key of its
own). Candidates only change tiles and hints, never what is computed; the GPU tests and the
accuracy grid (kernels/gpu_report.py) check the kernels at the table's tiles (the
README's Status says what ran on which commit).
Candidates compile in ``--jobs`` worker processes first (cuTile's disk cache then serves this
process). Before that each candidate's stage kernels are compiled on the CPU at the
specializations its launches take (``kernels.variants.launch_signatures``): candidates whose
compiled kernel matches an earlier one's are timed once (at the first anchor the 50 compute_out
candidates compile to 28 kernels, 2ba8309: ``ordered_loads`` changes nothing untransposed there,
nor the latency hint at row block 128; the 52 chunk_state candidates to 29).

A user's own shapes (``--shape``, repeatable) are tuned the same way; ``--cache`` merges their
winners into the per-user tuning cache (``kernels.ssd.tuning_cache_path()``), entries kept per GPU
model, which ``ssd_forward`` then prefers to the table on that model. The tuner is the only thing
that searches: calls never do.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from multiprocessing import get_context

import torch

from kernels import ssd
from kernels.contract import SSDInputError, validate
from kernels.gpu_check import time_ms
from kernels.tile_ops import next_pow2
from kernels.variants import TARGETS, Variant, compile_variant, launch_signatures

TABLE_PATH = os.path.join(os.path.dirname(__file__), "tuned.json")
SHAPES = ((8, 4096, 64, 64, 128, 1, "bfloat16"), (4, 8192, 32, 64, 128, 8, "bfloat16"),
          (1, 65536, 64, 64, 128, 1, "bfloat16"), (8, 4096, 64, 64, 128, 1, "float32"))
SHAPE_DTYPES = ("bfloat16", "float16", "float32")
CANDIDATES = {
    # The three fastest chunk_state tiles at both anchors of reports/h200/tune.json (32 searched)
    # and a wider P block (the transposed orientation's MMA columns), in both orientations and
    # load orders; at the wider block (every anchor's winner since 21181f8) also with the x and
    # B loads' latency hint set (sm_90 cubins differ with it: the kernel is latency-bound, 17%
    # occupancy in ncu, experiments/ncu_anchor0_6106f85.txt.gz).
    "chunk_state": [dict(row_block=r, p_block=p, n_block=n, occupancy=o, transposed=t,
                         ordered_loads=l, latency=0, worker_warps=None, persistent=False)
                    for (r, p, n, o), t, l in itertools.product(
                        ((64, 32, 128, 2), (64, 32, 64, 2), (128, 32, 64, 2), (64, 64, 128, 2)),
                        (False, True), (False, True))]
                   + [dict(row_block=64, p_block=64, n_block=128, occupancy=2, transposed=t,
                           ordered_loads=l, latency=h, worker_warps=None, persistent=False)
                      for t, l, h in itertools.product((False, True), (False, True), (2, 6, 10))]
                   # Occupancy 3 at that block, with the table's hint and without: at the first
                   # anchor, transposed, one more code (80 registers and 73 KB of shared memory,
                   # against 128 and 110 KB at 2); untransposed, occupancy 2's codes (the search
                   # times each code once).
                   + [dict(row_block=64, p_block=64, n_block=128, occupancy=3, transposed=t,
                           ordered_loads=l, latency=h, worker_warps=None, persistent=False)
                      for t, l, h in itertools.product((False, True), (False, True), (0, 6))]
                   # 8 worker warps instead of the compiler's 4 (384 threads, not 256): at the
                   # first anchor's block 80 registers instead of 128 and the same ~112 KB of
                   # shared memory, so two blocks per SM bring twice the warps to a
                   # latency-bound kernel (CPU compile, sm_90).
                   + [dict(row_block=64, p_block=64, n_block=128, occupancy=2, transposed=t,
                           ordered_loads=l, latency=h, worker_warps=8)
                      for t, l, h in itertools.product((False, True), (False, True), (0, 6))]
                   # Smaller blocks that hold 3-4 per SM where the tiles above hold 2 (CPU
                   # compile, sm_90, first anchor): P block 32 at occupancy 3 (80 registers, 40
                   # KB), 4 (64, 26 KB) or 3 with 8 worker warps (56 at 384 threads); N block 64
                   # at occupancy 3 with 8 worker warps (56 registers, 69 KB). Timed on the
                   # H200 at the first anchor (2eef42b, 'input' states): with 8 worker warps or
                   # these blocks 0.354 ms at best against the table's 0.304
                   # (experiments/tune_2eef42b_chunk_state_anchor0_out_alone.json).
                   + [dict(row_block=64, p_block=p, n_block=n, occupancy=o, transposed=t,
                           ordered_loads=False, latency=6, worker_warps=w, persistent=False)
                      for (p, n, o, w), t in itertools.product(
                          ((32, 128, 3, None), (32, 128, 4, None), (32, 128, 3, 8), (64, 64, 3, 8)),
                          (False, True))]
                   # Persistent at the table's tiles (17% achieved occupancy against 25% possible
                   # in ncu at the first anchor, experiments/ncu_anchor0_out_alone_5d543e6.txt.gz).
                   # At the first anchor it lost: 0.317 ms against the table's 0.288
                   # (experiments/tune_1f159b8_chunk_state_anchor0_out_alone.json.gz).
                   + [dict(row_block=64, p_block=64, n_block=128, occupancy=2, transposed=t,
                           ordered_loads=l, latency=h, worker_warps=None, persistent=True)
                      for t, l, h in itertools.product((False, True), (False, True), (6, 10))],
    # With bf16 increments and states (out-alone calls in 'input') P32 x N32 at occupancy 8 won
    # at every bf16 key searched (5d543e6; 16 compiles to its code), the states stage against
    # the table's tiles 0.304 -> 0.286 ms at the first anchor, 0.163 -> 0.151 at the second,
    # 0.721 -> 0.590 at the third (N shrunk to 16 there), 0.649 -> 0.558 at headdim 128
    # (experiments/tune_5d543e6_state_passing_anchor*_out_alone.json.gz,
    # tune_5d543e6_*_states_out_alone.json.gz).
    "state_passing": [dict(p_block=p, n_block=n, occupancy=o) for (p, n), o in
                      itertools.product(((16, 16), (32, 16), (32, 32), (32, 64), (64, 64)),
                                        (None, 4, 8, 16))],
    # Occupancy 2 or 4 won every compute_out search so far (reports/h200/tune.json,
    # experiments/tune_322c7d5.json.gz): the layout knobs get the room instead. At occupancy 2
    # (every anchor's winner since 79bdf52) also with the column blocks' load latency hint at 2
    # (1 and 2 change the sm_90 code, 3 and up do not: kernels/compute_out.py). Occupancy 3
    # too: the hint sets how deep tileiras pipelines the loads, and at the first anchor's row
    # block 64 it compiles to 80 registers and 72 KB of shared memory (3 blocks of 256 threads
    # fit an SM), against 128 and 108 KB at 2, where ncu found the kernel latency-bound
    # (experiments/ncu_anchor0_abdd947.txt.gz).
    # 8 worker warps too: at the first anchor's row block 64 and occupancy 3, 56 registers and
    # 71 KB per block of 384 threads (80 and 72 KB at 256), so three blocks bring 24 worker warps
    # to an SM instead of 12; at P block 32 and occupancy 4, 40 registers and 51 KB, four blocks
    # and 32 worker warps (CPU compiles, sm_90). Timed on the H200 there (2eef42b): 0.719 ms at
    # best with 8 worker warps against 0.586 at 4
    # (experiments/tune_2eef42b_compute_out_anchor0_out_alone.json).
    "compute_out": [dict(row_block=r, p_block=p, occupancy=o, transposed=t, ordered_loads=l,
                         latency=h, worker_warps=w, persistent=False)
                    for (r, p, o, h, w), t, l in itertools.product(
                        ((64, 64, 2, 0, None), (64, 64, 4, 0, None), (64, 32, 4, 0, None),
                         (128, 64, 2, 0, None), (64, 64, 2, 2, None), (128, 64, 2, 2, None),
                         (64, 64, 3, 0, None), (128, 64, 3, 0, None), (64, 64, 3, 0, 8),
                         (64, 64, 2, 0, 8), (64, 32, 4, 0, 8)),
                        (False, True), (False, True))]
                   # Persistent at the tiles that won so far: blocks of ~7 us each at the first
                   # anchor, and ncu found 25.7% achieved occupancy against 37.5% possible
                   # (experiments/ncu_anchor0_out_alone_5d543e6.txt.gz). Row block 64 at occupancy 3
                   # won at the first anchor, 0.572 ms against 0.584 persistent off
                   # (experiments/tune_1f159b8_compute_out_anchor0_out_alone.json.gz); at float32
                   # x it lost (3.41 against 2.62 ms, ..._fp32_compute_out_out_alone.json.gz).
                   # Out written by plain stores instead of TMA was a knob here until 1e42bdc: it
                   # won the search at the first anchor, whose inputs then carried D per head,
                   # and lost 9% in the benchmark, whose anchors have no D (kernels/compute_out.py;
                   # the inputs have no D since: shape_inputs).
                   + [dict(row_block=r, p_block=64, occupancy=o, transposed=t, ordered_loads=False,
                           latency=0, worker_warps=None, persistent=True)
                      for (r, o), t in itertools.product(((64, 3), (64, 4), (128, 2)),
                                                         (False, True))],
}
# The fused state scan (kernels/state_scan.py; the plans of ssd.fuses_state_scan have it instead
# of the two stages above): its tiles, those the dispatcher's shrinking keeps at the shape
# (``fits``). No occupancy hints: at 2 and 4 the scan spilled and took 60-140 ms at the first
# anchor (experiments/ab_state_scan_436fba5.txt).
CANDIDATES["state_scan"] = [dict(p_block=p, n_block=n) for p, n in
                            ((64, 128), (64, 64), (32, 128), (128, 64), (32, 64), (64, 32))]
PROBED_CANDIDATES = 4
# The kernels whose configs a stage's candidates change (compute_out's row block also sets the
# shared scores' tiles).
STAGE_KERNELS = {"chunk_state": ("chunk_state",), "state_passing": ("state_passing",),
                 "compute_out": ("chunk_scores", "compute_out"), "state_scan": ("state_scan",)}
FIELD = {"chunk_state": "chunk_state", "state_passing": "state_passing", "compute_out": "out",
         "state_scan": "state_scan"}
# What the matmul precision of each kernel costs at the tuned tiles (recorded, not chosen).
PRECISION_PROBES = {"chunk_state": ("3xtf32", "tf32", "input", "3xbf16", "3xfp16"),
                    "compute_out": ("tf32", "input", "2xbf16", "3xbf16", "2xfp16", "3xfp16")}


def plan_stages(plan: ssd.Plan) -> tuple:
    """The searchable stages a plan runs, in the order they are searched."""
    if plan.state_scan is not None:
        return ("state_scan", "compute_out")
    return ("chunk_state", "state_passing", "compute_out")


def parse_shape(text: str) -> tuple:
    """'B,L,H,P,N,G[,dtype]' -> a tuning shape (dtype: x, B and C; default bfloat16)."""
    parts = [p.strip() for p in text.split(",")]
    dtype = parts.pop() if len(parts) == 7 else "bfloat16"
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 6 or min(dims) < 1 or dims[2] % dims[5] or dtype not in SHAPE_DTYPES:
        raise ValueError(f"--shape: expected B,L,H,P,N,G[,dtype] with positive sizes, G dividing "
                         f"H and dtype one of {SHAPE_DTYPES}, got {text!r}")
    return (*dims, dtype)


def shape_inputs(shape, seqlen=None, out_alone: bool = False) -> dict:
    """Mamba-2-init inputs of a tuning shape on the GPU (seqlen overrides the shape's), for a
    call that returns final_states too, or out alone (``ssd.state_precision``). No D: what the
    benchmark's shapes and the performance targets time. The table's key has no D, and a knob
    can rank differently with it: until 89092f0 these inputs carried D per head, and a plain
    store of out won the search by 2.2% at the first anchor, then lost 8-10% in the benchmark
    without D (experiments/ab_store_d_1e42bdc.txt)."""
    from kernels.gpu_report import anchor_inputs  # noqa: PLC0415
    b, L, H, P, N, G, dtype = shape
    inputs = anchor_inputs((b, seqlen or L, H, P, N, G))
    del inputs["D"]
    for name in ("x", "B", "C"):
        inputs[name] = inputs[name].to(getattr(torch, dtype))
    inputs["return_final_states"] = not out_alone
    return inputs


def fits(cand: dict, shape, chunk_size: int, stage: str | None = None) -> bool:
    """A candidate's tiles divide the chunk and do not exceed the padded headdim and dstate; the
    fused scan's are also the tiles calls of the shape would run (``ssd.state_scan_tiles``
    shrinks those that leave too few blocks)."""
    b, _, H, P, N, _, _ = shape
    p_pad, n_pad = (max(ssd.MIN_TILE, next_pow2(v)) for v in (P, N))
    if stage == "state_scan":
        tiles = (cand["p_block"], cand["n_block"])
        return tiles == ssd.state_scan_tiles(b * H, p_pad, n_pad, tiles)
    return (cand.get("row_block", 0) <= chunk_size and cand.get("p_block", 0) <= p_pad
            and cand.get("n_block", 0) <= n_pad)


def with_candidate(plan: ssd.Plan, stage: str, cand: dict, precision: str | None = None) -> ssd.Plan:
    """``plan`` with ``stage``'s config at candidate tiles (and precision mode: compute_out in
    another mode also stores the chunk states as that mode does, ``ssd.resolve_state_dtype``)."""
    cfg = replace(getattr(plan, FIELD[stage]), **cand)
    if precision is not None:
        cfg = replace(cfg, precision=precision)
    plan = replace(plan, **{FIELD[stage]: cfg})
    if precision is None or stage != "compute_out":
        return plan
    stored = ssd.resolve_state_dtype(None, precision, plan.out.x_dtype)
    return replace(plan, out=replace(plan.out, state_dtype=stored),
                   state_passing=replace(plan.state_passing, state_dtype=stored))


def _pipeline(inputs: dict, chunk_size: int, plan: ssd.Plan | None = None,
              precision: str | None = None) -> ssd.StagePipeline:
    """The stages of a call on ``inputs``: at ``plan``, else at the dispatcher's plan in
    ``precision`` without kernels/scan_out.py's walk, which would run in place of the two
    stages searched here (it takes the tiles of neither)."""
    problem = validate(**inputs, chunk_size=chunk_size)
    pipeline = ssd.stage_pipeline(problem, precision=precision)
    return replace(pipeline, plan=plan or replace(pipeline.plan, scan_out=None))


def probe_candidates(stage: str, rows: list[dict], best: dict, tabled: dict) -> list[dict]:
    """The tiles a mode is probed at: the PROBED_CANDIDATES fastest distinct codes of the search
    (or its best, when the stage was not searched), and the mode's tiles in the table (``tabled``).
    A later run's probe replaces the mode's entry (``table``), so it must time what it replaces
    in the same run: without it a probe at 6eb8ae2 would have put 2xbf16's compute_out at the
    first anchor at 1.25 ms where the entry it replaced had taken 1.06."""
    timed = [_tiles(stage, r) for r in sorted(
        (r for r in rows if "ms" in r and "same_code_as" not in r),
        key=lambda r: r["ms"])[:PROBED_CANDIDATES]] or [_tiles(stage, best)]
    return timed + ([tabled] if tabled not in timed else [])


def _dispatched(inputs: dict, chunk_size: int, stage: str, precision: str) -> dict:
    """The tiles calls get for ``stage`` in ``precision`` mode: the tuning cache's entry on this
    GPU model, else the table's, else the defaults (``ssd.make_plan``)."""
    plan = _pipeline(inputs, chunk_size, precision=precision).plan
    return _tiles(stage, asdict(getattr(plan, FIELD[stage])))


def _stage_call(pipeline: ssd.StagePipeline, stage: str, dt, cumsum, states):
    if stage == "compute_out":
        return lambda: pipeline.out(dt, cumsum, states)
    return lambda: pipeline.states(dt, cumsum)


def _compile_task(args):
    """Compile one candidate plan in a worker by running it on a short problem of the shape."""
    shape, chunk_size, stage, cand, precision, out_alone = args
    try:
        pipeline = _pipeline(shape_inputs(shape, seqlen=2 * chunk_size, out_alone=out_alone),
                             chunk_size)
        pipeline = replace(pipeline, plan=with_candidate(pipeline.plan, stage, cand, precision))
        dt, cumsum = pipeline.cumsum()
        states, _, _ = pipeline.states(dt, cumsum)
        pipeline.out(dt, cumsum, states)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def _code_task(args):
    """(code, None): the machine code (``variants.code_digest``) that a candidate plan compiles
    ``stage``'s kernels to on ``target``, at the specializations its launches take (compiled on
    the CPU); (None, why) when it cannot be told."""
    key, plan, stage, target = args
    try:
        digests = []
        for name, cfg, signature in launch_signatures(key, plan):
            if name in STAGE_KERNELS[stage]:
                result = compile_variant(Variant(name, cfg, signature, ("tune",)), target)
                if not result.ok:
                    return None, f"{name}: {result.error.strip()}"
                digests.append(result.code_digest)
        return "+".join(digests), None
    except Exception as exc:  # noqa: BLE001 - a candidate whose code is unknown is timed on its own
        return None, f"{type(exc).__name__}: {exc}"


def same_code_as(codes: list) -> list[int]:
    """For each candidate, the index of the first with the same code (itself when none came
    before it, or when its code is unknown: None)."""
    first: dict = {}
    return [i if code is None else first.setdefault(code, i) for i, code in enumerate(codes)]


def _search(shape, chunk_size, stage, pool, inputs, plan, dt, cumsum, states,
            out_alone: bool = False):
    """(rows, best): every fitting candidate of ``stage`` timed on ``plan``'s other stages, once
    per distinct machine code: a candidate that compiles to an earlier one's code (a knob that
    changes nothing at this shape) takes its time, with ``same_code_as`` naming it; one whose
    code could not be told is timed on its own, ``code_unknown`` saying why."""
    cands = [c for c in CANDIDATES[stage] if fits(c, shape, chunk_size, stage)]
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}"
    codes = [None] * len(cands)
    whys = [f"no CPU compile for {target}"] * len(cands)
    if target in TARGETS:
        problem = _pipeline(inputs, chunk_size).problem
        key = ssd.ProblemKey.from_problem(problem, varlen=False, wide=plan.out.wide)
        codes, whys = zip(*pool.map(_code_task, [(key, with_candidate(plan, stage, c), stage,
                                                  target) for c in cands]))
        unknown = [why for why in whys if why]
        if unknown:
            print(f"{shape} {stage}: the code of {len(unknown)} of {len(cands)} candidates is "
                  f"unknown, so each of those is timed on its own; the first reason: "
                  f"{unknown[0][-400:]}", flush=True)
    twins = same_code_as(codes)
    firsts = [i for i, twin in enumerate(twins) if twin == i]
    errors = dict(zip(firsts, pool.map(_compile_task, [(shape, chunk_size, stage, cands[i], None,
                                                         out_alone) for i in firsts])))
    rows = []
    for i, cand in enumerate(cands):
        row = dict(cand)
        if whys[i]:
            row["code_unknown"] = whys[i][-300:]
        if twins[i] != i:
            row.update({k: v for k, v in rows[twins[i]].items() if k in ("ms", "error")},
                       same_code_as=twins[i])
        elif errors[i]:
            row["error"] = errors[i]
        else:
            pipeline = _pipeline(inputs, chunk_size, with_candidate(plan, stage, cand))
            try:
                row["ms"] = time_ms(_stage_call(pipeline, stage, dt, cumsum, states), reps=7)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        twin = f" (the code of candidate {twins[i]})" if twins[i] != i else ""
        print(f"{shape} {stage} {cand}: {row.get('ms', row.get('error'))}{twin}", flush=True)
    timed = [r for r in rows if "ms" in r]
    if not timed:
        raise RuntimeError(f"{shape} {stage}: no candidate ran: {rows[0].get('error')}")
    return rows, min(timed, key=lambda r: r["ms"])


def tune_shape(shape, pool, stages=tuple(CANDIDATES),
               chunk_size: int = ssd.DEFAULT_CHUNK_SIZE, out_alone: bool = False) -> dict:
    """One shape's record: each stage in ``stages`` searched (the others at the dispatcher's
    choice), then probed in the other precision modes. out_alone: time calls that return out
    alone (their chunk states in 'input' with bf16 x, ``ssd.state_precision``); the table's key
    is the same, so a later run's winners serve both kinds of call."""
    inputs = shape_inputs(shape, out_alone=out_alone)
    base = _pipeline(inputs, chunk_size)
    dt, cumsum = base.cumsum()
    states, _, _ = base.states(dt, cumsum)
    runs = plan_stages(base.plan)
    record = dict(shape=dict(zip(("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups",
                                  "dtype"), shape)),
                  chunk_size=chunk_size, out_alone=out_alone,
                  dispatcher={s: asdict(getattr(base.plan, FIELD[s])) for s in runs},
                  stages={}, best={})
    plan = base.plan
    for stage in runs:
        if stage in stages:
            record["stages"][stage], best = _search(shape, chunk_size, stage, pool, inputs, plan,
                                                    dt, cumsum, states, out_alone)
        else:
            # Not searched: the dispatcher's choice stands (and is what the table keeps).
            dispatched = asdict(getattr(plan, FIELD[stage]))
            best = {k: dispatched[k] for k in CANDIDATES[stage][0]}
            best["ms"] = time_ms(_stage_call(_pipeline(inputs, chunk_size, plan), stage, dt, cumsum,
                                             states), reps=7)
        record["best"][stage] = best
        plan = with_candidate(plan, stage, _tiles(stage, best))
        tasks = []
        searched = getattr(getattr(plan, FIELD[stage]), "precision", None)
        # The fused scan runs in 'input' alone: in another mode the call takes the two state
        # kernels (ssd.fuses_state_scan), which this plan's probe would not time.
        probed = () if plan.state_scan is not None else PRECISION_PROBES.get(stage, ())
        for precision in probed:
            if precision == searched or not _accepts(precision, shape[-1]):
                continue
            tabled = _dispatched(inputs, chunk_size, stage, precision)
            tasks += [(shape, chunk_size, stage, tiles, precision, out_alone) for tiles in
                      probe_candidates(stage, record["stages"].get(stage, []), best, tabled)]
        probes = []
        for (_, _, _, cand, precision, _), error in zip(tasks, pool.map(_compile_task, tasks)):
            pipeline = _pipeline(inputs, chunk_size, with_candidate(plan, stage, cand, precision))
            stored = pipeline.plan.state_passing.state_dtype
            ms = None if error else time_ms(_stage_call(
                pipeline, stage, dt, cumsum,
                states if states.dtype == stored else pipeline.states(dt, cumsum)[0]), reps=7)
            probes.append(dict(cand, precision=precision, state_dtype=str(stored), ms=ms,
                               error=error))
            print(f"{shape} {stage} probe {precision} {cand}: {ms or error}", flush=True)
        record.setdefault("precision_probes", {})[stage] = probes
    record["default_ms"] = time_ms(_stage_call(base, "compute_out", dt, cumsum, states), reps=7) \
        + time_ms(_stage_call(base, "states", dt, cumsum, states), reps=7)
    tuned = _pipeline(inputs, chunk_size, plan)
    record["tuned_ms"] = time_ms(_stage_call(tuned, "compute_out", dt, cumsum, states), reps=7) \
        + time_ms(_stage_call(tuned, "states", dt, cumsum, states), reps=7)
    record["key"] = record_key(record, ssd.resolve_precision(None, inputs["x"].dtype))
    del inputs
    torch.cuda.empty_cache()
    return record


def record_key(record: dict, precision: str) -> dict:
    """The dispatcher key (``ssd.tuning_key``) of a tuned shape in a precision mode."""
    shape = record["shape"]
    dtype = getattr(torch, shape["dtype"])
    key = ssd.ProblemKey(batch=shape["batch"], seqlen=shape["seqlen"], nheads=shape["nheads"],
                         headdim=shape["headdim"], dstate=shape["dstate"],
                         ngroups=shape["ngroups"],
                         chunk_size=record.get("chunk_size", ssd.DEFAULT_CHUNK_SIZE),
                         x_dtype=dtype, b_dtype=dtype, c_dtype=dtype)
    return ssd.tuning_key(key, precision)


def _accepts(precision: str, dtype: str) -> bool:
    """Whether ssd_forward takes ``precision`` with x of ``dtype``."""
    try:
        ssd.resolve_precision(precision, getattr(torch, dtype))
    except SSDInputError:
        return False
    return True


def _tiles(stage: str, row: dict) -> dict:
    return {k: row[k] for k in CANDIDATES[stage][0] if k in row}


def _fastest(rows: list[dict], shared: bool) -> dict | None:
    """The fastest timed row run with the key's score sharing (rows of runs that searched it as
    a knob say which they had)."""
    timed = [r for r in rows
             if r.get("ms") is not None and r.get("shared_scores", shared) == shared]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def table(records: list[dict], provenance: dict, command: str) -> dict:
    """The winners per dispatcher key: the first shape of a key decides (the others measured at
    that key are listed with their own winners' times, for the reader to compare). Each probed
    compute_out mode gets an entry too, from its fastest probe (the other stages' tiles are the
    searched mode's). Records of several runs (``merged_table``) carry their run's index: a later
    run's winners replace an earlier one's for the stages it searched, except that a probe of a
    mode (the search's four fastest candidates and the mode's tiles in the table then) never
    replaces compute_out tiles that a search in that mode chose."""
    entries, decided_by = {}, {}
    for r in records:
        run = r.get("run", 0)
        searched = r["key"]["precision"]
        key = record_key(r, searched)
        best = {s: _fastest(r.get("stages", {}).get(s, []), key["shared_scores"]) or r["best"][s]
                for s in r["best"]}
        times = dict(default_ms=round(r["default_ms"], 4), tuned_ms=round(r["tuned_ms"], 4))
        if all(_tiles(s, r.get("dispatcher", {}).get(s, {})) == _tiles(s, best[s]) for s in best):
            # The search kept the dispatcher's tiles: its two times are one plan timed twice.
            times["dispatcher_kept"] = True
        found = {searched: (best, times)}
        probed = r.get("precision_probes", {}).get("compute_out", [])
        for mode in dict.fromkeys(p["precision"] for p in probed):
            probe = _fastest([p for p in probed if p["precision"] == mode], key["shared_scores"])
            if probe is not None and mode != searched:
                found[mode] = (dict(best, compute_out=probe),
                               dict(probed=True, compute_out_ms=round(probe["ms"], 4)))
        for mode, (winners, times) in found.items():
            key = record_key(r, mode)
            name = json.dumps(key, sort_keys=True)
            entry = entries.setdefault(name, dict(key=key, measured=[]))
            for s in winners:
                by_search = mode == searched or s != "compute_out"   # not a mode's probe
                if s in entry:
                    earlier_run, earlier_by_search = decided_by[name, s]
                    if not (r.get("stages", {}).get(s) and earlier_run < run
                            and (by_search or not earlier_by_search)):
                        continue
                entry[s], decided_by[name, s] = _tiles(s, winners[s]), (run, by_search)
            entry["measured"].append(dict(shape=r["shape"], **times, own_winners=winners))
    ordered = [dict(key=e["key"], **{s: e[s] for s in CANDIDATES if s in e},
                    measured=e["measured"]) for e in entries.values()]
    return dict(produced_by=command, tuned_by=provenance.get("command"), provenance=provenance,
                entries=ordered)


def merged_table(runs: list[dict], command: str) -> dict:
    """One table from saved tune.json runs, in order: each stage of a key from the latest run
    that searched it (a run's unsearched stages are the dispatcher's choice, i.e. the table's
    earlier winners). Provenance is the last run's; ``sources`` lists every run's."""
    records = [dict(r, run=i) for i, run in enumerate(runs) for r in run["records"]]
    document = table(records, runs[-1]["provenance"], command)
    if len(runs) > 1:
        document["sources"] = [dict(tuned_by=run["provenance"].get("command"),
                                    provenance=run["provenance"]) for run in runs]
    return document


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kernels.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for tune.json (rewritten after every shape)")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--write-table", action="store_true",
                        help=f"also write the winners to {TABLE_PATH}")
    parser.add_argument("--shapes", default=None,
                        help="indexes into SHAPES to tune (default: all, unless --shape is "
                             "given): " + "; ".join(f"{i}: {s}" for i, s in enumerate(SHAPES)))
    parser.add_argument("--shape", action="append", default=[], metavar="B,L,H,P,N,G[,dtype]",
                        help="a shape of your own to tune (repeatable; dtype of x, B, C: "
                             f"{', '.join(SHAPE_DTYPES)}; default bfloat16)")
    parser.add_argument("--cache", action="store_true",
                        help="merge the winners into the per-user tuning cache "
                             "(kernels.ssd.tuning_cache_path(); $MAMBA2_CUTILE_TUNING_CACHE)")
    parser.add_argument("--chunk-size", type=int, default=ssd.DEFAULT_CHUNK_SIZE,
                        choices=ssd.SUPPORTED_CHUNK_SIZES,
                        help="the chunk size to tune at (a key of its own in the table)")
    parser.add_argument("--stages", default=",".join(CANDIDATES),
                        help="stages to search (default: all; '' for none: a timing of the "
                             "dispatcher's choice); the others keep the dispatcher's choice")
    parser.add_argument("--table-from", metavar="TUNE_JSON", action="append", default=[],
                        help="no tuning: write the table from the shapes a saved tune.json "
                             "(or tune.json.gz) completed (its provenance is kept); repeatable, "
                             "oldest first: a "
                             "later run's winners replace an earlier one's for the stages it "
                             "searched")
    parser.add_argument("--out-alone", action="store_true",
                        help="time calls that return out alone, as the benchmarks and a model "
                             "layer make them (with bf16 x their chunk states are summed in "
                             "'input'); the table's keys are the same")
    args = parser.parse_args(argv)
    command = "python3 -m kernels.tune " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.table_from:
        runs = []
        for path in args.table_from:
            # Superseded runs are kept gzipped (the tree that travels to the H200 is size-bound).
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
                runs.append(json.load(f))
        write_table(merged_table(runs, command))
        return 0
    if not args.out:
        parser.error("--out: expected a folder (or --table-from), got none")
    stages = tuple(filter(None, args.stages.split(",")))
    if not set(stages) <= set(CANDIDATES):
        parser.error(f"--stages: expected names from {tuple(CANDIDATES)}, got {args.stages!r}")
    try:
        indexes = args.shapes if args.shapes is not None else (
            "" if args.shape else ",".join(str(i) for i in range(len(SHAPES))))
        shapes = [SHAPES[int(i)] for i in filter(None, indexes.split(","))]
    except (ValueError, IndexError):
        parser.error(f"--shapes: expected indexes 0..{len(SHAPES) - 1}, got {args.shapes!r}")
    try:
        shapes += [parse_shape(text) for text in args.shape]
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("tune: no CUDA device visible to torch", file=sys.stderr)
        return 2
    from properties.provenance import collect, write_json  # noqa: PLC0415
    os.makedirs(args.out, exist_ok=True)
    records = []
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        for shape in shapes:
            records.append(tune_shape(shape, pool, stages, args.chunk_size, args.out_alone))
            # Rewritten after every shape: a run cut short keeps the shapes it finished.
            write_json(os.path.join(args.out, "tune.json"),
                       dict(provenance=collect(), records=records))
            print(f"{shape}: default {records[-1]['default_ms']:.3f} ms -> tuned "
                  f"{records[-1]['tuned_ms']:.3f} ms", flush=True)
    if args.write_table:
        write_table(table(records, collect(), command))
    if args.cache:
        write_cache(table(records, collect(), command))
    return 0


def write_table(document: dict) -> None:
    from properties.provenance import write_json  # noqa: PLC0415
    write_json(TABLE_PATH, document)
    print(f"wrote {TABLE_PATH}: {len(document['entries'])} entries")


def write_cache(document: dict, path: str | None = None) -> str:
    """Merge a table's entries into the user's tuning cache, each stamped with the GPU model it
    was measured on (provenance device), replacing an earlier entry of the same key and model."""
    path = path or ssd.tuning_cache_path()
    device = document["provenance"]["device"]
    fresh = [dict(entry, device=device, provenance=document["provenance"],
                  produced_by=document["produced_by"]) for entry in document["entries"]]
    ids = {(json.dumps(e["key"], sort_keys=True), device) for e in fresh}
    kept = [e for e in ssd.load_tuning_entries(path)
            if (json.dumps(e["key"], sort_keys=True), e.get("device")) not in ids]
    from properties.provenance import write_json  # noqa: PLC0415
    write_json(path, dict(entries=kept + fresh))
    print(f"wrote {path}: {len(fresh)} entries for {device} ({len(kept)} others kept)")
    return path


if __name__ == "__main__":
    sys.exit(main())
