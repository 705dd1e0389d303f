"""The benchmark's bookkeeping, on the CPU: byte and FLOP counts, shapes, error slices, the fla
convention, timing statistics, the table, the plot and the --check logic on synthetic results."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch

from oracles.chunked_reference import chunked_ssd
from properties import bench
from properties.problems import ProblemSpec, build_problem
from properties.provenance import write_json

SMALL = ProblemSpec(batch=2, seqlen=48, nheads=4, headdim=8, dstate=8, ngroups=2, chunk_size=16)


def _output_bytes(problem) -> int:
    n = problem.x.nbytes
    if problem.return_final_states:
        n += problem.batch * problem.nheads * problem.headdim * problem.dstate * 4
    if problem.return_varlen_states:
        n += problem.nseq * problem.nheads * problem.headdim * problem.dstate * 4
    return n


@pytest.mark.parametrize("changes", [
    {},
    dict(x_dtype="bf16", bc_dtype="fp16", param_dtype="bf16", return_final_states=False),
    dict(D="head", z=True, dt_bias=True, dt_softplus=True),
    dict(D="channel", initial_states=True, state_dtype="bf16"),
    dict(batch=1, cu_seqlens=(0, 10, 48), initial_states=True, per_sequence_initial_states=True,
         return_varlen_states=True),
    dict(batch=1, cu_seqlens=(0, 20, 30, 48), pass_seq_idx=False, x_dtype="fp16"),
], ids=["plain", "mixed-dtypes", "head-D-z-bias", "channel-D-init", "varlen", "cu-only"])
def test_io_bytes_is_every_tensor_read_once_and_written_once(changes):
    spec = dataclasses.replace(SMALL, **changes)
    problem = build_problem(spec)
    inputs = sum(v.nbytes for v in problem.call_kwargs().values() if isinstance(v, torch.Tensor))
    assert bench.io_bytes(spec) == inputs + _output_bytes(problem)


def test_io_bytes_of_the_first_anchor_matches_the_device_readme():
    # "Reading all inputs once and writing the output once at 4.3 TB/s would take ~0.13 ms".
    spec = bench.bench_shapes("anchors", 128)[0].spec
    assert 0.125 < bench.io_bytes(spec) / (bench.NOMINAL_GBPS * 1e6) < 0.135


def _enumerated_flops(batch, seqlen, nheads, headdim, dstate, ngroups, Q) -> int:
    """The chunked algorithm's multiply-adds counted loop by loop (x 2)."""
    macs = 0
    for start in range(0, seqlen, Q):
        q = min(Q, seqlen - start)
        for i in range(q):
            for _ in range(i + 1):                 # causal pairs (i, j <= i)
                macs += ngroups * dstate           # C_i . B_j, once per group
                macs += nheads * headdim           # scores x (dt x)_j, per head
            macs += nheads * headdim * dstate      # increment of the chunk's state
            macs += nheads * headdim * dstate      # C_i . h_chunk
        macs += nheads * headdim * dstate          # state passing
    return 2 * batch * macs


@pytest.mark.parametrize("dims", [(1, 4, 1, 1, 1, 1, 2), (1, 5, 1, 1, 1, 1, 2),
                                  (2, 37, 4, 3, 5, 2, 8), (3, 64, 6, 4, 2, 3, 16),
                                  (1, 100, 2, 2, 2, 1, 128)])
def test_chunked_flops_counts_the_algorithms_loops(dims):
    assert bench.chunked_flops(*dims) == _enumerated_flops(*dims)


def test_chunked_flops_by_hand():
    # L=4, Q=2, sizes 1: pairs 2*(2*3)=12 -> 24 (scores, intra); 4*4=16 (state, inter); 2*2 passing.
    assert bench.chunked_flops(1, 4, 1, 1, 1, 1, 2) == 44
    assert bench.chunked_flops(1, 5, 1, 1, 1, 1, 2) == 54      # a last chunk of one position
    assert bench.chunked_flops(8, 4096, 64, 64, 128, 1, 256) == \
        8 * bench.chunked_flops(1, 4096, 64, 64, 128, 1, 256)


def test_shapes():
    anchors = bench.bench_shapes("anchors", 128)
    assert [(s.spec.batch, s.spec.seqlen, s.spec.nheads, s.spec.headdim, s.spec.dstate,
             s.spec.ngroups) for s in anchors] == list(bench.ANCHOR_DIMS)
    for shape in anchors:
        spec = shape.spec
        assert (spec.x_dtype, spec.bc_dtype, spec.param_dtype) == ("bf16", "bf16", "fp32")
        assert spec.chunk_size == 128 and not spec.return_final_states
    every = bench.bench_shapes("all", 64)
    labels = [s.label for s in every]
    assert len(labels) == len(set(labels))
    # The scaling sweep meets two anchors; each is measured once, with both tags.
    tags = {s.label: s.tags for s in every}
    assert tags["b1 L65536 H64 P64 N128 G1 bf16"] == ("anchor", "scaling")
    scaling = [s.spec for s in every if "scaling" in s.tags]
    assert {(s.batch, s.seqlen) for s in scaling} >= {(1, 512), (1, 65536), (8, 512), (8, 16384)}
    assert all(s.batch * s.seqlen <= bench.SCALING_MAX_TOKENS for s in scaling)
    variants = {s.label for s in every if any(t.startswith("variant") for t in s.tags)}
    assert variants == {"b8 L4096 H64 P128 N128 G1 bf16", "b8 L4096 H64 P64 N64 G1 bf16",
                        "b8 L4096 H64 P64 N256 G1 bf16", "b8 L4096 H64 P64 N128 G8 bf16",
                        "b8 L4096 H64 P64 N128 G1 fp16", "b8 L4096 H64 P64 N128 G1 fp32",
                        "b8 L4096 H64 P64 N128 G1 bf16 +z +D/channel"}
    assert {s.label for s in bench.bench_shapes("variants", 64)} == variants
    quick = bench.bench_shapes("scaling", 64, quick=True)
    assert {s.spec.seqlen for s in quick} == set(bench.QUICK_SCALING_SEQLENS)
    with pytest.raises(ValueError, match="^shapes: expected"):
        bench.bench_shapes("everything", 64)


def test_the_models_shapes_are_the_published_layers_apart_from_all():
    models = bench.bench_shapes("models", 64)
    assert len(models) == 2 * len(bench.MODEL_LAYERS) == 12
    labels = {s.label: s.tags for s in models}
    layer = " +D/head +dt_bias +softplus"
    assert labels["b1 L16384 H80 P64 N128 G1 bf16" + layer + " +final_states"] == (
        "model:mamba2-2.7b",)
    assert labels["b8 L2048 H128 P64 N128 G8 bf16" + layer] == ("model:mamba-codestral-7b",)
    for shape in models:
        spec = shape.spec
        assert (spec.headdim, spec.dstate, spec.D, spec.chunk_size) == (64, 128, "head", 64)
        assert spec.dt_bias and spec.dt_softplus and spec.dt_limit is None and not spec.z
        assert spec.return_final_states == (spec.batch == 1)      # the prefill's, for the cache
    assert not set(labels) & {s.label for s in bench.bench_shapes("all", 64)}
    # Their run is written beside the shape sets' bench.json, never over it.
    assert bench.default_out_dir("models") == bench.default_out_dir("all") / "models"
    assert bench.default_out_dir("all") == bench.default_out_dir("anchors")


def test_the_packed_shapes_are_the_models_batched_prefills_apart_from_all():
    packed = bench.bench_shapes("packed", 64)
    assert len(packed) == 2 * len(bench.MODEL_LAYERS) == 12
    labels = {s.label: s.tags for s in packed}
    layer = " +D/head +dt_bias +softplus +8 seqs"
    assert labels["b1 L16384 H80 P64 N128 G1 bf16" + layer + " +varlen_states"] == (
        "packed:mamba2-2.7b",)
    assert labels["b1 L16384 H128 P64 N128 G8 bf16" + layer + " +seq_starts +varlen_states"] == (
        "packed:mamba-codestral-7b",)
    offsets = bench.PACKED_OFFSETS
    assert offsets[0] == 0 and list(offsets) == sorted(set(offsets))
    assert any(b - a == 100 for a, b in zip(offsets, offsets[1:]))       # a short sequence
    assert any(o % 64 for o in offsets)                                  # off chunk boundaries
    for shape in packed:
        spec = shape.spec
        assert (spec.batch, spec.seqlen, spec.cu_seqlens) == (1, offsets[-1], offsets)
        assert spec.pass_seq_idx and spec.return_varlen_states and not spec.return_final_states
        assert spec.initial_states == spec.per_sequence_initial_states
        assert (spec.D, spec.dt_bias, spec.dt_softplus) == ("head", True, True)
        assert bench.error_slice(spec) == (1, spec.nheads, spec.ngroups)     # whole
    everything = {s.label for s in bench.bench_shapes("all", 64)}
    assert not set(labels) & (everything | {s.label for s in bench.bench_shapes("models", 64)})
    assert bench.default_out_dir("packed") == bench.default_out_dir("all") / "packed"


def test_a_packed_call_of_ours_replays_its_kernels_and_mamba_ssm_gets_its_cu_seqlens(
        monkeypatch):
    """ours' packed call refuses CUDA graph capture, so its graph row captures the call's kernels
    (kernels.ssd.launch_stages on the call's plan); mamba_ssm gets the call as ours does, with
    cu_seqlens where varlen states are asked for. Launches stood in for."""
    import kernels.ssd as ssd
    spec = dataclasses.replace(SMALL, batch=1, seqlen=100, chunk_size=64,
                               cu_seqlens=(0, 30, 31, 100), return_varlen_states=True)
    problem = build_problem(spec)
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    launched = []
    monkeypatch.setattr(ssd, "launch_stages", lambda pipeline: (
        launched.append(pipeline), ssd.SSDResult(out="out of the kernels", final_states=None))[1])
    ours = next(bench.our_contenders(problem))
    assert ours.name == "ours" and ours.captured is not None
    replayed = ours.captured
    assert replayed.output(replayed.call()) == "out of the kernels"
    (pipeline,) = launched
    assert pipeline.problem.x is problem.x and pipeline.problem.cu_seqlens is problem.cu_seqlens
    assert pipeline.varlen
    assert torch.equal(pipeline.seq_idx, problem.resolved_seq_idx().to(pipeline.seq_idx.dtype))
    assert bench.graph_replay(ours).name == "ours_graph"
    plain = next(bench.our_contenders(build_problem(SMALL)))
    assert plain.captured is None
    seen = {}
    (row,) = bench.mamba_contenders(problem, lambda **kwargs: (seen.update(kwargs), (1, 2))[1])
    assert row.output(row.call()) == 1
    assert seen["cu_seqlens"] is problem.cu_seqlens and seen["return_varlen_states"]
    assert seen["seq_idx"] is problem.seq_idx


def test_ours_runs_the_chunk_size_its_call_picks_where_varlen_states_decide_it(monkeypatch):
    # ours' row is ssd_forward's default call, whose pick counts varlen states: the first packed
    # layer runs chunk 256 (at 64 without varlen states the walk would take it, states unwritten).
    # Until 2026-12-07 the row planned as if none were asked for and timed chunk 64's kernels.
    import kernels.ssd as ssd
    spec = bench.bench_shapes("packed", None)[0].spec
    assert spec.return_varlen_states and not spec.per_sequence_initial_states
    problem = build_problem(dataclasses.replace(spec, chunk_size=64))
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    launched = []
    monkeypatch.setattr(ssd, "launch_stages", lambda pipeline: (
        launched.append(pipeline), ssd.SSDResult(out=None, final_states=None))[1])
    ours = next(bench.our_contenders(problem))
    ours.captured.call()
    (pipeline,) = launched
    assert pipeline.problem.chunk_size == ssd.default_chunk_size(problem) == 256
    assert ssd.default_chunk_size(dataclasses.replace(problem, return_varlen_states=False)) == 64
    # Where the walk takes varlen states (a rule written, not yet dispatched), the row walks at 64
    # and stores them.
    with ssd.dispatch_rules({("WALK_VARLEN_STATES", None): True}):
        launched.clear()
        next(bench.our_contenders(problem)).captured.call()
        (pipeline,) = launched
        assert pipeline.problem.chunk_size == ssd.default_chunk_size(problem) == 64
        assert pipeline.plan.named_configs()[-1] == ("varlen_states", pipeline.plan.chunk_state)


def test_error_slices_of_the_anchors():
    first, second, third = (s.spec for s in bench.bench_shapes("anchors", 128))
    assert bench.error_slice(first) == (8, 64, 1)          # 2^21 row-heads: whole
    assert bench.error_slice(second) == (4, 32, 8)
    assert bench.error_slice(third) == (1, 32, 1)          # half the heads of the one group


@pytest.mark.parametrize("spec,limit,expected", [
    (dataclasses.replace(SMALL, batch=3), 2 * 48 * 4, (2, 4, 2)),                    # rows cut
    (dataclasses.replace(SMALL, nheads=8, ngroups=2), 48 * 4, (1, 4, 1)),           # a whole group
    (dataclasses.replace(SMALL, nheads=8, ngroups=4), 48 * 5, (1, 4, 2)),           # whole groups
    (dataclasses.replace(SMALL, nheads=8, ngroups=1), 48 * 3, (1, 3, 1)),           # part of one
])
@pytest.mark.parametrize("start", [False, True])
def test_error_slice_is_a_problem_of_its_own(monkeypatch, spec, limit, expected, start):
    monkeypatch.setattr(bench, "ERROR_MAX_ROW_HEADS", limit)
    assert bench.error_slice(spec) == expected
    problem = build_problem(dataclasses.replace(spec, D="channel", z=True, dt_bias=True,
                                                dt_softplus=True, initial_states=start))
    rows, heads, groups = expected
    whole = chunked_ssd(problem, compute_dtype=torch.float64, state_dtype=torch.float64,
                        out_dtype=torch.float64).out
    sliced = bench.reference_out(problem, rows, heads, groups)
    assert sliced.dtype == torch.float64
    assert sliced.shape == (rows, spec.seqlen, heads, spec.headdim)
    torch.testing.assert_close(sliced, whole[:rows, :, :heads], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("changes", [
    dict(batch=3, seq_idx_rows=True),
    dict(batch=1, cu_seqlens=(0, 20, 21, 48), return_varlen_states=True),
    dict(batch=1, cu_seqlens=(0, 20, 21, 48), initial_states=True,
         per_sequence_initial_states=True, return_varlen_states=True)],
    ids=["seq_idx", "cu_seqlens", "per_sequence_starts"])
def test_error_slice_of_a_packed_problem_is_a_problem_of_its_own(monkeypatch, changes):
    """Packed problems slice too: seq_idx with their rows, per-sequence initial states whole
    (with their heads'), a row of cu_seqlens whole; the slice's reference out is the whole
    problem's, sliced. Fewer rows than a cu_seqlens problem's one are refused."""
    changes = dict(changes)
    packed_rows = changes.pop("seq_idx_rows", False)
    spec = dataclasses.replace(SMALL, nheads=8, ngroups=2, **changes)
    problem = build_problem(spec)
    if packed_rows:
        seq_idx = torch.zeros(3, 48, dtype=torch.int32)
        seq_idx[1, 17:] = 1
        seq_idx[2, 5:] += 1
        seq_idx[2, 40:] += 1
        problem = problem.with_tensors(seq_idx=seq_idx)
    rows = 2 if packed_rows else 1
    whole = chunked_ssd(problem, compute_dtype=torch.float64, state_dtype=torch.float64,
                        out_dtype=torch.float64).out
    sliced = bench.reference_out(problem, rows, 4, 1)
    torch.testing.assert_close(sliced, whole[:rows, :, :4], rtol=1e-12, atol=1e-12)
    if not packed_rows:
        with pytest.raises(ValueError, match="^error slice: expected all 1 rows of a problem "
                                             "with cu_seqlens, got 0$"):
            bench.sub_problem(problem, 0, 4, 1)


def _naive_simple_gla(q, k, v, g=None, scale=None, output_final_state=False, **unused):
    """fla's chunk_simple_gla semantics, step by step in float64: h_t = exp(g_t) h_{t-1} +
    k_t v_t^T, o_t = scale q_t . h_t; scale defaults to K^-0.5, as fla's does; (o, the last h
    (b, H, K, V) in float32 where output_final_state, else None)."""
    assert not unused, f"unexpected arguments {sorted(unused)}"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v, g = (t.to(torch.float64) for t in (q, k, v, g))
    b, L, H, K = q.shape
    h = torch.zeros(b, H, K, v.shape[-1], dtype=torch.float64)
    o = torch.empty(b, L, H, v.shape[-1], dtype=torch.float64)
    for t in range(L):
        h = torch.exp(g[:, t])[..., None, None] * h + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], h)
    return o.to(out_dtype), h.to(torch.float32) if output_final_state else None


@pytest.mark.parametrize("changes", [{}, dict(D="channel", z=True), dict(D="head", ngroups=4),
                                     dict(dt_bias=True, dt_softplus=True, dt_limit=(0.0, 0.3)),
                                     dict(return_final_states=False)])
def test_fla_rows_compute_the_ssd(changes):
    # q=C, k=B, v=x*dt, g=A*dt with scale 1.0 is the SSD: fla's semantics applied to the operands
    # the benchmark hands it (plus its D/z epilogue) reproduce the float64 chunked reference.
    spec = dataclasses.replace(SMALL, **changes)
    problem = build_problem(spec)
    reference = chunked_ssd(problem, compute_dtype=torch.float64, state_dtype=torch.float64,
                            out_dtype=torch.float64)
    exact = reference.out
    rows = {c.name: c for c in bench.fla_contenders(problem, _naive_simple_gla)}
    # Where the call returns final states, fla's row writes its own too (b, H, N, P): the same.
    _, fla_states = rows["fla_kernel"].call()
    assert (fla_states is not None) == spec.return_final_states
    if spec.return_final_states:
        torch.testing.assert_close(fla_states.transpose(-1, -2).to(torch.float64),
                                   reference.final_states, rtol=1e-5, atol=1e-6)
    assert set(rows) == {"fla_kernel", "fla_e2e"}
    e2e = rows["fla_e2e"].output(rows["fla_e2e"].call())
    assert e2e.dtype == problem.x.dtype
    torch.testing.assert_close(e2e.to(torch.float64), exact, rtol=1e-5, atol=1e-5)
    kernel = rows["fla_kernel"]
    if changes.get("z") or changes.get("D"):
        assert kernel.output is None and "error_note" in kernel.info
    else:
        torch.testing.assert_close(kernel.output(kernel.call()).to(torch.float64), exact,
                                   rtol=1e-5, atol=1e-5)


def test_fla_rows_fail_without_scale_one():
    # The same operands with fla's default scale (K^-0.5) are visibly wrong: the test above can
    # fail.
    problem = build_problem(SMALL)
    exact = chunked_ssd(problem, compute_dtype=torch.float64, out_dtype=torch.float64).out
    q, k, v, g = bench.fla_operands(problem)
    wrong = _naive_simple_gla(q, k, v, g=g)[0]
    assert not torch.allclose(wrong.to(torch.float64), exact, rtol=1e-2, atol=1e-2)


def test_mamba_row_is_its_default_call():
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return kwargs["x"]

    problem = build_problem(dataclasses.replace(SMALL, D="channel", z=True,
                                                return_final_states=False))
    (row,) = bench.mamba_contenders(problem, fake)
    assert row.output(row.call()) is problem.x
    assert row.name == "mamba_ssm" and row.chunk_size == seen["chunk_size"] == 256
    assert seen["D"] is problem.D and seen["z"] is problem.z and seen["dt"] is problem.dt
    assert not seen["return_final_states"] and not seen["return_varlen_states"]
    # A call that returns final states returns (out, final_states): the row checks out.
    states = build_problem(dataclasses.replace(SMALL, D="head", dt_bias=True, dt_softplus=True))
    (row,) = bench.mamba_contenders(states, lambda **kwargs: (kwargs["x"], kwargs["dt_bias"]))
    assert row.output(row.call()) is states.x


def test_draw_on_device_changes_nothing_on_the_cpu():
    spec = dataclasses.replace(SMALL, D="head", z=True, initial_states=True)
    a = build_problem(spec).call_kwargs()
    b = build_problem(spec, draw_on_device=True).call_kwargs()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[name]), name


def test_timing_arithmetic():
    summary = bench.timing_summary([5.0, 1.0, 2.0, 4.0, 3.0, 10.0, 6.0, 7.0, 8.0, 9.0])
    assert summary == dict(ms=5.5, ms_min=1.0, ms_p90=9.0, reps=10)
    plan = bench.TimingPlan(target_ms=100.0, min_reps=10, max_reps=200, warmup_ms=25.0)
    assert plan.reps(2.0) == 50 and plan.reps(50.0) == 10 and plan.reps(1e-4) == 200
    assert plan.warmups(2.0) == 13 and plan.warmups(100.0) == 1
    row = bench.derive_row(ms=2.0, nbytes=4_000_000_000, flops=10 ** 12, copy_gbps=4000.0)
    assert row["gbps"] == pytest.approx(2000.0)                 # 4 GB in 2 ms
    assert row["tflops"] == pytest.approx(500.0)
    assert row["copy_bound_fraction"] == pytest.approx(0.5)     # 1 ms at 4000 GB/s, took 2
    assert row["nominal_bound_fraction"] == pytest.approx(4000.0 / 4300.0 / 2.0)


# ---------------------------------------------------------------- synthetic results

LABEL_A = "b8 L4096 H64 P64 N128 G1 bf16"
LABEL_B = "b1 L65536 H64 P64 N128 G1 bf16"


def _record(label, ours_ms, peers, chunk_size=128, nbytes=562_036_992, copy_gbps=4000.0,
            seqlen=4096, batch=8, tags=("anchor",), kernels_ms=None):
    flops = 10 ** 12
    rows = {}
    if ours_ms is not None:
        rows["ours"] = dict(chunk_size=chunk_size, ms=ours_ms, ms_min=ours_ms, ms_p90=ours_ms,
                            reps=10, flops=flops, first_call_s=2.5,
                            error=dict(max_abs=1e-2, normwise_rel=2e-3),
                            **bench.derive_row(ours_ms, nbytes, flops, copy_gbps))
        kernels_ms = kernels_ms or ours_ms / 2
        for stage, share, variant in (
                ("chunk_cumsum", 4, "chunk_cumsum dt=torch.float32 Q=64"),
                ("fwd_pass_state", 4, "none: scan_out keeps the states in registers"),
                ("compute_out", 2, "chunk_scores Q=64; scan_out x=torch.bfloat16 Q=64")):
            rows[f"ours.{stage}"] = dict(chunk_size=chunk_size, ms=kernels_ms / share, reps=10,
                                         variant=variant)
    else:
        rows["ours"] = dict(chunk_size=chunk_size, failed="RuntimeError: boom")
    for name, ms in peers.items():
        rows[name] = dict(chunk_size=256, ms=ms, reps=10, flops=flops,
                          error=dict(max_abs=2e-2, normwise_rel=3e-3),
                          **bench.derive_row(ms, nbytes, flops, copy_gbps))
    record = dict(label=label, tags=list(tags),
                  spec=dict(batch=batch, seqlen=seqlen, nheads=64, headdim=64, dstate=128,
                            ngroups=1, x_dtype="bf16"),
                  io_bytes=nbytes, copy_bound_ms=nbytes / (copy_gbps * 1e6),
                  error_slice=dict(batch=1, heads=32, whole=False), rows=rows,
                  unavailable={"fla_kernel": "fla does not import: ModuleNotFoundError('fla')"})
    record["speedup"] = bench.speedups(record)
    return record


def _doc(*records, copy_gbps=4000.0):
    return dict(schema=bench.SCHEMA, provenance=dict(device="NVIDIA H200"),
                timing=dict(method="CUDA events"), copy_probe=dict(gbps=copy_gbps),
                nominal_gbps=bench.NOMINAL_GBPS, shapes=list(records), not_run=[])


def _pair(ours_a, mamba_a, ours_b, mamba_b):
    return _doc(_record(LABEL_A, ours_a, {"mamba_ssm": mamba_a}),
                _record(LABEL_B, ours_b, {"mamba_ssm": mamba_b}))


def test_speedup_and_judged_ratio():
    record = _record(LABEL_A, 0.5, {"mamba_ssm": 1.0, "fla_e2e": 2.0})
    assert record["speedup"] == {"mamba_ssm": 2.0, "fla_e2e": 4.0}
    # ours' kernels: its stage rows summed (0.0625 + 0.0625 + 0.125 ms), over the copy bound.
    assert bench.kernel_ms(record) == 0.25
    assert bench.judged_ratio(record) == pytest.approx(0.25 / record["copy_bound_ms"])
    record["rows"]["ours.compute_out"] = dict(failed="RuntimeError: boom")
    assert bench.kernel_ms(record) is None        # a stage that did not run: no kernel time
    assert bench.judged_ratio(_record(LABEL_A, None, {"mamba_ssm": 1.0})) is None


def test_check_passes_within_the_margin_and_ignores_absolute_times_and_peers():
    baseline = _pair(0.5, 1.0, 1.5, 2.5)
    # Everything twice as slow on a GPU of half the copy bandwidth: the same ratios.
    slower = _doc(_record(LABEL_A, 1.0, {"mamba_ssm": 2.0}, copy_gbps=2000.0),
                  _record(LABEL_B, 3.0, {"mamba_ssm": 5.0}, copy_gbps=2000.0), copy_gbps=2000.0)
    failures, lines = bench.check_regressions(slower, baseline, 0.15)
    assert failures == [] and len(lines) == 2 and all("ours' kernels" in line for line in lines)
    within = _pair(0.57, 1.0, 1.5, 2.5)
    assert bench.check_regressions(within, baseline, 0.15)[0] == []
    # mamba_ssm three times faster (another autotuned config): its ratio is printed, not judged.
    failures, lines = bench.check_regressions(_pair(0.5, 0.33, 1.5, 2.5), baseline, 0.15)
    assert failures == [] and "ours/mamba_ssm calls 1.52, baseline 0.50 (not judged)" in lines[0]


def test_check_fails_naming_the_shape_whose_kernels_regressed():
    baseline = _pair(0.5, 1.0, 1.5, 2.5)
    current = _pair(0.5, 1.0, 1.8, 2.5)         # B's kernels 0.75 -> 0.90 ms: +20%
    failures, _ = bench.check_regressions(current, baseline, 0.15)
    assert len(failures) == 1 and failures[0].startswith(LABEL_B + ": ours' kernels 0.900 ms")


def test_check_judges_kernels_not_a_host_bound_call_nor_launch_bound_kernels():
    """A call three times slower with its kernels unchanged passes (the host's time is not
    judged); kernels under KERNEL_FLOOR_MS are reported, not judged, and comparing nothing else
    fails the check."""
    baseline = _doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0}, kernels_ms=0.3))
    host_bound = _doc(_record(LABEL_A, 1.5, {"mamba_ssm": 1.0}, kernels_ms=0.3))
    assert bench.check_regressions(host_bound, baseline, 0.15)[0] == []
    tiny = _doc(_record(LABEL_A, 0.2, {"mamba_ssm": 1.0}, kernels_ms=0.05))
    failures, lines = bench.check_regressions(
        _doc(_record(LABEL_A, 0.2, {"mamba_ssm": 1.0}, kernels_ms=0.09)), tiny, 0.15)
    assert lines[0].startswith(f"{LABEL_A}: not judged: ours' kernels took 0.090 ms (baseline "
                               f"0.050), under {bench.KERNEL_FLOOR_MS} ms")
    assert len(failures) == 1 and failures[0].startswith("no shape of the baseline was compared")


def test_check_fails_when_ours_did_not_run_or_nothing_compares():
    baseline = _doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0}))
    failures, _ = bench.check_regressions(_doc(_record(LABEL_A, None, {"mamba_ssm": 1.0})),
                                          baseline)
    assert failures == [f"{LABEL_A}: ours did not run (ours: RuntimeError: boom)"]
    failures, _ = bench.check_regressions(_doc(_record(LABEL_B, 0.5, {})), baseline)
    assert len(failures) == 1 and failures[0].startswith("no shape of the baseline was compared")
    given = dict(_doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0}, chunk_size=64)),
                 our_chunk_size=64)
    failures, _ = bench.check_regressions(given, baseline)
    assert failures[0].startswith(f"{LABEL_A}: our chunk size 64 differs")


def test_check_compares_runs_at_ssd_forwards_own_chunk_picks():
    """Where neither run was given --chunk-size, ours ran at ssd_forward's pick in both: a new
    pick is compared like any change of ours (and named), not refused."""
    baseline = dict(_doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0}, chunk_size=256)),
                    our_chunk_size=None)
    picked = dict(_doc(_record(LABEL_A, 0.62, {"mamba_ssm": 1.0}, chunk_size=128)),
                  our_chunk_size=None)
    failures, lines = bench.check_regressions(picked, baseline, 0.15)
    assert "chunk 256 -> 128" in lines[0] and "REGRESSED" in lines[0]
    assert failures and failures[0].startswith(f"{LABEL_A}: ours' kernels 0.310 ms")
    baseline["provenance"] = dict(command="properties bench --chunk-size 256")
    del baseline["our_chunk_size"]
    failures, _ = bench.check_regressions(picked, baseline)
    assert failures[0].startswith(f"{LABEL_A}: our chunk size 128 differs")


def _args(**overrides):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_cli_check_exit_status_names_the_shape(tmp_path, capsys):
    baseline, current = tmp_path / "baseline.json", tmp_path / "current.json"
    baseline.write_text(json.dumps(_doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0}),
                                        _record(LABEL_B, 1.5, {"mamba_ssm": 2.5}))))
    current.write_text(json.dumps(_doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0}),
                                       _record(LABEL_B, 2.0, {"mamba_ssm": 2.5}))))
    assert bench.main(_args(check=baseline, results=[current])) == 1
    captured = capsys.readouterr()
    assert "bench --check FAILED" in captured.err and LABEL_B in captured.err
    assert LABEL_A not in captured.err
    assert bench.main(_args(check=baseline, results=[baseline])) == 0
    assert "bench --check passed" in capsys.readouterr().out


def test_cli_refuses_bad_files_and_a_missing_gpu(tmp_path, capsys):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "something else"}))
    assert bench.main(_args(results=[wrong])) == 2
    assert "expected schema" in capsys.readouterr().err
    assert bench.main(_args(results=[tmp_path / "missing.json"])) == 2
    if not torch.cuda.is_available():
        assert bench.main(_args()) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_only_selects_shapes_by_label_text(capsys):
    variants = bench.bench_shapes("variants", 256)
    picked = bench.select_shapes(variants, "N256, fp32")
    assert [s.label for s in picked] == ["b8 L4096 H64 P64 N256 G1 bf16",
                                         "b8 L4096 H64 P64 N128 G1 fp32"]
    assert bench.select_shapes(variants, None) == variants
    for only, words in (("N512", "'N512' matches none"), (",", "got ','")):
        with pytest.raises(ValueError, match="^only: expected") as raised:
            bench.select_shapes(variants, only)
        assert words in str(raised.value) and "b8 L4096 H64 P128 N128 G1 bf16" in str(raised.value)
    # A bad --only is refused before the GPU is looked for, naming the option.
    assert bench.main(_args(shapes="variants", only="N512")) == 2
    assert "bench: --only: expected" in capsys.readouterr().err


def test_cli_reports_a_failure_of_ours(tmp_path, capsys):
    results = tmp_path / "bench.json"
    results.write_text(json.dumps(_doc(_record(LABEL_A, None, {"mamba_ssm": 1.0}))))
    assert bench.main(_args(results=[results])) == 1
    assert f"{LABEL_A}: ours: RuntimeError: boom" in capsys.readouterr().err


def test_table():
    doc = _doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0, "fla_e2e": 2.0}),
               _record(LABEL_B, None, {"mamba_ssm": 2.5}))
    text = bench.format_table(doc)
    lines = text.splitlines()
    assert "copy probe 4000 GB/s" in lines[0]
    header = next(line for line in lines if "GB/s" in line and "TFLOP/s" in line)
    for column in bench.COLUMNS:
        assert column in header
    mamba = next(line for line in lines if line.strip().startswith("mamba_ssm"))
    assert " 2.00 " in mamba and " 562 " in mamba         # t/t_ours 2.00; 562 MB in 1 ms
    stage = next(line for line in lines if line.strip().startswith("ours.compute_out"))
    assert " 0.25 " in stage                               # its share: 0.125 of 0.5 ms
    assert "errors on batch[:1] heads[:32]" in text
    assert ("stages' kernels: chunk_cumsum: chunk_cumsum; fwd_pass_state: none (scan_out keeps "
            "the states in registers); compute_out: chunk_scores + scan_out") in " ".join(
                line.strip() for line in lines)
    assert "FAILED: RuntimeError: boom" in text
    assert "first call, s (ours' compiles, cuTile's disk cache not recorded): ours 2.50" in text
    doc["provenance"]["cutile_disk_cache"] = None
    assert "first call, s (ours' compiles included: cuTile's disk cache off): ours 2.50" in (
        bench.format_table(doc))
    assert "fla_kernel: not run (fla does not import" in text
    summary = lines[lines.index(bench.SUMMARY_TITLE) + 1:]
    assert summary[1].split()[-8:] == ["0.500", "1124", "28%", "2.00", "-", "4.00", "-",
                                       "2.00e-03"]
    assert summary[2].endswith("FAILED")


def test_graph_rows_compare_with_ours_graph():
    # A peer's graph replay is set against ours' (0.75 / 0.25 ms), not against ours' call; ours'
    # graph row against nothing, as ours' call.
    record = _record(LABEL_A, 0.5, {"ours_graph": 0.25, "mamba_ssm": 1.0,
                                    "mamba_ssm_graph": 0.75})
    assert record["speedup"] == {"mamba_ssm": 2.0, "mamba_ssm_graph": 3.0}
    lines = bench.format_table(_doc(record)).splitlines()
    graph = next(line for line in lines if line.strip().startswith("mamba_ssm_graph"))
    assert " 3.00 " in graph
    ours_graph = next(line for line in lines if line.strip().startswith("ours_graph"))
    assert ours_graph.split()[7] == "-"                     # the t/t_ours column
    summary = lines[lines.index(bench.SUMMARY_TITLE) + 1:]
    assert "x mamba_ssm_graph" in summary[0]
    assert summary[1].split()[-3:] == ["-", "3.00", "2.00e-03"]


def test_plot(tmp_path):
    records = [_record(f"b{b} L{L} H64 P64 N128 G1 bf16", 0.01 * L / 512 * b,
                       {"mamba_ssm": 0.02 * L / 512 * b, "fla_e2e": 0.03 * L / 512 * b},
                       seqlen=L, batch=b, tags=("scaling",))
               for b in (1, 8) for L in (512, 1024, 2048)]
    path = tmp_path / "scaling.png"
    assert bench.plot_scaling(_doc(*records), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size < 150_000
    assert not bench.plot_scaling(_doc(_record(LABEL_A, 0.5, {})), tmp_path / "none.png")


def test_shapes_plot(tmp_path):
    doc = _doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0, "fla_e2e": 2.0}),
               _record(LABEL_B, None, {"mamba_ssm": 1.0}))
    path = tmp_path / "shapes.png"
    assert bench.plot_shapes(doc, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size < 150_000
    assert not bench.plot_shapes(_doc(_record(LABEL_B, None, {})), tmp_path / "none.png")


def test_outputs_written_from_results(tmp_path):
    results = tmp_path / "bench.json"
    record = _record(LABEL_A, 0.5, {"mamba_ssm": 1.0}, tags=("scaling",))
    results.write_text(json.dumps(_doc(record)))
    out = tmp_path / "out"
    assert bench.main(_args(results=[results], out=out)) == 0
    assert json.loads((out / "bench.json").read_text())["shapes"][0]["label"] == LABEL_A
    assert LABEL_A in (out / "bench.txt").read_text()
    assert (out / "bench_scaling.png").exists() and (out / "bench_shapes.png").exists()
    assert math.isclose(json.loads((out / "bench.json").read_text())["copy_probe"]["gbps"], 4000.0)


# ---------------------------------------------------------------- one shape, end to end, on the CPU

class _WallClockTimer:
    """Stands in for CudaTimer on the CPU: the same summary, from time.perf_counter."""

    def measure(self, fn):
        import time
        times = []
        for _ in range(3):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        return bench.timing_summary(times)


def _fp32_reference(**kwargs):
    from oracles.chunked_reference import ssd_reference
    return ssd_reference(**kwargs, compute_dtype=torch.float32)


def _stand_in_ours(problem, chunk_size=None):
    yield bench.Contender("ours", problem.chunk_size,
                          lambda: _fp32_reference(**problem.call_kwargs()), lambda out: out)
    yield bench.Contender("ours.compute_out", problem.chunk_size, lambda: None, None)


SHAPE = bench.BenchShape(dataclasses.replace(SMALL, D="channel", z=True, return_final_states=False),
                         ("scaling",))


def test_bench_shape_records_every_row(monkeypatch):
    # The orchestration of one shape, with stand-ins: ours and mamba_ssm are the fp32 chunked
    # reference, fla is its semantics in float64 (_naive_simple_gla).
    monkeypatch.setattr(bench, "our_contenders", _stand_in_ours)
    ctx = bench.RunContext(timer=_WallClockTimer(), copy_gbps=100.0, device="cpu",
                           peers={"mamba_ssm": (_fp32_reference, "stand-in"),
                                  "fla": (_naive_simple_gla, "stand-in")})
    record = bench.bench_shape(SHAPE, ctx)
    rows = record["rows"]
    assert list(rows) == ["ours", "ours.compute_out", "mamba_ssm", "fla_kernel", "fla_e2e"]
    assert record["label"] == SHAPE.label and record["io_bytes"] == bench.io_bytes(SHAPE.spec)
    assert record["error_slice"] == dict(batch=2, heads=4, whole=True)
    for name in ("ours", "mamba_ssm", "fla_e2e"):
        row = rows[name]
        assert row["ms"] > 0 and row["reps"] == 3 and row["gbps"] > 0 and row["tflops"] > 0
        assert row["error"]["normwise_rel"] < 1e-5, name      # fp32 outputs of exact algorithms
    assert rows["mamba_ssm"]["chunk_size"] == 256 and rows["fla_e2e"]["chunk_size"] == 64
    assert "error" not in rows["fla_kernel"]                    # o lacks D and z here
    assert "error" not in rows["ours.compute_out"] and "gbps" not in rows["ours.compute_out"]
    assert set(record["speedup"]) == {"mamba_ssm", "fla_kernel", "fla_e2e"}
    # CUDA graphs need a GPU: the graph rows are reported as not run, not failed.
    assert record["unavailable"] == {name + bench.GRAPH: "CUDA graphs need a GPU"
                                     for name in bench.GRAPHED_ROWS}
    doc = _doc(record)
    assert bench.our_failures(doc) == []
    assert SHAPE.label in bench.format_table(doc)


def test_bench_shape_of_a_packed_call_records_ours_and_mamba_ssm_and_fla_refusing(monkeypatch):
    """A packed shape (cu_seqlens, varlen states) through the same orchestration, stand-ins as
    above: ours and mamba_ssm checked against the packed float64 reference, fla's rows refusing
    the packing as peer failures, none of ours failing."""
    monkeypatch.setattr(bench, "our_contenders", lambda problem, chunk_size=None: iter([
        bench.Contender("ours", problem.chunk_size,
                        lambda: _fp32_reference(**problem.call_kwargs()), bench.out_of)]))
    ctx = bench.RunContext(timer=_WallClockTimer(), copy_gbps=100.0, device="cpu",
                           peers={"mamba_ssm": (_fp32_reference, "stand-in"),
                                  "fla": (_naive_simple_gla, "stand-in")})
    spec = dataclasses.replace(SMALL, batch=1, cu_seqlens=(0, 20, 21, 48), D="head",
                               return_final_states=False, return_varlen_states=True)
    record = bench.bench_shape(bench.BenchShape(spec, ("packed:test",)), ctx)
    rows = record["rows"]
    for name in ("ours", "mamba_ssm"):
        assert rows[name]["error"]["normwise_rel"] < 1e-5, name
    for name in ("fla_kernel", "fla_e2e"):
        assert rows[name]["failed"].startswith("ValueError: fla: expected a problem without "
                                               "seq_idx, cu_seqlens")
    assert record["io_bytes"] == bench.io_bytes(spec) and "+3 seqs" in record["label"]
    assert bench.our_failures(_doc(record)) == []


def test_bench_shape_records_failures_and_missing_peers(monkeypatch):
    def broken_ours(problem, chunk_size=None):
        yield bench.Contender("ours", problem.chunk_size, lambda: 1 / 0, lambda out: out)
        raise RuntimeError("the stages cannot be prepared")

    monkeypatch.setattr(bench, "our_contenders", broken_ours)
    ctx = bench.RunContext(timer=_WallClockTimer(), copy_gbps=100.0, device="cpu",
                           peers={"mamba_ssm": bench.PeerUnavailable("mamba_ssm does not import"),
                                  "fla": (_naive_simple_gla, "stand-in")})
    record = bench.bench_shape(SHAPE, ctx)
    assert record["rows"]["ours"]["failed"] == "ZeroDivisionError: division by zero"
    for stage in bench.STAGES:
        assert record["rows"][f"ours.{stage}"]["failed"] == \
            "RuntimeError: the stages cannot be prepared"
    assert record["unavailable"] == {"mamba_ssm": "mamba_ssm does not import",
                                     "ours_graph": "CUDA graphs need a GPU"}
    assert record["speedup"] == {} and record["rows"]["fla_e2e"]["ms"] > 0
    failed = bench.our_failures(_doc(record))
    assert len(failed) == 4
    assert failed[0] == f"{SHAPE.label}: ours: ZeroDivisionError: division by zero"


def test_ours_on_a_machine_without_a_gpu_fails_loudly():
    # ssd_forward's own refusal (no CUDA device) is what the row records; no silent skip.
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    problem = build_problem(dataclasses.replace(SHAPE.spec, chunk_size=64))
    ours = next(bench.our_contenders(problem))
    with pytest.raises(Exception, match="CUDA"):
        ours.call()


def _same(a, b) -> bool:
    """Equal arguments: tensors by value, dtype and shape; dataclasses field by field."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("D", ["head", "channel"])
def test_stage_rows_call_each_stage_as_ssd_forward_does(monkeypatch, D):
    # On the CPU the stage entries cannot launch; recorders stand in for them (returning the chunked
    # reference's stages) in both ssd.run_stages and the bench's stage rows. Each row must call its
    # stage with exactly the arguments (variant configs included) that ssd_forward's pipeline uses.
    import kernels.chunk_cumsum
    import kernels.compute_out
    import kernels.fwd_pass_state
    import kernels.ssd as ssd

    spec = dataclasses.replace(SMALL, seqlen=100, chunk_size=64, D=D, z=True,
                               return_final_states=False)
    problem = build_problem(spec)
    ref = chunked_ssd(problem, compute_dtype=torch.float32)
    S = ref.stages["log2_decay_cumsum"]
    returns = {"chunk_cumsum": (ref.stages["dt"], torch.stack((S, torch.zeros_like(S)), dim=3)),
               "fwd_pass_state": (ref.stages["chunk_states"], ref.final_states, None),
               "compute_out": ref.out}
    calls = []

    def recorder(stage):
        def record(*args, **kwargs):
            calls.append((stage, args, kwargs))
            return returns[stage]
        return record

    for module in (kernels.chunk_cumsum, kernels.fwd_pass_state, kernels.compute_out, ssd):
        for stage in bench.STAGES:
            if hasattr(module, stage):
                monkeypatch.setattr(module, stage, recorder(stage))
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: f"the current stream of {device}")
    ssd.run_stages(problem)
    forward = list(calls)
    assert [c[0] for c in forward] == list(bench.STAGES)
    rows = {c.name: c for c in bench.our_contenders(problem, problem.chunk_size)}
    calls.clear()
    for stage in bench.STAGES:
        rows[f"ours.{stage}"].call()
    assert [c[0] for c in calls] == list(bench.STAGES)
    for timed, reference in zip(calls, forward):
        assert _same(timed, reference), timed[0]


def test_a_failing_shape_loses_neither_the_others_nor_the_saved_results(monkeypatch, tmp_path):
    # One shape failing as a whole (here: its inputs cannot be built, as when the GPU runs out of
    # memory) is recorded and the run goes on; after every shape the document reaches disk.
    monkeypatch.setattr(bench, "our_contenders", _stand_in_ours)
    real_build = bench.build_problem
    big = bench.BenchShape(dataclasses.replace(SHAPE.spec, seqlen=SHAPE.spec.seqlen + 1),
                           ("scaling",))

    def build(spec, *args, **kwargs):
        if spec == big.spec:
            raise MemoryError("out of memory building the inputs")
        return real_build(spec, *args, **kwargs)

    monkeypatch.setattr(bench, "build_problem", build)
    ctx = bench.RunContext(timer=_WallClockTimer(), copy_gbps=100.0, device="cpu",
                           peers={"mamba_ssm": bench.PeerUnavailable("absent"),
                                  "fla": bench.PeerUnavailable("absent")})
    doc = dict(_doc(), failed_shapes=[])
    saved = []
    path = tmp_path / "bench.json"
    bench.measure_shapes([big, SHAPE], ctx, doc, log=lambda line: None,
                         checkpoint=lambda d: saved.append(write_json(path, d).read_text()))
    assert [r["label"] for r in doc["shapes"]] == [SHAPE.label]
    assert doc["failed_shapes"] == [dict(label=big.label,
                                         error="MemoryError: out of memory building the inputs")]
    assert len(saved) == 2 and json.loads(saved[0])["failed_shapes"][0]["label"] == big.label
    assert json.loads(path.read_text())["shapes"][0]["label"] == SHAPE.label
    assert bench.our_failures(doc) == [f"{big.label}: all rows: MemoryError: out of memory "
                                       f"building the inputs"]
    assert f"FAILED {big.label}" in bench.format_table(doc)


def test_several_results_make_one_run_of_each_shapes_median_record(tmp_path, capsys):
    """Three runs of A, two of B: each shape keeps the record of its median judged ratio (the
    upper middle of two), with the run it came from."""
    def shape(label, ours_ms):
        return _record(label, ours_ms, {"mamba_ssm": 1.0})

    runs = [_doc(shape(LABEL_A, 0.5), shape(LABEL_B, 1.5)),
            _doc(shape(LABEL_A, 0.7), shape(LABEL_B, 2.0)),
            _doc(shape(LABEL_A, 0.55))]
    merged = bench.merge_runs(runs)
    assert [(r["label"], r["from_run"]) for r in merged["shapes"]] == [(LABEL_A, 2), (LABEL_B, 1)]
    assert [r["rows"]["ours"]["ms"] for r in merged["shapes"]] == [0.55, 2.0]
    assert len(merged["runs"]) == 3 and merged["provenance"] == runs[0]["provenance"]
    # Through the command line: the merged run is what --check compares and --out writes.
    paths = []
    for i, doc in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(doc))
    assert bench.main(_args(results=paths, out=tmp_path / "merged")) == 0
    written = json.loads((tmp_path / "merged" / "bench.json").read_text())
    assert [r["from_run"] for r in written["shapes"]] == [2, 1]
    assert bench.main(_args(check=tmp_path / "merged" / "bench.json", results=[paths[0]])) == 0
    capsys.readouterr()


def test_latest_takes_each_shape_from_the_last_run_that_measured_it(tmp_path, capsys):
    """A baseline of A and B, then a run of A alone after a change: with --latest A's record is
    the new run's, however its ratio compares, and B's the baseline's; --latest wants two runs."""
    def shape(label, ours_ms):
        return _record(label, ours_ms, {"mamba_ssm": 1.0})

    runs = [_doc(shape(LABEL_A, 0.5), shape(LABEL_B, 1.5)), _doc(shape(LABEL_A, 0.7))]
    for slower_then_faster in (runs, [runs[0], _doc(shape(LABEL_A, 0.3))]):
        merged = bench.merge_runs(slower_then_faster, latest=True)
        assert [(r["label"], r["from_run"]) for r in merged["shapes"]] == [(LABEL_A, 1),
                                                                           (LABEL_B, 0)]
        assert merged["shapes"][0] == dict(slower_then_faster[1]["shapes"][0], from_run=1)
    assert bench.merge_runs(runs)["shapes"][0]["rows"]["ours"]["ms"] == 0.7  # the upper middle
    paths = [tmp_path / "baseline.json", tmp_path / "new.json"]
    for path, doc in zip(paths, [runs[0], _doc(shape(LABEL_A, 0.3))]):
        path.write_text(json.dumps(doc))
    assert bench.main(_args(results=paths, latest=True, out=tmp_path / "merged")) == 0
    written = json.loads((tmp_path / "merged" / "bench.json").read_text())
    assert [r["rows"]["ours"]["ms"] for r in written["shapes"]] == [0.3, 1.5]
    assert bench.main(_args(results=paths[:1], latest=True)) == 2
    assert "--latest: expected --results given two or more times, got 1" in capsys.readouterr().err


def test_runs_at_different_chunk_picks_do_not_merge(tmp_path, capsys):
    runs = [dict(_doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0})), our_chunk_size=None),
            dict(_doc(_record(LABEL_A, 0.5, {"mamba_ssm": 1.0})), our_chunk_size=256)]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, doc in zip(paths, runs):
        path.write_text(json.dumps(doc))
    assert bench.main(_args(results=paths)) == 2
    assert "--chunk-size" in capsys.readouterr().err
