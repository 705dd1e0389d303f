"""Checking one problem: the exact value of every stage, each implementation's errors, verdicts.

The exact value comes from the highest float64 tier that fits (the sequential loop; the parallel
scan past the loop's budget); mpmath (tier 1) spot-checks sampled slices. ``mamba2-cutile check``
prints, for every implementation available here and every oracle tier that fits, the errors
against the highest tier run.

Stages, in pipeline order (``STAGE_ORDER``): dt and log2_decay_cumsum (the chunk cumsum),
chunk_states (the state passing), out, final_states and varlen_states. A failure is attributed to
the first stage, in that order, whose error breaks the accuracy rule (``properties.tolerances``).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernels.contract import SSDProblem
from oracles.common import LOG2_E, OracleBudgetError, SSDResult, chunk_boundaries, prepare
from oracles.sequential import sequential_ssd
from properties import tolerances
from properties.impls import (IMPL_NAMES_HELP, ImplUnavailable, available_impls, get_impl,
                              problem_features, reference)
from properties.metrics import error_metrics, owed_finite
from properties.problems import DTYPES, ProblemSpec, build_problem
from properties.provenance import write_json
from properties.regimes import REGIMES

STAGE_ORDER = ("dt", "log2_decay_cumsum", "chunk_states", "out", "final_states", "varlen_states")
# The sequential loop's cost is seqlen Python steps over batch*nheads*headdim*dstate elements;
# 2^31 element-steps is ~10-30 s on one CPU core (much less on a GPU). Past it the parallel scan
# (memory-bound, one pass per doubling) takes over as the exact tier.
SEQUENTIAL_MAX_ELEMENT_STEPS = 2 ** 31
MPMATH_SLICES = 4
# mpmath's budget in multiply-adds for check (~2.5 us each at 50 digits: ~5 s).
MPMATH_MAX_COST = 2_000_000


def _stage_layout(problem: SSDProblem, per_step: torch.Tensor) -> torch.Tensor:
    """(b, L, H) -> (b, H, nchunks, Q), zero past seqlen."""
    b, L, H = per_step.shape
    Q = problem.chunk_size
    padded = torch.nn.functional.pad(per_step, (0, 0, 0, problem.nchunks * Q - L))
    return padded.view(b, problem.nchunks, Q, H).permute(0, 3, 1, 2)


def exact_cumsum_stages(problem: SSDProblem) -> dict[str, torch.Tensor]:
    """dt and log2_decay_cumsum in float64, straight from the definition (not the reference)."""
    inp = prepare(problem, dtype=torch.float64)
    dt = _stage_layout(problem, inp.dt)
    return {"dt": dt, "log2_decay_cumsum": (dt * (inp.A * LOG2_E)[:, None, None]).cumsum(-1)}


def exact_tier(problem: SSDProblem) -> str:
    """The float64 tier that covers the whole problem: "sequential" within its budget, else
    "parallel_scan" (which raises OracleBudgetError past its memory budget)."""
    steps = problem.batch * problem.seqlen * problem.nheads * problem.headdim * problem.dstate
    return "sequential" if steps <= SEQUENTIAL_MAX_ELEMENT_STEPS else "parallel_scan"


def run_tier(problem: SSDProblem, tier: str, positions=None) -> SSDResult:
    if tier == "sequential":
        return sequential_ssd(problem, positions=positions)
    if tier == "parallel_scan":
        from oracles.parallel_scan import parallel_scan_ssd  # noqa: PLC0415
        return parallel_scan_ssd(problem, positions=positions)
    raise ValueError(f"tier: expected 'sequential' or 'parallel_scan', got {tier!r}")


def result_stages(result: SSDResult) -> dict[str, torch.Tensor]:
    """Every stage a result holds, by name."""
    stages = {"out": result.out, "final_states": result.final_states}
    if result.varlen_states is not None:
        stages["varlen_states"] = result.varlen_states
    if result.positions is not None and result.states is not None:
        stages["chunk_states"] = result.states
    stages.update(result.stages or {})
    return stages


def exact_stages(problem: SSDProblem, tier: Optional[str] = None) -> dict[str, torch.Tensor]:
    """float64 exact value of every stage: out, final/varlen states and the chunk states from
    the float64 tier (states after c * Q steps), dt and log2_decay_cumsum from their definition."""
    result = run_tier(problem, tier or exact_tier(problem), positions=chunk_boundaries(problem))
    stages = result_stages(result)
    stages.update(exact_cumsum_stages(problem))
    return stages


def stage_dtype(problem: SSDProblem, stage: str, actual: torch.Tensor) -> torch.dtype:
    """The dtype a stage is delivered in: x's for out, otherwise the tensor's own."""
    return problem.x.dtype if stage == "out" else actual.dtype


def stage_errors(problem: SSDProblem, result: SSDResult, exact: dict) -> dict[str, dict]:
    """error_metrics of every stage the result and the exact values share, in pipeline order."""
    got = result_stages(result)
    return {stage: error_metrics(got[stage], exact[stage], stage_dtype(problem, stage, got[stage]))
            for stage in STAGE_ORDER if stage in got and stage in exact}


def baseline_errors(problem: SSDProblem, exact: dict,
                    plain: Optional[dict] = None) -> dict[str, dict]:
    """The accuracy rule's baseline: per stage, the worst (by max_abs) of the float32 chunked
    reference's errors with its decays as torch's exp2 rounds them, nudged one ulp up and down,
    and with its cumsum rounded once (``tolerances.BASELINE_EVALUATIONS`` says why). plain: the
    plain reference's stage errors when the caller has already measured them."""
    runs = [plain if not options and plain is not None else
            stage_errors(problem, reference(torch.float32, **options)(problem), exact)
            for options in tolerances.BASELINE_EVALUATIONS]

    def severity(m):   # a non-finite max_abs wins: judge() then refuses to rest a rule on it
        return (0, m["max_abs"]) if math.isfinite(m["max_abs"]) else (1, 0.0)

    return {stage: max((run[stage] for run in runs), key=severity) for stage in runs[0]}


@dataclass(frozen=True)
class StageVerdict:
    stage: str
    dtype: torch.dtype
    error: float          # max_abs of the implementation
    allowed: float        # k * baseline + floor, or the a-priori bound's worst excess
    baseline: Optional[float]
    nonfinite: int

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.error <= self.allowed

    def describe(self) -> str:
        base = "" if self.baseline is None else f" (baseline {self.baseline:.3e})"
        extra = f", {self.nonfinite} non-finite where finite is owed" if self.nonfinite else ""
        return (f"{self.stage}: max_abs {self.error:.3e} vs allowed {self.allowed:.3e}{base}"
                f"{extra} -> {'ok' if self.ok else 'FAIL'}")


def judge(problem: SSDProblem, errors: dict, baseline: dict, result: SSDResult) -> list[StageVerdict]:
    """The accuracy rule per stage: max_abs <= k * max(baseline max_abs, u_out max|exact|) + floor."""
    got = result_stages(result)
    verdicts = []
    for stage, metrics in errors.items():
        dtype = stage_dtype(problem, stage, got[stage])
        tol = tolerances.tolerance(stage, dtype)
        if stage not in baseline:
            raise ValueError(f"baseline: expected the reference's error for stage {stage!r}, "
                             f"got errors for {sorted(baseline)}")
        ref = baseline[stage]["max_abs"]
        if not math.isfinite(ref):
            raise ValueError(f"baseline: the reference's {stage} is non-finite where the exact "
                             "value is finite; no rule can rest on it (see its a-priori check)")
        verdicts.append(StageVerdict(stage, dtype, metrics["max_abs"],
                                     tol.allowed(ref, tolerances.unit_roundoff(dtype)
                                                 * baseline[stage]["exact_absmax"]), ref,
                                     metrics["nonfinite"]))
    return verdicts


def first_failing(verdicts: list[StageVerdict]) -> Optional[StageVerdict]:
    """The earliest stage in pipeline order that breaks the rule."""
    return next((v for v in verdicts if not v.ok), None)


# ---- a-priori bound (no baseline): used where the implementation is its own baseline ---------

def magnitude_problem(problem: SSDProblem) -> SSDProblem:
    """The problem with |x|, |B|, |C|, |D| and |initial states| and no z gate: run through the
    exact tier, every output and state is the sum of the absolute values of its terms."""
    absolute = lambda t: None if t is None else t.abs()  # noqa: E731
    return replace(problem, x=problem.x.abs(), B=problem.B.abs(), C=problem.C.abs(),
                   D=absolute(problem.D), z=None, initial_states=absolute(problem.initial_states))


# Where (batch, head) sits in each stage's layout (varlen_states: cu_seqlens means batch 1).
_BATCH_HEAD_INDEX = {"out": (slice(None), None, slice(None), None),
                     "chunk_states": (slice(None), None, slice(None), None, None),
                     "final_states": (slice(None), slice(None), None, None),
                     "varlen_states": (slice(0, 1), slice(None), None, None)}


def apriori_compute_bound(problem: SSDProblem, exact: dict, compute_dtype: torch.dtype,
                          stages) -> dict[str, torch.Tensor]:
    """Elementwise gamma u_compute magnitude for each of ``stages``: what computing in
    ``compute_dtype`` may cost an implementation of the chunked algorithm, before its output is
    rounded (``apriori_allowed``). magnitude: the stage from the sums of its terms' absolute
    values, so cancellation costs nothing here that it did not cost the terms. ``exact`` needs
    dt and log2_decay_cumsum only (``exact_cumsum_stages``).

    gamma = ``tolerances.apriori_gamma`` plus the decay exponents' share: a weight
    2^(S_i - S_j) is computed from two cumsums S of up to Q terms of one sign, each off by up to
    (Q + few) u |S|, so its relative error is up to 2 ln2 (Q + few) u max|S| (per batch row and
    head, S at the chunk ends): the cancellation of large exponents the chunked algorithm makes in
    strong decay.
    """
    magnitude = exact_stages(magnitude_problem(problem))
    if problem.z is not None:
        z = problem.z.to(torch.float64)
        magnitude["out"] = magnitude["out"] * (z * torch.sigmoid(z)).abs()
    raw = problem.dt.to(torch.float64).abs()
    if problem.dt_bias is not None:
        raw = raw + problem.dt_bias.to(torch.float64).abs()
    # dt = clamp(softplus(dt + bias)): the add may cancel, softplus' slope is below 1.
    magnitude["dt"] = _stage_layout(problem, raw) + exact["dt"].abs()
    magnitude["log2_decay_cumsum"] = exact["log2_decay_cumsum"].abs()  # all terms <= 0
    u_c = tolerances.unit_roundoff(compute_dtype)
    cumsum_terms = problem.chunk_size + tolerances.APRIORI_FIXED_TERMS
    largest_exponent = exact["log2_decay_cumsum"][..., -1].abs().amax(dim=-1)     # (b, H)
    gamma = (tolerances.apriori_gamma(problem.chunk_size, problem.nchunks, problem.dstate)
             + 2 * math.log(2) * cumsum_terms * largest_exponent)
    bound = {}
    for stage in stages:
        if stage == "dt":
            g = torch.tensor(float(tolerances.APRIORI_FIXED_TERMS), dtype=torch.float64)
        elif stage == "log2_decay_cumsum":
            g = torch.tensor(float(cumsum_terms), dtype=torch.float64)
        else:
            g = gamma[_BATCH_HEAD_INDEX[stage]]
        bound[stage] = g.to(magnitude[stage].device) * u_c * magnitude[stage]
    return bound


def apriori_allowed(problem: SSDProblem, exact: dict, compute_dtype: torch.dtype,
                    stage_dtypes: dict) -> dict[str, torch.Tensor]:
    """Elementwise allowed |error| per stage for an implementation computing in
    ``compute_dtype``: u_out |exact| + (1 + u_out) ``apriori_compute_bound`` + floor."""
    bound = apriori_compute_bound(problem, exact, compute_dtype, stage_dtypes)
    allowed = {}
    for stage, dtype in stage_dtypes.items():
        u_out = tolerances.unit_roundoff(dtype)
        floor = tolerances.tolerance(stage, dtype).floor
        e = exact[stage]
        allowed[stage] = u_out * e.abs() + (1 + u_out) * bound[stage].to(e.device) + floor
    return allowed


RELATED_STAGES = ("out", "final_states", "varlen_states")


def relation_slack(compute_dtype: torch.dtype, *sides) -> dict[str, float]:
    """Per stage of RELATED_STAGES, what computing in ``compute_dtype`` may cost the runs of a
    relation between runs whose exact answers agree (``apriori_compute_bound``, its largest
    element), summed over the relation's sides; ``tolerances.relation_tolerance`` adds it. A side
    is a problem, or a list of the problems whose runs are joined into one (a split's head and
    tail, a packed batch's sequences one by one: the largest of theirs counts, and their final
    states stand for varlen states). Ulps of the largest output alone did not cover this where
    terms cancel or decays are strong: a nightly run of the float32 reference on the CPU
    (2026-12-04) broke chunk-size invariance in final states of ~5e-33 made of terms of ~2e-31
    (fp32_subnormal), and packed == one by one where dt ~ 20 made terms of ~20 for a state of 0.5
    (softplus_edge) or decays took exponents of ~1000 (strong_decay), all at ~100 float32 ulps of
    the output and a few of the terms."""
    total = dict.fromkeys(RELATED_STAGES, 0.0)
    for side in sides:
        worst = dict.fromkeys(RELATED_STAGES, 0.0)
        for problem in (side if isinstance(side, list) else [side]):
            packed = problem.cu_seqlens is not None
            if packed:
                problem = replace(problem, return_varlen_states=True)
            bound = apriori_compute_bound(problem, exact_cumsum_stages(problem), compute_dtype,
                                          RELATED_STAGES if packed else RELATED_STAGES[:2])
            for stage, b in bound.items():
                worst[stage] = max(worst[stage], float(b.max()) if b.numel() else 0.0)
        worst["varlen_states"] = max(worst["varlen_states"], worst["final_states"])
        for stage in RELATED_STAGES:
            total[stage] += worst[stage]
    return total


def apriori_verdicts(problem: SSDProblem, result: SSDResult, exact: dict,
                     compute_dtype: torch.dtype) -> list[StageVerdict]:
    """Per stage, the element closest to (or furthest past) its a-priori bound: its error and its
    allowed error (ok iff no element exceeds its bound)."""
    got = {s: t for s, t in result_stages(result).items() if s in exact and s in STAGE_ORDER}
    dtypes = {s: stage_dtype(problem, s, t) for s, t in got.items()}
    allowed = apriori_allowed(problem, exact, compute_dtype, dtypes)
    verdicts = []
    for stage in STAGE_ORDER:
        if stage not in got:
            continue
        e = exact[stage]
        owed = owed_finite(e, dtypes[stage])
        a = got[stage].to(device=e.device, dtype=torch.float64)
        nonfinite = int((owed & ~torch.isfinite(a)).sum())
        err = torch.where(owed, (a - e).abs(), 0.0).nan_to_num(0.0).flatten()
        worst = int((err / allowed[stage].flatten()).argmax())   # allowed >= floor > 0
        verdicts.append(StageVerdict(stage, dtypes[stage], float(err[worst]),
                                     float(allowed[stage].flatten()[worst]), None, nonfinite))
    return verdicts


# ---- the `check` command ---------------------------------------------------------------------

def add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that build one problem (a ``ProblemSpec``); shared by check and repro."""
    d = ProblemSpec()
    g = parser.add_argument_group("problem")
    for name in ("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups", "chunk_size", "seed"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    g.add_argument("--regime", choices=sorted(REGIMES), default=d.regime)
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="x, z, B and C dtype (default fp32); --x-dtype/--bc-dtype override")
    for name in ("x_dtype", "bc_dtype", "param_dtype", "state_dtype"):
        g.add_argument("--" + name.replace("_", "-"), choices=sorted(DTYPES), default=None)
    g.add_argument("--D", choices=("head", "channel"), default=None, help="D skip: (H,) or (H, P)")
    for flag in ("z", "dt_bias", "dt_softplus", "initial_states", "per_sequence_initial_states",
                 "varlen_states"):
        g.add_argument("--" + flag.replace("_", "-"), action="store_true")
    g.add_argument("--dt-limit", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                   help="default: the regime's own dt_limit, if it has one")
    g.add_argument("--cu-seqlens", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                   metavar="0,L1,...,L", help="packed sequences (batch 1)")
    g.add_argument("--no-seq-idx", action="store_true",
                   help="with --cu-seqlens: pass cu_seqlens alone (it then implies the resets)")


def spec_from_args(args: argparse.Namespace) -> ProblemSpec:
    regime = REGIMES[args.regime]
    dt_limit = tuple(args.dt_limit) if args.dt_limit is not None else regime.dt_limit
    base = args.dtype or "fp32"
    return ProblemSpec(
        batch=args.batch, seqlen=args.seqlen, nheads=args.nheads, headdim=args.headdim,
        dstate=args.dstate, ngroups=args.ngroups, chunk_size=args.chunk_size, regime=args.regime,
        seed=args.seed if args.seed is not None else ProblemSpec().seed, x_dtype=args.x_dtype or base, bc_dtype=args.bc_dtype or base,
        param_dtype=args.param_dtype or "fp32", state_dtype=args.state_dtype or "fp32", D=args.D,
        z=args.z, dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=dt_limit,
        initial_states=args.initial_states or args.per_sequence_initial_states,
        cu_seqlens=args.cu_seqlens, pass_seq_idx=not args.no_seq_idx,
        per_sequence_initial_states=args.per_sequence_initial_states,
        return_varlen_states=args.varlen_states)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_problem_arguments(parser)
    parser.add_argument("--impl", action="append", metavar="NAME",
                        help=f"implementation to run (repeatable): {IMPL_NAMES_HELP}; default: "
                             "every built-in one available here")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--mpmath-slices", type=int, default=MPMATH_SLICES,
                        help="slices the mpmath tier spot-checks (0: skip it)")
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON here")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3e}" if isinstance(v, float) else str(v)


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


@dataclass
class _Timed:
    seconds: float
    value: object


def _timed(fn, *args, **kwargs) -> _Timed:
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return _Timed(time.perf_counter() - start, value)


def _impl_names(requested: Optional[list[str]]) -> tuple[list[str], dict[str, str]]:
    """Names to run and, for built-ins left out, why."""
    if requested:
        return requested, {}
    status = available_impls()
    return ([n for n, s in status.items() if s == "available"],
            {n: s for n, s in status.items() if s != "available"})


def run_check(spec: ProblemSpec, impl_names: Optional[list[str]] = None, device=None,
              mpmath_slices: int = MPMATH_SLICES, out=sys.stdout) -> dict:
    """Run every implementation and oracle tier that fits on one problem; print the tables."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = build_problem(spec, device)
    print(f"problem: {spec.describe()} features: {sorted(problem_features(problem)) or 'none'} "
          f"on {device}", file=out)
    report = {"spec": spec.to_json(), "device": str(device), "tiers": {}, "impls": {}, "skipped": {}}
    tier = exact_tier(problem)
    positions = chunk_boundaries(problem)
    exact_run = _timed(run_tier, problem, tier, positions)
    exact = result_stages(exact_run.value)
    exact.update(exact_cumsum_stages(problem))
    print(f"exact: float64 {tier} ({exact_run.seconds:.2f} s)", file=out)
    results = {}
    if tier == "sequential":
        try:
            scan = _timed(run_tier, problem, "parallel_scan", positions)
            results["parallel_scan (tier 3)"] = (scan.value, torch.float64, scan.seconds)
        except OracleBudgetError as exc:
            report["skipped"]["parallel_scan"] = str(exc)
    names, skipped = _impl_names(impl_names)
    report["skipped"].update(skipped)
    failed = False
    for name in names:
        try:
            impl = get_impl(name)
        except ImplUnavailable as exc:
            report["skipped"][name] = str(exc)
            continue
        except Exception as exc:  # a broken implementation on a machine that should run it
            report["skipped"][name] = f"FAILED to load: {exc!r}"
            failed = True
            continue
        reason = impl.why_unsupported(problem)
        if reason:
            report["skipped"][name] = reason
            continue
        try:
            run = _timed(impl, problem)
        except Exception as exc:
            report["skipped"][name] = f"FAILED: {exc!r}"
            failed = True
            continue
        results[name] = (run.value, None, run.seconds)
    baseline_name = "reference"
    baseline = baseline_errors(problem, exact, plain=stage_errors(
        problem, results[baseline_name][0], exact) if baseline_name in results else None)
    rows = []
    for name, (result, dtype, seconds) in results.items():
        errors = {s: error_metrics(t, exact[s], dtype or stage_dtype(problem, s, t))
                  for s, t in result_stages(result).items() if s in exact and s in STAGE_ORDER}
        errors = {s: errors[s] for s in STAGE_ORDER if s in errors}
        verdicts = {}
        if dtype is None:   # an implementation: judge it
            impl = get_impl(name)
            found = (apriori_verdicts(problem, result, exact, impl.compute_dtype)
                     if name == baseline_name else judge(problem, errors, baseline, result))
            verdicts = {v.stage: v for v in found}
            failed |= any(not v.ok for v in found)
        report["impls" if dtype is None else "tiers"][name] = {
            "seconds": seconds, "errors": errors,
            "verdicts": {s: {"allowed": v.allowed, "ok": v.ok} for s, v in verdicts.items()}}
        for stage, m in errors.items():
            v = verdicts.get(stage)
            # A float64 tier's rounding floor is 0 (rounding float64 to float64): no ratio.
            rows.append([name, stage, str(m["count"]), m["max_abs"], m["max_rel"], m["normwise_rel"],
                         m["ulp_max"], m["rounding_floor_ratio"] if dtype is None else None,
                         None if v is None else v.allowed,
                         "-" if v is None else ("ok" if v.ok else "FAIL"), f"{seconds:.2f}s"])
    print(f"\nerrors against float64 {tier} (tier {2 if tier == 'sequential' else 3}); allowed: "
          f"k x max(reference-fp32 max_abs (worst of its decays rounded as is, +-1 ulp, and "
          f"its cumsum rounded once), "
          f"u_out max|exact|) + floor (properties/tolerances.py); "
          f"for the reference itself, its a-priori rounding bound at its worst element:", file=out)
    print(_table(rows, ["impl/tier", "stage", "count", "max_abs", "max_rel", "normwise_rel",
                        "ulp_max", "round_ratio", "allowed", "verdict", "time"]), file=out)
    if mpmath_slices > 0:
        report["mpmath"] = _mpmath_section(problem, exact_run.value, tier, results, mpmath_slices, out)
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}", file=out)
    report["failed"] = failed
    return report


def _mpmath_section(problem, exact_result, tier, results, count, out) -> dict:
    from oracles.mpmath_recurrence import mpmath_ssd, sample_slices  # noqa: PLC0415
    slices = sample_slices(problem, count)
    try:
        run = _timed(mpmath_ssd, problem, slices, max_cost=MPMATH_MAX_COST)
    except OracleBudgetError as exc:
        print(f"\nmpmath (tier 1) skipped: {exc}", file=out)
        return {"skipped": str(exc)}
    mp = run.value
    truth = mp.float64()
    rows, section = [], {"slices": [list(s) for s in slices], "seconds": run.seconds, "errors": {}}
    for name, (result, dtype, _) in [(f"{tier} (tier {2 if tier == 'sequential' else 3})",
                                      (exact_result, torch.float64, None)), *results.items()]:
        picked = mp.pick(result)
        section["errors"][name] = {}
        for key, t in picked.items():
            out_dtype = dtype or (problem.x.dtype if key == "out" else torch.float32)
            m = error_metrics(t, truth[key], out_dtype)
            section["errors"][name][key] = m
            rows.append([name, key, m["max_abs"], m["max_rel"], m["normwise_rel"], m["ulp_max"]])
    print(f"\nerrors against mpmath (tier 1, {mp.dps} digits) on {len(slices)} slices (b, h, p) "
          f"{slices} ({run.seconds:.2f} s):", file=out)
    print(_table(rows, ["impl/tier", "quantity", "max_abs", "max_rel", "normwise_rel", "ulp_max"]),
          file=out)
    return section


def main(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    report = run_check(spec, args.impl, args.device, args.mpmath_slices)
    if args.json:
        write_json(args.json, report)
    return 1 if report["failed"] else 0
