"""pytest-benchmark timings of the anchor shapes, ours beside mamba_ssm and fla (GPU only).

Timer: ``synchronized_perf_counter`` synchronizes the device, then reads time.perf_counter.
pytest-benchmark reads its timer before and after every round, so a round spans one call's launch
and all of its GPU work. Rounds are single calls (iterations=1) after warm-up rounds; the first
call, which compiles (cuTile) or autotunes (Triton), runs before them. Unlike
``mamba2-cutile bench`` (CUDA events, L2 flushed before every call: the figures reports/ quote),
these are wall-clock times with warm caches and one synchronize's latency (microseconds) per round:
they serve pytest-benchmark's history and ``--benchmark-compare``.

Every timed call's output is also checked to be the problem's ``out``: a benchmark of a call that
computes something else (a wrong argument convention) would otherwise pass silently. A peer that
does not import here skips its tests (peers travel only with ``prepare.sh --peers``); ours never
skips on a machine with a GPU: a broken cuTile fails.
"""
from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from properties import bench
from properties.metrics import error_metrics
from properties.problems import DTYPES, build_problem

pytestmark = pytest.mark.gpu

ROWS = ("ours", "mamba_ssm", "fla_kernel", "fla_e2e")
ROUNDS, WARMUP_ROUNDS = 30, 3
# Not an accuracy bound (the envelopes and properties own accuracy): the peers' bf16 outputs sit at
# ~2x the bf16 rounding floor (device README: ~2e-3 relative). A call with a wrong convention
# (fla's default scale K^-0.5, q and k swapped, a missing dt) is off by O(1) relative: ratios in
# the hundreds.
SAME_PROBLEM_FLOOR_RATIO = 16.0


def synchronized_perf_counter() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _require_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


_PROBLEMS: dict = {}


def _problem(shape: bench.BenchShape):
    """(problem, exact out on the error slice, slice) per anchor, built once per session."""
    if shape.label not in _PROBLEMS:
        _PROBLEMS.clear()                   # one anchor's tensors at a time
        problem = build_problem(shape.spec, "cuda", draw_on_device=True)
        rows, heads, groups = bench.error_slice(shape.spec)
        _PROBLEMS[shape.label] = (problem, bench.reference_out(problem, rows, heads, groups),
                                  (rows, heads))
    return _PROBLEMS[shape.label]


def _contender(problem, name: str) -> bench.Contender:
    if name == "ours":
        return next(bench.our_contenders(problem))
    try:
        if name == "mamba_ssm":
            return next(bench.mamba_contenders(problem, bench.load_mamba_ssm()[0]))
        rows = {c.name: c for c in bench.fla_contenders(problem, bench.load_fla()[0])}
    except bench.PeerUnavailable as exc:
        pytest.skip(str(exc))
    return rows[name]


@pytest.mark.benchmark(timer=synchronized_perf_counter, disable_gc=True)
@pytest.mark.parametrize("name", ROWS)
@pytest.mark.parametrize("dims", bench.ANCHOR_DIMS,
                         ids=["b{}-L{}-H{}-P{}-N{}-G{}".format(*d) for d in bench.ANCHOR_DIMS])
def test_anchor(benchmark, dims, name):
    _require_cuda()
    shape = bench.BenchShape(bench.bench_spec(dims, _our_chunk_size()), ("anchor",))
    problem, exact, (rows, heads) = _problem(shape)
    contender = _contender(problem, name)
    contender.call()                      # compile / autotune: not a round
    torch.cuda.synchronize()
    benchmark.group = shape.label
    benchmark.extra_info.update(chunk_size=contender.chunk_size,
                                io_bytes=bench.io_bytes(shape.spec))
    result = benchmark.pedantic(contender.call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS,
                                iterations=1)
    # The anchors have no D or z, so every row, fla's kernel alone included, returns out.
    out = contender.output(result)[:rows, :, :heads]
    metrics = error_metrics(out, exact, DTYPES[shape.spec.x_dtype])
    benchmark.extra_info.update(normwise_rel=metrics["normwise_rel"], max_abs=metrics["max_abs"])
    assert metrics["rounding_floor_ratio"] <= SAME_PROBLEM_FLOOR_RATIO, metrics


def _our_chunk_size() -> int:
    import kernels  # noqa: PLC0415
    return kernels.DEFAULT_CHUNK_SIZE


def _small_shape() -> bench.BenchShape:
    spec = bench.bench_spec((1, 2048, 64, 64, 128, 1), _our_chunk_size(), D="channel", z=True)
    return bench.BenchShape(spec, ("scaling",))


def test_stages_timed_are_the_forwards_work():
    # The stage rows call the stage entries with the variant ssd_forward picks: the last stage's
    # output must be ssd_forward's, bit for bit (the kernels are deterministic).
    _require_cuda()
    problem = build_problem(_small_shape().spec, "cuda", draw_on_device=True)
    rows = {c.name: c for c in bench.our_contenders(problem)}
    assert list(rows) == ["ours"] + [f"ours.{stage}" for stage in bench.STAGES]
    assert torch.equal(rows["ours.compute_out"].call(), rows["ours"].call())


def test_timer_scales_with_the_work():
    # The bench's timing method on copies of 256 and 512 MiB: twice the bytes, about twice the time.
    _require_cuda()
    timer = bench.CudaTimer(bench.QUICK_TIMING)
    small = bench.copy_probe(timer, 256 << 20)
    large = bench.copy_probe(timer, 512 << 20)
    assert 1.6 <= large["ms"] / small["ms"] <= 2.4, (small, large)
    assert small["reps"] >= bench.QUICK_TIMING.min_reps


def test_bench_run_end_to_end(tmp_path):
    # One small shape through the whole run: copy probe, every row, errors, table, JSON and plot.
    _require_cuda()
    doc = bench.run([_small_shape()], bench.QUICK_TIMING, log=lambda line: None)
    assert bench.our_failures(doc) == []
    (record,) = doc["shapes"]
    ours = record["rows"]["ours"]
    assert ours["ms"] > 0 and ours["gbps"] > 0
    assert ours["error"]["rounding_floor_ratio"] <= SAME_PROBLEM_FLOOR_RATIO
    for stage in bench.STAGES:
        assert record["rows"][f"ours.{stage}"]["ms"] > 0
    # The replay's out is the eager call's, bit for bit (tests/test_kernels_gpu.py): same errors.
    assert record["rows"]["ours_graph"]["error"] == ours["error"]
    for name, row in record["rows"].items():
        assert "failed" not in row, (name, row)
        if "error" in row:
            assert row["error"]["rounding_floor_ratio"] <= SAME_PROBLEM_FLOOR_RATIO, (name, row)
    assert record["peak_memory_bytes"] < 20e9
    written = bench.write_outputs(doc, tmp_path)
    # Every run draws its shapes (ours' stages beside each peer), a scaling shape the scaling.
    assert {p.name for p in written} == {"bench.json", "bench.txt", "bench_shapes.png",
                                         "bench_scaling.png"}
    assert all(p.stat().st_size > 0 for p in written)


def test_ab_end_to_end(tmp_path, capsys):
    # mamba2-cutile ab at a walk's case (128 (row, head) pairs, one block an SM as dispatched):
    # the walk paired (its occupancy hint only; bit-equal to one block an SM, as the H200 A/Bs
    # of the pairing found) and an arm on compute_out, which the walk's plan does not launch.
    _require_cuda()
    from properties import ab
    args = argparse.Namespace(case=["2,1024,64,64,128,1"], chunk_size=64, rounds=2, reps=3,
                              arm=["pair scan_out.occupancy=2", "rows out.row_block=32"],
                              compile=None, out=tmp_path / "ab.json")
    assert ab.main(args) == 0
    doc = json.loads(args.out.read_text())
    assert doc["schema"] == ab.SCHEMA and doc["provenance"]["device"] != "cpu"
    (record,) = doc["cases"]
    found = record["arms"]
    assert record["dispatched"]["scan_out"]["occupancy"] == "None"
    assert found["pair"]["bit_equal"] and found["pair"]["max_abs_diff"] == 0.0
    assert found["pair"]["error"] == found["dispatched"]["error"]
    assert found["dispatched"]["error"]["rounding_floor_ratio"] <= SAME_PROBLEM_FLOOR_RATIO
    assert len(found["pair"]["times_ms"]) == 6 and found["dispatched"]["ratio"] == 1.0
    assert found["rows"]["not_applicable"].startswith("the plan does not launch its out")
    assert "pair" in capsys.readouterr().out
