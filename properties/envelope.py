"""Error envelopes: how far each kernel stage lies from the float64 oracles, cell by cell.

A cell is a deterministic recipe (``ProblemSpec``: shape, dtype mix, regime, features) measured
at several seeds; every number recorded is the maximum over those seeds. Per cell, stage and
implementation the envelope holds ``properties.metrics.error_metrics`` (max abs, max rel above a
stated floor, normwise relative, ulps of the stage's output dtype, rounding-floor ratio), the
same numbers for the same-precision reference (the chunked reference computing in fp32) and the
ratio implementation / reference.

Oracles: every stage against its exact value from ``properties.check.exact_stages`` (the float64
sequential loop for out, final states and the states at chunk boundaries; the cumsum from its
float64 definition), each first required to agree with an independent float64 evaluation, the
chunked reference, so no stage envelope rests on an unchecked oracle.

``--check`` re-measures the cells of a recorded envelope and fails, naming the cells, where a
measured error exceeds ``SLACK_FACTOR`` x recorded + a floor of ``SLACK_FLOOR_UNITS`` units of
the output dtype (see ``SLACK_REASON``); each failing cell leaves a repro artifact first.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from oracles.chunked_reference import chunked_ssd
from oracles.common import prepare
from properties import provenance, repro, tolerances
from properties.check import baseline_errors, exact_stages, result_stages, stage_dtype
from properties.impls import IMPL_NAMES_HELP, Impl, ImplUnavailable, get_impl
from properties.metrics import error_metrics
from properties.problems import DTYPE_NAMES, DTYPES, ProblemSpec, build_problem
from properties.regimes import REGIMES

SCHEMA = "mamba2-cutile-envelope/1"
STAGES = ("log2_decay_cumsum", "chunk_states", "out", "final_states")
# The metrics --check bounds; the rounding-floor ratio is recorded too but is normwise_rel over a
# per-cell constant, so bounding it again would only repeat normwise_rel's verdict.
CHECKED_METRICS = ("max_abs", "max_rel", "normwise_rel", "ulp_max")
RATIO_METRICS = ("max_abs", "max_rel", "normwise_rel", "ulp_max", "rounding_floor_ratio")
SAME_PRECISION_REFERENCE = "reference"

SLACK_FACTOR = 2.0
SLACK_FLOOR_UNITS = 2.0
SLACK_REASON = (
    "Cells are bit-exact recipes, so a re-measurement on the same device and toolchain repeats the "
    "baseline exactly unless the kernel's reduction order varies between runs. The factor 2 admits "
    "a different summation order or FMA contraction (new driver or compiler, another SM count "
    "scheduling tiles differently), which moves a rounding-error bound by a small constant factor; "
    "the floor of 2 units of the output dtype (2 u for relative metrics, 2 u x max|exact| for "
    "max_abs, 2 for ulps) admits a result that crosses one rounding boundary where the recorded "
    "error is near zero. The regressions the envelope exists to catch (masking, indexing, a lost "
    "precision step) move errors by orders of magnitude.")

# Two float64 evaluations of the same recurrence differ by O(L * 1e-16) relative; 1e-9 leaves
# room for long sequences and decay cancellation and is still 1e4 below fp32's unit roundoff, so
# an oracle that passes it contributes nothing visible to an fp32 or lower-precision envelope.
ORACLE_AGREEMENT_TOL = 1e-9


class OracleDisagreement(RuntimeError):
    """The float64 chunked reference and the float64 sequential loop disagree on a cell."""


@dataclass(frozen=True)
class DtypeMix:
    """Input dtypes of a cell: x and z, B and C, the parameters dt, A, D, dt_bias."""

    name: str
    x: str
    bc: str
    param: str


DTYPE_MIXES = {m.name: m for m in (
    DtypeMix("fp32", "fp32", "fp32", "fp32"),
    DtypeMix("bf16", "bf16", "bf16", "fp32"),   # Mamba-2 training and inference: fp32 dt and A
    DtypeMix("fp16", "fp16", "fp16", "fp32"),
)}


@dataclass(frozen=True)
class Grid:
    """Shapes and sweeps of one envelope grid; every cell uses D, z, dt_bias, softplus, h0."""

    batch: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    chunk_size: int
    seqlen: int                        # every regime at this length (a partial last chunk)
    seqlen_sweep: tuple[int, ...]      # the error-vs-seqlen cells
    seqlen_regimes: tuple[str, ...]
    nseeds: int


GRIDS = {
    # CPU CI: every regime and dtype mix, lengths that end in a partial chunk, under 2 minutes.
    # Chunk size 64, the smallest the cuTile kernels take, so a GPU can run this grid too.
    "quick": Grid(batch=2, nheads=4, headdim=16, dstate=16, ngroups=2, chunk_size=64, seqlen=100,
                  seqlen_sweep=(64, 100, 400), seqlen_regimes=("mamba2_init", "near_unit_decay"),
                  nseeds=3),
    # A GPU: model-like head sizes, the kernels' default chunk size, and sequences long enough for
    # state accumulation to show.
    "full": Grid(batch=2, nheads=8, headdim=64, dstate=64, ngroups=2, chunk_size=128, seqlen=1000,
                 seqlen_sweep=(200, 1000, 4096, 8192),
                 seqlen_regimes=("mamba2_init", "near_unit_decay", "large_initial_state"), nseeds=3),
}


@dataclass(frozen=True)
class Cell:
    """One grid point: a recipe whose ``seed`` is replaced by each of ``seeds``."""

    name: str
    family: str          # "regime" (every regime at the grid length), "seqlen" or "packed"
    dtype_mix: str
    spec: ProblemSpec
    seeds: tuple[int, ...]

    def specs(self) -> list[ProblemSpec]:
        return [replace(self.spec, seed=s) for s in self.seeds]

    def to_dict(self) -> dict:
        spec = asdict(self.spec)
        spec.pop("seed")
        return dict(name=self.name, family=self.family, dtype_mix=self.dtype_mix, spec=spec,
                    seeds=list(self.seeds))

    @classmethod
    def from_dict(cls, d: dict) -> "Cell":
        return cls(name=d["name"], family=d["family"], dtype_mix=d["dtype_mix"],
                   spec=ProblemSpec.from_dict({**d["spec"], "seed": d["seeds"][0]}),
                   seeds=tuple(d["seeds"]))


def build_cells(grid: Grid, seed: int) -> list[Cell]:
    """The cells of ``grid``; ``seed`` shifts every cell's seeds (seed, seed + 1, ...)."""
    seeds = tuple(seed + k for k in range(grid.nseeds))
    base = ProblemSpec(batch=grid.batch, nheads=grid.nheads, headdim=grid.headdim,
                       dstate=grid.dstate, ngroups=grid.ngroups, chunk_size=grid.chunk_size,
                       D="head", z=True, dt_bias=True, dt_softplus=True, initial_states=True)
    cells: dict[str, Cell] = {}

    def add(family: str, regime: str, mix: DtypeMix, seqlen: int, **features) -> None:
        spec = replace(base, regime=regime, seqlen=seqlen, x_dtype=mix.x, bc_dtype=mix.bc,
                       param_dtype=mix.param, **features)
        name = f"{regime}/{mix.name}/L{seqlen}" + ("/packed" if family == "packed" else "")
        cells.setdefault(name, Cell(name, family, mix.name, spec, seeds))

    for mix in DTYPE_MIXES.values():
        for name, regime in REGIMES.items():
            if not regime.x_dtypes or mix.x in regime.x_dtypes:
                add("regime", name, mix, grid.seqlen, dt_limit=regime.dt_limit)
        for regime in grid.seqlen_regimes:
            for seqlen in grid.seqlen_sweep:
                add("seqlen", regime, mix, seqlen)
        # Packed sequences with resets mid-chunk, each starting from its own initial state.
        L, q = grid.seqlen, grid.chunk_size
        cu = (0, q // 2 + 5, q + q // 4 + 3, L)
        add("packed", "mamba2_init", mix, L, batch=1, cu_seqlens=cu,
            per_sequence_initial_states=True)
    return list(cells.values())


def _normwise(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return float(error_metrics(actual, exact, torch.float64)["normwise_rel"])


def oracle_stages(problem) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The exact value of every stage (``check.exact_stages``: the float64 sequential loop, the
    cumsum from its definition) and, per stage, its normwise disagreement with the float64 chunked
    reference, an independent evaluation recorded as evidence that the exact values are exact.

    Raises OracleDisagreement where the two float64 evaluations differ by more than
    ORACLE_AGREEMENT_TOL.
    """
    exact = exact_stages(problem, tier="sequential")
    chunked = result_stages(chunked_ssd(problem, compute_dtype=torch.float64,
                                        state_dtype=torch.float64, out_dtype=torch.float64))
    agreement = {stage: _normwise(chunked[stage], exact[stage])
                 for stage in ("out", "final_states", "chunk_states", "log2_decay_cumsum")}
    bad = {s: v for s, v in agreement.items() if not v <= ORACLE_AGREEMENT_TOL}
    if bad:
        raise OracleDisagreement(
            f"float64 chunked reference vs sequential loop: normwise relative disagreement {bad} "
            f"exceeds {ORACLE_AGREEMENT_TOL:g}")
    return {stage: exact[stage] for stage in agreement}, agreement


def decay_strength(problem) -> float:
    """Median |dt * A| per step: the regime's decay strength as the cell actually draws it."""
    inp = prepare(problem, dtype=torch.float64)
    return float((inp.dt * inp.A).abs().median())


def _accuracy_rule_ratio(stage: str, dtype: torch.dtype, metrics: dict, reference: dict):
    """max_abs over what the project's accuracy rule allows (properties.tolerances); <= 1 holds."""
    try:
        allowed = tolerances.tolerance(stage, dtype).allowed(
            reference["max_abs"], tolerances.unit_roundoff(dtype) * reference["exact_absmax"])
    except ValueError:   # no rule for this stage in this dtype
        return None
    return math.inf if metrics["nonfinite"] else metrics["max_abs"] / allowed


def measure_problem(problem, impls: dict[str, Impl], reference: Optional[str]) -> dict:
    """One problem: {"impls": {name: {stage: metrics} or {"unsupported": reason}}, oracle
    agreement, stage dtypes, max |exact| per stage, decay strength}."""
    exact, agreement = oracle_stages(problem)
    measured: dict[str, dict] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, impl in impls.items():
        reason = impl.why_unsupported(problem)
        if reason is not None:
            measured[name] = {"unsupported": reason}
            continue
        got = result_stages(impl(problem))
        measured[name] = {}
        for stage in STAGES:
            if stage in got:
                dtype = dtypes.setdefault(stage, stage_dtype(problem, stage, got[stage]))
                measured[name][stage] = error_metrics(got[stage].to(dtype), exact[stage], dtype)
    ref = measured.get(reference, {}) if reference else {}
    # The rule's baseline is the worst of the reference's four evaluations (check.baseline_errors).
    rule_baseline = (baseline_errors(problem, exact, plain=ref)
                     if ref and "unsupported" not in ref else {})
    for name, stages in measured.items():
        if name == reference or "unsupported" in stages or "unsupported" in ref:
            continue
        for stage, metrics in stages.items():
            if stage in rule_baseline:
                metrics["accuracy_rule"] = _accuracy_rule_ratio(stage, dtypes[stage], metrics,
                                                                rule_baseline[stage])
    return {"impls": measured, "oracle_agreement": agreement,
            "out_dtypes": {s: _dtype_name(d) for s, d in dtypes.items()},
            "exact_absmax": {s: float(t.abs().max()) for s, t in exact.items()},
            "decay_strength": decay_strength(problem)}


def _max(values) -> float:
    values = [math.nan if v is None else float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def _worst_over_seeds(runs: list[tuple[int, dict]]) -> tuple[dict, dict]:
    """Max over seeds of every metric (NaN wins: it is never hidden) and the seed attaining it."""
    metrics, worst_seed = {}, {}
    for key in runs[0][1]:
        if runs[0][1][key] is None:
            continue
        seed, values = max(runs, key=lambda r: (math.isnan(float(r[1][key])), float(r[1][key])))
        metrics[key], worst_seed[key] = float(values[key]), seed
    return metrics, worst_seed


def summarize_cell(cell: Cell, per_seed: list[dict], impl_names: list[str],
                   reference: Optional[str]) -> dict:
    """Max over seeds of every metric, the seed that attains it, and impl / reference ratios."""
    record = cell.to_dict()
    record["decay_strength"] = sum(m["decay_strength"] for m in per_seed) / len(per_seed)
    record["oracle_agreement"] = {s: _max(m["oracle_agreement"][s] for m in per_seed)
                                  for s in STAGES}
    names = list(dict.fromkeys(impl_names + ([reference] if reference else [])))
    record["unsupported"] = {n: per_seed[0]["impls"][n]["unsupported"] for n in names
                             if "unsupported" in per_seed[0]["impls"][n]}
    stages = {}
    for stage in STAGES:
        dtypes = [m["out_dtypes"][stage] for m in per_seed if stage in m["out_dtypes"]]
        if not dtypes:
            continue
        entry = {"out_dtype": dtypes[0],
                 "exact_absmax": _max(m["exact_absmax"][stage] for m in per_seed), "impls": {}}
        for name in names:
            runs = [(s, m["impls"][name][stage]) for s, m in zip(cell.seeds, per_seed)
                    if stage in m["impls"][name]]
            if not runs:
                continue    # unsupported, or the implementation does not expose this stage
            metrics, worst_seed = _worst_over_seeds(runs)
            if name == reference:
                entry["reference"] = metrics
            if name in impl_names:
                entry["impls"][name] = {"metrics": metrics, "worst_seed": worst_seed}
        if "reference" in entry:
            for rec in entry["impls"].values():
                rec["ratio_to_reference"] = {k: _ratio(rec["metrics"][k], entry["reference"][k])
                                             for k in RATIO_METRICS}
        stages[stage] = entry
    record["stages"] = stages
    return record


class Progress:
    """One stderr line: a carriage-return bar on a terminal, a line per tenth in CI logs."""

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.start, self.done, self.shown_tenth = time.monotonic(), 0, -1
        self.tty = stream.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        line = (f"{self.label}: [{self.done:>{len(str(self.total))}}/{self.total}] "
                f"{100 * self.done // self.total:3d}%  {elapsed:6.1f}s elapsed, ~{eta:5.1f}s left  "
                f"{what}")
        if self.tty:
            end = "\n" if self.done == self.total else ""
            self.stream.write("\r" + line[:150].ljust(150) + end)
        elif 10 * self.done // self.total != self.shown_tenth:
            self.shown_tenth = 10 * self.done // self.total
            self.stream.write(line + "\n")
        self.stream.flush()


@dataclass
class Measured:
    """One cell measured: its record (see ``summarize_cell``) and the per-seed measurements."""

    cell: Cell
    record: dict
    per_seed: list[dict]
    impls: dict[str, Impl]


def measure_cells(cells: list[Cell], impl_names: list[str], reference: Optional[str],
                  device, label: str = "envelope") -> list[Measured]:
    """Run every cell at every seed."""
    names = list(dict.fromkeys(impl_names + ([reference] if reference else [])))
    try:
        impls = {name: get_impl(name) for name in names}
    except ValueError as err:   # a malformed or unloadable package.module:function
        raise UsageError(str(err)) from None
    progress = Progress(sum(len(c.seeds) for c in cells), label)
    measured = []
    for cell in cells:
        per_seed = []
        for spec in cell.specs():
            try:
                per_seed.append(measure_problem(build_problem(spec, device), impls, reference))
            except OracleDisagreement as err:
                raise OracleDisagreement(f"cell {cell.name} seed {spec.seed}: {err}") from None
            progress.step(f"{cell.name} seed {spec.seed}")
        measured.append(Measured(cell, summarize_cell(cell, per_seed, impl_names, reference),
                                 per_seed, impls))
    return measured


def slack_allowance(metric: str, recorded: float, out_dtype: str, exact_absmax: float) -> float:
    """The largest re-measured value --check accepts for a recorded one (see SLACK_REASON)."""
    if metric == "ulp_max":
        floor = SLACK_FLOOR_UNITS
    else:
        u = torch.finfo(_torch_dtype(out_dtype)).eps / 2
        floor = SLACK_FLOOR_UNITS * u * (exact_absmax if metric == "max_abs" else 1.0)
    return SLACK_FACTOR * recorded + floor


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    return DTYPES.get(name) or getattr(torch, name)


@dataclass
class Exceedance:
    cell: str
    impl: str
    stage: str
    metric: str
    measured: float
    recorded: float
    allowed: float
    seed: Optional[int]

    def describe(self) -> str:
        return (f"{self.cell} [{self.impl}] {self.stage}.{self.metric} = {self.measured:.3e} > "
                f"allowed {self.allowed:.3e} (recorded {self.recorded:.3e}; seed {self.seed})")


def compare(baseline_cell: dict, measured_cell: dict, impl: str, against: str) -> list[Exceedance]:
    """Every checked metric of ``impl`` in ``measured_cell`` past the slack of ``against``'s
    recorded envelope; a stage the baseline records but the implementation no longer exposes is an
    exceedance too (its envelope can no longer be vouched for)."""
    name = baseline_cell["name"]
    if against in baseline_cell.get("unsupported", {}):
        return []       # nothing was recorded to hold it to
    if impl in measured_cell["unsupported"]:
        return [Exceedance(name, impl, "(all)", "unsupported: " + measured_cell["unsupported"][impl],
                           math.nan, 0.0, 0.0, None)]
    found = []
    for stage, recorded_stage in baseline_cell["stages"].items():
        recorded = recorded_stage["impls"].get(against)
        if recorded is None:
            continue
        measured = measured_cell["stages"].get(stage, {}).get("impls", {}).get(impl)
        if measured is None:
            found.append(Exceedance(name, impl, stage, "(stage not exposed)", math.nan, 0.0, 0.0,
                                    None))
            continue
        for metric in CHECKED_METRICS:
            value, limit = measured["metrics"][metric], recorded["metrics"][metric]
            allowed = slack_allowance(metric, limit, recorded_stage["out_dtype"],
                                      recorded_stage["exact_absmax"])
            if not value <= allowed:   # NaN fails too
                found.append(Exceedance(name, impl, stage, metric, value, limit, allowed,
                                        measured["worst_seed"][metric]))
        # A recorded Inf makes every error metric above pass; the count of non-finite results
        # where a finite one was owed is held to the baseline's exactly (0 for a sound cell).
        value, limit = measured["metrics"].get("nonfinite", 0), recorded["metrics"].get("nonfinite", 0)
        if not value <= limit:
            found.append(Exceedance(name, impl, stage, "nonfinite", value, limit, limit,
                                    measured["worst_seed"].get("nonfinite")))
    return found


def _device(arg: Optional[str]) -> torch.device:
    return torch.device(arg or ("cuda" if torch.cuda.is_available() else "cpu"))


def envelope_document(records: list[dict], impl_names: list[str], reference: Optional[str],
                      grid_name: str, seed: int, device: torch.device) -> dict:
    return {
        "schema": SCHEMA,
        "provenance": provenance.collect(),
        "device_label": provenance.device_label(),
        "torch_device": str(device),
        "grid": grid_name,
        "seed": seed,
        "impls": impl_names,
        "same_precision_reference": reference,
        "oracles": {
            "out": "float64 sequential loop (oracles.sequential)",
            "final_states": "float64 sequential loop (oracles.sequential)",
            "chunk_states": "float64 sequential loop's states at chunk boundaries",
            "log2_decay_cumsum": "cumsum's float64 definition",
            "cross_check": "float64 chunked reference (oracles.chunked_reference)",
            "agreement_tolerance_normwise": ORACLE_AGREEMENT_TOL,
        },
        "metrics": "properties.metrics.error_metrics: max over seeds of each metric",
        "slack": {"factor": SLACK_FACTOR, "floor_units": SLACK_FLOOR_UNITS,
                  "checked_metrics": list(CHECKED_METRICS), "reason": SLACK_REASON},
        "cells": records,
    }


def write_report(document: dict, out_dir: Path) -> list[Path]:
    from properties.report import write_report as write  # noqa: PLC0415  (matplotlib is slow to import)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "envelope.json"
    provenance.write_json(path, document)
    return [path] + write(document, out_dir)


class UsageError(Exception):
    """A command-line mistake: printed, exit status 2."""


def _select(cells: list[Cell], pattern: Optional[str]) -> list[Cell]:
    if pattern is None:
        return cells
    chosen = [c for c in cells if re.search(pattern, c.name)]
    if not chosen:
        raise UsageError(f"--only: expected a regular expression matching some cell name, got "
                         f"{pattern!r} (cells look like {cells[0].name!r})")
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", action="append", metavar="NAME",
                        help=f"implementation to measure (repeatable): {IMPL_NAMES_HELP}; "
                             "default cutile on a GPU, reference on the CPU")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write envelope.json, envelope.md and plots here (default "
                             "reports/<device-label>/; with --check, nothing unless given)")
    parser.add_argument("--quick", action="store_true",
                        help="the small grid CPU CI runs (under 2 minutes on 2 cores)")
    parser.add_argument("--seed", type=int, default=0,
                        help="first seed of every cell (cells use seed, seed+1, ...)")
    parser.add_argument("--only", metavar="REGEX",
                        help="measure only the cells whose name matches (e.g. 'bf16/L100$')")
    parser.add_argument("--device", help="torch device (default cuda when present, else cpu)")
    parser.add_argument("--check", type=Path, metavar="ENVELOPE_JSON",
                        help="re-measure this envelope's cells and fail (exit 1, naming the cells, "
                             "saving repro artifacts) where an error exceeds it by more than its "
                             "recorded slack; never rewrites it")
    parser.add_argument("--against", metavar="NAME",
                        help="with --check: the recorded implementation whose envelope --impl is "
                             "held to (default: the same name)")
    parser.add_argument("--update-baseline", action="store_true",
                        help="with --check: re-measure every recorded implementation and cell and "
                             "rewrite ENVELOPE_JSON and its report (the only way --check writes it)")
    parser.add_argument("--failures-dir", type=Path, default=None,
                        help="where --check saves repro artifacts (default: $MAMBA2_CUTILE_FAILURES "
                             "or failures/)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.check is not None:
            return _check(args)
        if args.against or args.update_baseline:
            raise UsageError("--against, --update-baseline: expected with --check, got them without")
        impl_names = args.impl or _default_impls()
        grid_name = "quick" if args.quick else "full"
        cells = _select(build_cells(GRIDS[grid_name], args.seed), args.only)
        device = _device(args.device)
        measured = measure_cells(cells, impl_names, SAME_PRECISION_REFERENCE, device)
        document = envelope_document([m.record for m in measured], impl_names,
                                     SAME_PRECISION_REFERENCE, grid_name, args.seed, device)
        out_dir = args.out or provenance.REPO_ROOT / "reports" / provenance.device_label()
        for path in write_report(document, out_dir):
            print(path)
        return 0
    except (UsageError, ImplUnavailable) as err:
        print(f"mamba2-cutile envelope: {err}", file=sys.stderr)
        return 2


def _default_impls() -> list[str]:
    return ["cutile"] if torch.cuda.is_available() else [SAME_PRECISION_REFERENCE]


def _load_baseline(path: Path) -> dict:
    try:
        return provenance.read_document(path, SCHEMA)
    except ValueError as exc:
        raise UsageError(f"--check: the baseline envelope: {exc}") from None


def _check(args: argparse.Namespace) -> int:
    baseline = _load_baseline(args.check)
    if args.update_baseline:
        if args.impl or args.against or args.only or args.out:
            raise UsageError("--update-baseline: re-measures every recorded implementation and "
                             "cell into the baseline; expected no --impl, --against, --only or "
                             "--out with it")
        impl_names = list(baseline["impls"])
    else:
        impl_names = args.impl or _default_impls()
    pairs = [(name, args.against or name) for name in impl_names]
    missing = sorted({a for _, a in pairs if a not in baseline["impls"]})
    if missing:
        raise UsageError(f"--check: expected {args.check} to record {missing}; it records "
                         f"{baseline['impls']} (hold another implementation to one with "
                         f"--against NAME)")
    cells = _select([Cell.from_dict(c) for c in baseline["cells"]], args.only)
    recorded = {c["name"]: c for c in baseline["cells"]}
    writing = args.update_baseline or args.out is not None
    # The same-precision reference only adds the comparison columns of a written report.
    reference = baseline.get("same_precision_reference") if writing else None
    device = _device(args.device)
    measured = measure_cells(cells, impl_names, reference, device, label="envelope --check")

    failures = {m.cell.name: [e for impl, against in pairs
                              for e in compare(recorded[m.cell.name], m.record, impl, against)]
                for m in measured}
    failures = {name: found for name, found in failures.items() if found}
    artifacts = [] if args.update_baseline else \
        [_save_artifact(m, failures[m.cell.name], args) for m in measured if m.cell.name in failures]

    if writing:
        document = envelope_document([m.record for m in measured], impl_names, reference,
                                     baseline["grid"], baseline["seed"], device)
        for path in write_report(document, args.check.parent if args.update_baseline else args.out):
            print(path)
    if failures and not args.update_baseline:
        print(f"envelope --check FAILED: {len(failures)} of {len(measured)} cells exceed "
              f"{args.check} (slack {SLACK_FACTOR:g}x + {SLACK_FLOOR_UNITS:g} units):",
              file=sys.stderr)
        for name, found in failures.items():
            print(f"  cell {name}:", file=sys.stderr)
            for e in found:
                print("    " + e.describe(), file=sys.stderr)
        for path in artifacts:
            print(f"  repro artifact: {path}  (replay: mamba2-cutile repro {path})", file=sys.stderr)
        return 1
    if args.update_baseline:
        print(f"baseline {args.check} rewritten; {len(failures)} cells moved past the old slack: "
              f"{', '.join(failures) or 'none'}")
    else:
        print(f"envelope --check passed: {len(measured)} cells x {len(impl_names)} "
              f"implementation(s) within {args.check} (slack {SLACK_FACTOR:g}x + "
              f"{SLACK_FLOOR_UNITS:g} units)")
    return 0


def _save_artifact(measured: Measured, found: list[Exceedance], args) -> Path:
    """The repro artifact of one failing cell, at the seed of its largest exceedance (measured /
    allowed); its errors are that seed's per-stage metrics, as ``mamba2-cutile repro`` prints."""
    worst = max(found, key=lambda e: math.inf if not e.allowed or math.isnan(e.measured)
                else e.measured / e.allowed)
    seed = worst.seed if worst.seed is not None else measured.cell.seeds[0]
    spec = replace(measured.cell.spec, seed=seed)
    per_seed = measured.per_seed[measured.cell.seeds.index(seed)]
    impl = worst.impl
    return repro.save_artifact(
        kind="envelope", name=f"{measured.cell.name} {impl} seed {seed}",
        problem=build_problem(spec, _device(args.device)), impl=impl, spec=spec,
        errors={"impl": per_seed["impls"][impl]},
        options={"baseline": str(args.check), "against": args.against or impl,
                 "exceedances": [asdict(e) for e in found if e.seed in (seed, None)]},
        message=f"envelope --check: {len(found)} exceedance(s) in cell {measured.cell.name}; "
                f"worst {worst.describe()}", directory=args.failures_dir)
