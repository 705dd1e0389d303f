"""Failure artifacts: everything needed to replay a failing case on another machine, and the replay.

An artifact is ``<stem>.json`` (recipe, sha256 of the inputs, options, implementation, Hypothesis
blob when known, environment, measured errors) plus ``<stem>.pt`` (the input tensors, when under
``TENSOR_LIMIT_BYTES``). Both are written to a temporary name and renamed into place (``os.replace``),
the tensors first, so a JSON on disk always describes complete files. They go under
``$MAMBA2_CUTILE_FAILURES`` or the repository's git-ignored ``failures/``.

``mamba2-cutile repro ARTIFACT`` rebuilds the inputs (the saved tensors, or the recipe when none
were saved; either way checked against the recorded hash), runs the implementation and the oracles,
and prints the error of every stage against the accuracy rule, naming the first stage, in pipeline
order, where the error appears.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from kernels.contract import SSDProblem, validate
from properties import provenance
from properties.problems import ProblemSpec, build_problem

SCHEMA = "mamba2-cutile-failure/1"
FAILURES_ENV = "MAMBA2_CUTILE_FAILURES"
# Inputs up to 64 MiB travel with the artifact (a problem of a few million elements); larger ones
# are rebuilt from the recipe, which the hash then vouches for.
TENSOR_LIMIT_BYTES = 64 * 2**20

# Artifacts written since the last ``take_written()``: the test harness attaches the Hypothesis
# blob, known only once Hypothesis reports, to the artifacts its failing test wrote.
_written: list[Path] = []


def failures_dir() -> Path:
    return Path(os.environ.get(FAILURES_ENV) or provenance.REPO_ROOT / "failures")


def _tensors(problem: SSDProblem) -> dict[str, torch.Tensor]:
    return {k: v for k, v in problem.call_kwargs().items() if isinstance(v, torch.Tensor)}


def _options(problem: SSDProblem) -> dict:
    """The call's non-tensor arguments, JSON-able."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in problem.call_kwargs().items()
            if k not in _tensors(problem) and not (v is None)}


def input_hash(problem: SSDProblem) -> str:
    """sha256 over every input tensor's name, dtype, shape and bytes (CPU, contiguous), by name."""
    h = hashlib.sha256()
    for name, t in sorted(_tensors(problem).items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _stem(kind: str, name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{kind}-{name}").strip("_")[:150]


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def save_artifact(*, kind: str, name: str, problem: SSDProblem, impl: str, errors: dict,
                  spec: Optional[ProblemSpec] = None, options: Optional[dict] = None,
                  message: str = "", hypothesis_blob: Optional[str] = None,
                  directory: Optional[Path] = None) -> Path:
    """Write the artifact of one failure and return its JSON path. The same kind and name
    overwrite the previous artifact (a shrinking Hypothesis run leaves its minimal example)."""
    directory = Path(directory) if directory is not None else failures_dir()
    directory.mkdir(parents=True, exist_ok=True)
    stem = _stem(kind, name)
    tensors = {k: v.detach().to("cpu") for k, v in _tensors(problem).items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    tensor_file = None
    if nbytes <= TENSOR_LIMIT_BYTES:
        tensor_file = f"{stem}.pt"
        provenance.atomic_write(directory / tensor_file, lambda f: torch.save(tensors, f))
    record = {
        "schema": SCHEMA, "kind": kind, "name": name, "impl": impl, "message": message,
        "recipe": None if spec is None else json.loads(spec.to_json()),
        "call_options": _options(problem),
        "input_sha256": input_hash(problem), "input_bytes": nbytes, "tensor_file": tensor_file,
        "options": _jsonable(options or {}), "errors": _jsonable(errors),
        "hypothesis_blob": hypothesis_blob, "environment": provenance.collect(),
    }
    path = directory / f"{stem}.json"
    provenance.write_json(path, record)
    _written.append(path)
    return path


def take_written() -> list[Path]:
    """Artifacts written since the last call (and forget them)."""
    paths = list(dict.fromkeys(_written))
    _written.clear()
    return paths


def attach_hypothesis_blob(path: Path, blob: str) -> None:
    record = json.loads(Path(path).read_text())
    record["hypothesis_blob"] = blob
    provenance.write_json(path, record)


@dataclass
class FailureRecord:
    """What a check fills in as it measures, saved with the artifact if the check then fails."""

    errors: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    path: Optional[Path] = None


def _is_control_flow(exc: BaseException) -> bool:
    """Hypothesis' rejections (assume, filters) are not failures."""
    try:
        from hypothesis.errors import UnsatisfiedAssumption  # noqa: PLC0415
    except ImportError:
        return False
    return isinstance(exc, UnsatisfiedAssumption)


@contextmanager
def failure_artifact(*, kind: str, name: str, problem: SSDProblem, impl: str,
                     spec: Optional[ProblemSpec] = None, options: Optional[dict] = None):
    """Run a check; if it raises, save the artifact first (message: the exception), then re-raise.

        with failure_artifact(kind="property", name=..., problem=p, impl=i.name, spec=s) as rec:
            rec.errors["out"] = metrics
            assert ...
    """
    record = FailureRecord(options=dict(options or {}))
    try:
        yield record
    except Exception as exc:
        if not _is_control_flow(exc):
            record.path = save_artifact(kind=kind, name=name, problem=problem, impl=impl,
                                        errors=record.errors, spec=spec, options=record.options,
                                        message=f"{type(exc).__name__}: {exc}")
            if hasattr(exc, "add_note"):   # Python 3.11+
                exc.add_note(f"repro artifact: {record.path}  (replay: mamba2-cutile repro "
                             f"{record.path})")
        raise


# ---- replay -----------------------------------------------------------------------------------

def load_artifact(path) -> tuple[dict, Path]:
    """The artifact's record and its directory; ``path`` is the JSON or its stem."""
    path = Path(path)
    if path.suffix != ".json":
        path = path.with_suffix(".json")
    if not path.is_file():
        raise FileNotFoundError(f"artifact: expected a failure artifact JSON, got {path} (missing)")
    record = json.loads(path.read_text())
    if record.get("schema") != SCHEMA:
        raise ValueError(f"artifact: expected schema {SCHEMA}, got {record.get('schema')!r}")
    return record, path.parent


def artifact_problem(record: dict, directory: Path, device="cpu",
                     seed: Optional[int] = None) -> tuple[SSDProblem, str]:
    """The artifact's inputs and where they came from. ``seed`` rebuilds the recipe with another
    seed (a neighbouring case); otherwise the saved tensors, else the recipe, must hash as
    recorded."""
    recipe = record.get("recipe")
    if seed is not None:
        if recipe is None:
            raise ValueError("--seed: this artifact has no recipe to re-seed (its inputs were "
                             "derived, e.g. by a metamorphic relation); replay it without --seed")
        spec = ProblemSpec.from_dict({**recipe, "seed": seed})
        return build_problem(spec, device), f"recipe with seed {seed}"
    if record.get("tensor_file"):
        tensors = torch.load(directory / record["tensor_file"], map_location="cpu")
        options = dict(record["call_options"])
        if "dt_limit" in options:
            options["dt_limit"] = tuple(options["dt_limit"])
        problem = validate(**{k: v.to(device) for k, v in tensors.items()}, **options)
        source = f"saved tensors {record['tensor_file']}"
    elif recipe is not None:
        problem = build_problem(ProblemSpec.from_dict(recipe), device)
        source = "recipe"
    else:
        raise ValueError("artifact: neither saved tensors nor a recipe to rebuild the inputs from")
    got = input_hash(problem)
    if got != record["input_sha256"]:
        raise ValueError(f"artifact inputs: expected sha256 {record['input_sha256']}, rebuilt "
                         f"{got} from the {source} (a different torch build may draw differently; "
                         "replay from the saved tensors)")
    return problem, source


def replay(record: dict, directory: Path, impl_name: Optional[str] = None, device=None,
           seed: Optional[int] = None, out=sys.stdout) -> dict:
    """Re-run the artifact's implementation on its inputs; print per-stage errors and verdicts."""
    from properties.impls import get_impl  # noqa: PLC0415
    name = impl_name or record["impl"]
    impl = get_impl(name)
    device = device or impl.device or "cpu"
    problem, source = artifact_problem(record, directory, device, seed)
    print(f"artifact: {record['kind']} {record['name']}: {record.get('message', '')}", file=out)
    print(f"inputs: {source}, sha256 {input_hash(problem)}; column 'recorded': the artifact's "
          f"numbers for {record['impl']}", file=out)
    recorded = record.get("errors", {})
    summary = replay_problem(problem, impl, recorded=recorded.get("impl"), out=out)
    if "impl" not in recorded and recorded:
        # A relation between runs failed (options say which): its own numbers, as recorded.
        print(f"recorded by the failing check (options {record.get('options')}):", file=out)
        for name, values in recorded.items():
            print(f"  {name}: {values}", file=out)
    return summary


def replay_problem(problem: SSDProblem, impl, recorded: Optional[dict] = None,
                   out=sys.stdout) -> dict:
    """Errors of every stage of ``impl`` on ``problem`` against the exact stages and the rule."""
    from properties import check  # noqa: PLC0415
    exact = check.exact_stages(problem)
    result = impl(problem)
    errors = check.stage_errors(problem, result, exact)
    if impl.name == "reference":
        verdicts = check.apriori_verdicts(problem, result, exact, impl.compute_dtype)
        rule = "the a-priori rounding bound (the reference is its own baseline)"
    else:
        verdicts = check.judge(problem, errors, check.baseline_errors(problem, exact), result)
        rule = ("k x reference-fp32 max_abs (worst of decays as rounded, +-1 ulp, cumsum rounded "
                "once) + floor")
    by_stage = {v.stage: v for v in verdicts}
    rows = []
    for stage, m in errors.items():
        v = by_stage[stage]
        was = (recorded or {}).get(stage, {}).get("max_abs")
        rows.append([stage, m["max_abs"], was, m["max_rel"], m["normwise_rel"], m["ulp_max"],
                     v.allowed, "ok" if v.ok else "FAIL"])
    print(f"implementation {impl.name}; errors against float64 ({check.exact_tier(problem)}), "
          f"allowed = {rule}:", file=out)
    print(check._table(rows, ["stage", "max_abs", "recorded", "max_rel", "normwise_rel",
                              "ulp_max", "allowed", "verdict"]), file=out)
    first = check.first_failing(verdicts)
    if first is None:
        print("no stage breaks the rule: the failure does not reproduce here", file=out)
    else:
        print(f"first stage where the error appears: {first.stage} ({first.describe()})", file=out)
    return {"errors": errors, "first_failing": None if first is None else first.stage}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from properties import check  # noqa: PLC0415
    parser.add_argument("artifact", nargs="?", help="a failure artifact (.json); without it the "
                        "problem comes from the options below")
    parser.add_argument("--impl", default=None, help="implementation to replay (default: the "
                        "artifact's; without an artifact: reference)")
    parser.add_argument("--device", default=None)
    check.add_problem_arguments(parser)
    # With an artifact, --seed re-seeds its recipe; unset, the artifact's own inputs replay.
    parser.set_defaults(seed=None)


def main(args: argparse.Namespace) -> int:
    """Exit status 1 when a stage breaks the rule (the failure reproduces), 2 when the
    implementation cannot run here, else 0."""
    from properties import check  # noqa: PLC0415
    from properties.impls import ImplUnavailable, get_impl  # noqa: PLC0415
    try:
        if args.artifact:
            record, directory = load_artifact(args.artifact)
            summary = replay(record, directory, args.impl, args.device, args.seed)
        else:
            impl = get_impl(args.impl or "reference")
            spec = check.spec_from_args(args)
            print(f"recipe: {spec.to_json()}")
            summary = replay_problem(build_problem(spec, args.device or impl.device or "cpu"), impl)
    except ImplUnavailable as exc:
        print(f"mamba2-cutile repro: {exc}; replay another implementation on the same inputs "
              "with --impl (e.g. --impl reference), or on a machine that has this one",
              file=sys.stderr)
        return 2
    return 0 if summary["first_failing"] is None else 1
