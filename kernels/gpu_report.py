"""The GPU run's summary: every case of ``kernels.gpu_check`` (errors vs float64 under the rule),
the >2^31-element case, and timings of the anchor shapes, as JSON and Markdown with provenance.

    python3 -m kernels.gpu_report --out DIR [--full] [--jobs 8] [--no-int64] [--no-anchors]
                                  [--no-mamba] [--sweep]

Cases run in ``--jobs`` spawned worker processes that share the GPU (cuTile's JIT compiles each
variant once per process, on the CPU, so parallel workers cut the compile wall time); every timing
is then taken again serially in this process, alone on the GPU. Exit status 1 when a case breaks
the rule. ``--sweep`` also times the anchors at every chunk size, precision and state dtype (the
data behind the dispatcher's defaults).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from kernels import ssd
from kernels.contract import validate
from kernels.gpu_check import (FULL_GRID_ENV, QUICK_CASES, check_case, check_int64_case, grid,
                               int64_problem_bytes, time_ms)
from properties.provenance import atomic_write, collect, write_json

ANCHORS = ((8, 4096, 64, 64, 128, 1), (4, 8192, 32, 64, 128, 8), (1, 65536, 64, 64, 128, 1))
SWEEP_CHUNKS = (64, 128, 256)
SWEEP_PRECISIONS = ("tf32", "input")
SWEEP_STATE_DTYPES = (torch.float32, torch.bfloat16)


def anchor_inputs(shape, seed: int = 0) -> dict:
    """bf16 x, B, C and fp32 dt, A, D of an anchor shape, drawn on the GPU (Mamba-2 init ranges)."""
    b, L, H, P, N, G = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16, dev = torch.bfloat16, "cuda"
    dt = torch.exp(torch.empty(b, L, H, device=dev).uniform_(math.log(1e-3), math.log(0.1),
                                                             generator=gen))
    return dict(x=torch.randn(b, L, H, P, generator=gen, device=dev, dtype=bf16), dt=dt,
                A=-torch.exp(torch.empty(H, device=dev).uniform_(0.0, math.log(16.0), generator=gen)),
                B=torch.randn(b, L, G, N, generator=gen, device=dev, dtype=bf16),
                C=torch.randn(b, L, G, N, generator=gen, device=dev, dtype=bf16),
                D=torch.randn(H, generator=gen, device=dev))


def _stage_times(inputs: dict, chunk_size: int, precision=None, state_dtype=None) -> dict:
    """CUDA-event median of one whole ssd_forward call (host work included)."""
    problem = validate(**inputs, chunk_size=chunk_size, return_final_states=True)
    call = lambda: ssd.ssd_forward(**inputs, chunk_size=chunk_size, precision=precision,  # noqa: E731
                                   state_dtype=state_dtype, return_final_states=True)
    total = time_ms(call, reps=10)
    mode = ssd.resolve_precision(precision, inputs["x"].dtype)
    stored = ssd.resolve_state_dtype(state_dtype, mode, inputs["x"].dtype)
    return dict(chunk_size=chunk_size, precision=mode,
                state_dtype=str(stored).replace("torch.", ""),
                time_ms=total, bytes_min=_min_bytes(problem))


def kernel_breakdown(inputs: dict, chunk_size: int, reps: int = 5) -> dict:
    """Median milliseconds of each kernel launch of one default call (ct.launch wrapped with CUDA
    events; the rest of the call is host work and small torch ops)."""
    import cuda.tile as ct  # noqa: PLC0415
    launch, spans = ct.launch, []

    def timed(stream, grid, kernel, args):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(stream, grid, kernel, args)
        stop.record()
        spans.append((kernel._pyfunc.__name__, start, stop))

    ct.launch = timed
    try:
        runs = []
        for _ in range(reps + 1):
            spans.clear()
            ssd.ssd_forward(**inputs, chunk_size=chunk_size)
            torch.cuda.synchronize()
            runs.append({name: a.elapsed_time(b) for name, a, b in spans})
    finally:
        ct.launch = launch
    runs = runs[1:]
    return {name: sorted(r[name] for r in runs)[len(runs) // 2] for name in runs[0]}


def _min_bytes(problem) -> int:
    """Reading every input once and writing out once: the memory-bound floor of a call."""
    tensors = (problem.x, problem.dt, problem.B, problem.C)
    return sum(t.numel() * t.element_size() for t in tensors) + \
        problem.x.numel() * problem.x.element_size()


def anchor_timings(sweep: bool) -> list[dict]:
    rows = []
    for shape in ANCHORS:
        inputs = anchor_inputs(shape)
        for q, p, s in _anchor_configs(sweep):
            try:
                row = _stage_times(inputs, q, p, s)
            except Exception as exc:
                row = dict(chunk_size=q, precision=p, error=f"{type(exc).__name__}: {exc}"[:400])
            row["shape"] = dict(zip(("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups"),
                                    shape))
            row["default"] = (p, s) == (None, None)
            if row["default"] and "error" not in row:
                row["kernels_ms"] = kernel_breakdown(inputs, q)
            rows.append(row)
            print(f"anchor {shape} Q={q} {p} {s}: {row.get('time_ms', row.get('error'))}",
                  flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


def _anchor_configs(sweep: bool) -> list[tuple]:
    """(chunk_size, precision, state_dtype) to time; None = the default."""
    configs = [(ssd.DEFAULT_CHUNK_SIZE, None, None)]
    if sweep:
        configs += [(q, p, s) for q in SWEEP_CHUNKS for p in SWEEP_PRECISIONS
                    for s in SWEEP_STATE_DTYPES]
    return configs


def _warm_anchor(args):
    """Compile one anchor configuration in a worker (the JIT disk cache then serves the main
    process)."""
    shape, q, p, s = args
    inputs = anchor_inputs(shape)
    try:
        ssd.ssd_forward(**inputs, chunk_size=q, precision=p, state_dtype=s)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{shape} Q={q} {p} {s}: {type(exc).__name__}: {exc}"[:400]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def markdown(report: dict) -> str:
    prov = report["provenance"]
    lines = [f"# cuTile SSD kernels on {prov.get('device')}: accuracy vs float64 and timings", "",
             f"{report['summary']}", "",
             f"Provenance: commit {prov.get('git_commit')} (dirty={prov.get('git_dirty')}), "
             f"{prov.get('date')}, torch {prov.get('torch')}, cuda-tile {prov.get('cuda_tile')}, "
             f"tileiras {prov.get('tileiras')}, driver {prov.get('driver')}, command "
             f"`{prov.get('command')}`.", "",
             *[f"Note: {n}\n" for n in report.get("notes", [])],
             "Rule (kernels/gpu_check.py): max|err| <= k x (chunked reference in float32)'s "
             "max|err| + floor, k from properties/tolerances.py; ratio = max|err| / allowed "
             "(<= 1 passes). Normwise = ||err|| / ||exact||.", "",
             "| case | shape b,L,H,P,N,G,Q | x / B,C | precision | states | out max abs | "
             "out normwise | ref normwise | worst ratio (quantity) | mamba_ssm normwise | "
             "time ms | ok |", "|" + "---|" * 12]
    for r in report["cases"]:
        s = r.get("shape", {})
        q = r.get("quantities", {})
        out = q.get("out", {})
        worst = max(q.items(), key=lambda kv: kv[1]["ratio"], default=(None, {"ratio": None}))
        mamba = (r.get("mamba_ssm") or {}).get("out_normwise_rel")
        dims = ",".join(str(s.get(k, "?")) for k in ("batch", "seqlen", "nheads", "headdim",
                                                       "dstate", "ngroups", "chunk_size"))
        lines.append(
            f"| {r['case']} | {dims} | {s.get('x')} / {s.get('B')} | {r.get('precision', '-')} | "
            f"{r.get('chunk_state_dtype', '-')} | {_fmt(out.get('max_abs'))} | "
            f"{_fmt(out.get('normwise_rel'))} | {_fmt(out.get('ref_normwise_rel'))} | "
            f"{_fmt(worst[1]['ratio'])} ({worst[0]}) | {_fmt(mamba)} | "
            f"{_fmt(r.get('time_ms'))} | {'yes' if not r.get('violations') else 'NO'} |")
    failures = [r for r in report["cases"] if r.get("violations")]
    if failures:
        lines += ["", "## Violations", ""]
        for r in failures:
            lines += [f"- {r['case']}: " + "; ".join(r["violations"])]
    excused = [(r["case"], name, q["boundary_nonfinite"]) for r in report["cases"]
               for name, q in r.get("quantities", {}).items() if q.get("boundary_nonfinite")]
    if excused:
        lines += ["", "## Infs excused within the allowed error of the dtype's overflow "
                  "(kernels.gpu_check.compare)", ""]
        lines += [f"- {case_}: {name}, {count} position(s)" for case_, name, count in excused]
    if report.get("anchors"):
        lines += ["", "## Anchor timings (bf16 x/B/C, fp32 dt/A/D, serial, CUDA-event medians)", "",
                  "| shape | chunk | precision | states | time ms | min-bytes time at 4.3 TB/s ms |",
                  "|---|---|---|---|---|---|"]
        for a in report["anchors"]:
            sh = ",".join(str(v) for v in a["shape"].values())
            floor_ms = a["bytes_min"] / 4.3e12 * 1e3 if "bytes_min" in a else None
            lines.append(f"| {sh} | {a['chunk_size']} | {a.get('precision')} | "
                         f"{a.get('state_dtype', '-')} | {_fmt(a.get('time_ms', a.get('error')))} | "
                         f"{_fmt(floor_ms)} |")
        for a in report["anchors"]:
            if a.get("kernels_ms"):
                per = ", ".join(f"{k} {v:.3f}" for k, v in a["kernels_ms"].items())
                lines.append(f"\nPer kernel ({','.join(str(v) for v in a['shape'].values())}, "
                             f"chunk {a['chunk_size']}, ms): {per}")
    return "\n".join(lines) + "\n"


def _write(report: dict, out: str, start: float) -> None:
    """Summarize, then replace gpu_report.json and .md, each atomically."""
    failed = [r["case"] for r in report["cases"] if r.get("violations")]
    report["summary"] = (f"{len(report['cases'])} cases ({report['grid']} grid), "
                         f"{len(failed)} breaking the rule" + (f": {', '.join(failed)}" if failed else "")
                         + f"; {time.perf_counter() - start:.0f} s.")
    write_json(os.path.join(out, "gpu_report.json"), report)
    atomic_write(os.path.join(out, "gpu_report.md"), markdown(report))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kernels.gpu_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_report.json and .md")
    parser.add_argument("--full", action="store_true",
                        help=f"the full grid (also set by {FULL_GRID_ENV}=1)")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--no-int64", action="store_true", help="skip the >2^31-element case")
    parser.add_argument("--no-anchors", action="store_true", help="skip the anchor timings")
    parser.add_argument("--no-mamba", action="store_true",
                        help="skip mamba_ssm (else run on the quick grid's cases; its Triton "
                             "autotuning takes tens of seconds per shape)")
    parser.add_argument("--sweep", action="store_true",
                        help="time the anchors at every chunk size, precision and state dtype")
    parser.add_argument("--cases", help="only these cases (comma-separated names)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_report: no CUDA device visible to torch", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    full = args.full or os.environ.get(FULL_GRID_ENV) == "1"
    cases = grid(full)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = tuple(c for c in cases if c.name in wanted)
        missing = wanted - {c.name for c in cases}
        if missing:
            print(f"gpu_report: no such case(s) {sorted(missing)}", file=sys.stderr)
            return 2
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        records = []
        # mamba_ssm autotunes per shape (tens of seconds each): run it on the quick grid only.
        peers = [not args.no_mamba and c in QUICK_CASES for c in cases]
        for record in pool.map(check_case, cases, [False] * len(cases), peers):
            records.append(record)
            print(f"checked {record['case']}: {record.get('violations') or 'ok'}", flush=True)
        warm = []
        if not args.no_anchors:
            tasks = [(a,) + c for a in ANCHORS for c in _anchor_configs(args.sweep)]
            warm = [w for w in pool.map(_warm_anchor, tasks) if w]
    print(f"{len(cases)} cases checked in {time.perf_counter() - start:.0f} s", flush=True)
    for record, case_ in zip(records, cases):
        if "shape" in record and not record.get("traceback"):
            problem = case_.problem()
            record["time_ms"] = time_ms(lambda: ssd.ssd_forward_stages(
                problem, state_dtype=case_.kernel_state_dtype(), precision=case_.precision),
                reps=3)
        status = "ok" if not record.get("violations") else "FAIL " + "; ".join(record["violations"])
        ratios = {k: round(q["ratio"], 3) for k, q in record.get("quantities", {}).items()}
        print(f"{record['case']}: {status} ratios={ratios}", flush=True)
        if record.get("traceback"):
            print(record["traceback"][-1500:], flush=True)
    report = dict(provenance=collect(), grid="full" if full else "quick", cases=records,
                  anchor_warmup_errors=warm)
    _write(report, args.out, start)     # the checked cases survive a timeout in what follows
    if not args.no_int64:
        free, _ = torch.cuda.mem_get_info()
        need = int64_problem_bytes() * 1.5
        if free >= need:
            try:
                report["cases"].append(check_int64_case())
            except Exception as exc:
                report["cases"].append(dict(case="int64-offsets-b1-L139264-h256",
                                            violations=[f"{type(exc).__name__}: {exc}"[:800]]))
        else:
            report["int64_skipped"] = f"{free / 2**30:.0f} GiB free < {need / 2**30:.0f} GiB needed"
        torch.cuda.empty_cache()
    if not args.no_anchors:
        report["anchors"] = anchor_timings(args.sweep)
    _write(report, args.out, start)
    print(report["summary"])
    return 1 if any(r.get("violations") for r in report["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
