"""``mamba2-cutile ab``: the dispatched kernels against arms that change their configs, one process.

    mamba2-cutile ab --case "8,4096,64,64,128,1 x_dtype=fp16 bc_dtype=fp16" \\
        --arm "t2 scan_out.occupancy=2 scan_out.out_transposed=true scan_out.b_latency=0"

A case is a benchmark problem (``properties.bench.bench_spec``: bf16 x/B/C, fp32 dt/A, out alone)
given as B,L,H,P,N,G, then ``ProblemSpec`` fields to change. An arm is a name, then fields of the
plan's kernel configs to change, each ``<plan field>.<config field>=<value>`` (``kernels.ssd.Plan``:
cumsum, out, state_scan, scan_out, segment_states, ...), and/or ``chunk_size=<n>``: the call at
that chunk size as the dispatcher plans it (the same tensors), with any config changes on top; a
dispatch rule that moves calls between chunk sizes is timed so. ``precision=<mode>`` plans the
call as ``ssd_forward(precision=<mode>)`` does (an opt-in mode against the default, say).
``ssd.<NAME>=<value>`` (or ``ssd.<NAME>.<key>=<value>`` for an item of a dict) plans the arm
with one of kernels.ssd's dispatch constants changed (``WALK_MIN_SPLIT_ROW_HEADS``,
``WALK_PAIRING.input``, ...; the constants read when a call is planned, e.g. which calls the
walk takes and in how many segments), so that a new rule is timed by this command before it is
written; an arm whose constants leave the plan as dispatched is recorded as not applicable.
Values are JSON (2, true, null, "bf16", [0.0, 6.0]) or else plain text; every name and type is
checked before any GPU work.

Each case runs the dispatcher's plan ("dispatched") and every arm that applies to it (an arm
naming a kernel the plan does not run is recorded as not applicable), all on the same inputs.
After a first call of each (compiling it) and a warm-up round, ``--rounds`` rounds time
``--reps`` calls of each in turn, each call after an L2 flush between CUDA events
(``properties.bench.CudaTimer``); the order rotates each round, so no arm always follows the
same one. Recorded per arm: what it runs beside the dispatched plan (``plan_record``: chunk
size, segments, changed config fields), the median, its ratio to the dispatched plan's, whether
out and the final and varlen states equal the dispatched plan's bit for bit, out's largest
difference and the states', and out's error against the float64 reference (as the bench's
rows).

``--compile sm_90`` (any target tileiras knows) needs no GPU: it compiles each case's kernels as
the dispatcher plans them for that target on the H200's SM count, and each arm's, as their
launches specialize them (``kernels.variants.launch_signatures``), and records per kernel its
registers, spilled bytes, shared memory and tensor-core MMAs: whether an arm fits (two blocks an
SM need at most half of its shared memory) before a GPU times it.

The record (JSON, with provenance) is rewritten after every case, so an interrupted run keeps the
cases it finished; an existing file is never overwritten.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kernels import ssd, variants
from properties import bench
from properties.metrics import error_metrics
from properties.problems import DTYPES, ProblemSpec, build_problem
from properties.provenance import REPO_ROOT, collect, device_label, write_json
from properties.regimes import REGIMES

SCHEMA = "mamba2-cutile ab 1"
DISPATCHED = "dispatched"
ARM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
RULE_PREFIX = "ssd."
RULE_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# The ProblemSpec fields that name one of a few things (build_problem would fail on others late).
CASE_CHOICES = {**{name: set(DTYPES) for name in ("x_dtype", "bc_dtype", "param_dtype",
                                                  "state_dtype")},
                "regime": set(REGIMES), "D": {None, "head", "channel"}}


@dataclass(frozen=True)
class Case:
    text: str
    spec: ProblemSpec


@dataclass(frozen=True)
class Arm:
    name: str
    changes: dict        # plan field -> {config field: value}
    chunk_size: int | None = None   # re-planned at this chunk size; None: the case's
    precision: str | None = None    # re-planned in this mode (ssd_forward's); None: the default
    # kernels.ssd's dispatch constants the arm is planned with: (NAME, dict key or None) -> value
    rules: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        def word(name: str, value) -> str:      # one word a change, as parse_arm reads it
            return f"{name}={json.dumps(value, default=str, separators=(',', ':'))}"

        return " ".join(([] if self.chunk_size is None else [f"chunk_size={self.chunk_size}"])
                        + ([] if self.precision is None else [f"precision={self.precision}"])
                        + [word(RULE_PREFIX + name + ("" if key is None else "." + key), value)
                           for (name, key), value in self.rules.items()]
                        + [word(f"{stage}.{name}", value)
                           for stage, fields in self.changes.items()
                           for name, value in fields.items()])

    def replans(self, chunk_size: int) -> bool:
        """Whether this arm's plan is made anew for a case at ``chunk_size`` (another chunk
        size, mode or dispatch constants), not changed from the dispatched one."""
        return (self.replanned(chunk_size) != chunk_size or self.precision is not None
                or bool(self.rules))

    def replanned(self, chunk_size: int) -> int:
        """The chunk size this arm's plan is made at, for a case at ``chunk_size``."""
        return chunk_size if self.chunk_size is None else self.chunk_size


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _split_assignment(option: str, text: str, item: str) -> tuple[str, Any]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise ValueError(f"{option}: expected NAME=VALUE after the first word, got {item!r} in "
                         f"{text!r}")
    return name, parse_value(value)


def _allowed(hint) -> tuple:
    """The value types a field annotated ``hint`` takes (None included for Optional)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for h in typing.get_args(hint) for a in _allowed(h))
    if typing.get_origin(hint) is tuple:
        return (list, tuple)
    return (type(None),) if hint is type(None) else (hint,)


def coerce(option: str, owner: str, field: str, hint, value: Any) -> Any:
    """``value`` as the type of ``owner.field`` (annotated ``hint``), or a ValueError naming it."""
    allowed = _allowed(hint)
    if torch.dtype in allowed and isinstance(value, str):
        # 'bf16', 'bfloat16' or 'torch.bfloat16' (the last as a record's words write it)
        dtype = DTYPES.get(value, getattr(torch, value.removeprefix("torch."), None))
        if isinstance(dtype, torch.dtype):
            return dtype
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tuple in allowed and isinstance(value, list):
        return tuple(value)
    # bool is an int to isinstance; a knob's 1 and true are not interchangeable here.
    if isinstance(value, bool) != (bool in allowed) or not isinstance(value, allowed):
        names = " or ".join("None" if a is type(None) else getattr(a, "__name__", str(a))
                            for a in allowed if a is not list)
        # values are JSON, which has no '(a,b)': a tuple is written as a list
        form = " (written as a JSON list, e.g. [128,1.5])" if tuple in allowed else ""
        raise ValueError(f"{option}: {owner}.{field} expected {names}{form}, got {value!r}")
    return value


def parse_case(text: str, chunk_size: int) -> Case:
    """'B,L,H,P,N,G [field=value ...]' -> the benchmark problem with those ProblemSpec fields."""
    words = text.split()
    try:
        dims = tuple(int(d) for d in words[0].split(","))
    except (ValueError, IndexError):
        dims = ()
    if len(dims) != 6 or min(dims) < 1 or dims[2] % dims[5]:
        raise ValueError(f"--case: expected B,L,H,P,N,G (positive sizes, G dividing H) and then "
                         f"field=value words, got {text!r}")
    hints = typing.get_type_hints(ProblemSpec)
    changes = {}
    for item in words[1:]:
        name, value = _split_assignment("--case", text, item)
        if name not in hints or name == "chunk_size":
            raise ValueError(f"--case: expected fields of ProblemSpec other than chunk_size "
                             f"(--chunk-size sets it), got {name!r} in {text!r}")
        value = coerce("--case", "ProblemSpec", name, hints[name], value)
        if name in CASE_CHOICES and value not in CASE_CHOICES[name]:
            raise ValueError(f"--case: ProblemSpec.{name} expected one of "
                             f"{sorted(CASE_CHOICES[name], key=str)}, got {value!r}")
        changes[name] = value
    return Case(text, bench.bench_spec(dims, chunk_size, **changes))


def _config_classes() -> dict:
    """Plan field -> its kernel config class (the plan's dataclass fields, Optional unwrapped)."""
    classes = {}
    for name, hint in typing.get_type_hints(ssd.Plan).items():
        found = [a for a in _allowed(hint) if dataclasses.is_dataclass(a)]
        if found:
            classes[name] = found[0]
    return classes


def parse_arm(text: str) -> Arm:
    """'NAME [chunk_size=n] plan_field.config_field=value ...' -> an Arm, names and types
    checked."""
    words = text.split()
    if len(words) < 2 or not ARM_NAME.fullmatch(words[0]) or words[0] == DISPATCHED:
        raise ValueError(f"--arm: expected a name (letters, digits, '_', '.', '-'; not "
                         f"{DISPATCHED!r}) and then chunk_size=n or plan_field.config_field=value "
                         f"words, got {text!r}")
    classes = _config_classes()
    changes: dict = {}
    rules: dict = {}
    chunk_size = precision = None
    for item in words[1:]:
        path, value = _split_assignment("--arm", text, item)
        if path == "precision":
            if value not in ssd.PRECISIONS:
                raise ValueError(f"--arm: precision expected one of {ssd.PRECISIONS}, got "
                                 f"{value!r} in {text!r}")
            precision = value
            continue
        if path == "chunk_size":
            if isinstance(value, bool) or value not in ssd.SUPPORTED_CHUNK_SIZES:
                raise ValueError(f"--arm: chunk_size expected one of "
                                 f"{ssd.SUPPORTED_CHUNK_SIZES}, got {value!r} in {text!r}")
            chunk_size = value
            continue
        if path.startswith(RULE_PREFIX):
            rule, value = parse_rule(text, path.removeprefix(RULE_PREFIX), value)
            rules[rule] = value
            continue
        stage, _, field = path.partition(".")
        if stage not in classes:
            raise ValueError(f"--arm: expected a kernel config of the plan ({', '.join(classes)})"
                             f" before '.', got {stage!r} in {text!r}")
        hints = typing.get_type_hints(classes[stage])
        if field not in hints:
            raise ValueError(f"--arm: expected a field of {classes[stage].__name__} after "
                             f"'{stage}.' ({', '.join(hints)}), got {field!r} in {text!r}")
        changes.setdefault(stage, {})[field] = coerce("--arm", stage, field, hints[field], value)
    return Arm(words[0], changes, chunk_size, precision, rules)


def parse_rule(text: str, path: str, value: Any) -> tuple[tuple[str, str | None], Any]:
    """'NAME' or 'NAME.key' (after 'ssd.') and its value -> ((NAME, key or None), the value as
    the type of the constant, or of the dict's items), a ValueError naming what is wrong."""
    name, dot, key = path.partition(".")
    if not RULE_NAME.fullmatch(name) or not hasattr(ssd, name):
        raise ValueError(f"--arm: expected a dispatch constant of kernels.ssd after "
                         f"'{RULE_PREFIX}' (upper case, e.g. WALK_MIN_SPLIT_ROW_HEADS), got "
                         f"{name!r} in {text!r}")
    current = getattr(ssd, name)
    if isinstance(current, dict):
        if not dot or not key or not current or not all(isinstance(k, str) for k in current):
            raise ValueError(f"--arm: {RULE_PREFIX}{name} is a dict: expected "
                             f"{RULE_PREFIX}{name}.<key>=value, its keys text, got {path!r} in "
                             f"{text!r} (keys: {list(current)})")
        current = current.get(key, next(iter(current.values())))
    elif dot:
        raise ValueError(f"--arm: {RULE_PREFIX}{name} is no dict, so takes no '.<key>', got "
                         f"{path!r} in {text!r}")
    if not isinstance(current, (bool, int, float, str, tuple)):
        raise ValueError(f"--arm: {RULE_PREFIX}{path} is a {type(current).__name__}: expected a "
                         f"constant that is a number, text or tuple, or a dict of them, in "
                         f"{text!r}")
    return (name, key if dot else None), coerce("--arm", "ssd", path, type(current), value)


def apply_arm(plan, arm: Arm):
    """``plan`` with the arm's changes, or a str saying why the arm does not apply to it: it
    changes a config the plan holds but does not launch (the walk's plan keeps compute_out's)."""
    launched = plan.configs()
    for stage in arm.changes:
        if not any(getattr(plan, stage) is cfg for cfg in launched):
            return (f"the plan does not launch its {stage} (it launches "
                    f"{', '.join(name for name, _ in plan.named_configs())})")
    return plan.with_knobs(arm.changes)


def arm_plan(arm: Arm, dispatched, replanned, same_chunk_size: bool):
    """The arm's plan (``apply_arm`` on ``replanned``, the plan made for it), or a str saying why
    it does not apply: that, or dispatch constants that leave the plan as ``dispatched`` at the
    same chunk size."""
    if arm.rules and same_chunk_size and replanned == dispatched:
        return "its dispatch constants leave the plan as dispatched"
    return apply_arm(replanned, arm)


def interleaved_times(calls: dict[str, Callable[[], Any]], rounds: int, reps: int,
                      times: Callable[[Callable[[], Any], int], list[float]]) -> dict:
    """name -> ``rounds * reps`` times of its call: each round times ``reps`` calls of each name,
    the names in an order rotated by one each round."""
    names = list(calls)
    timed: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            timed[name] += times(calls[name], reps)
    return timed


def compare(outs: dict, base: str = DISPATCHED) -> dict:
    """name -> bit_equal (out and the final and varlen states equal ``base``'s bit for bit),
    max_abs_diff (out's largest difference from ``base``'s) and, where both return states,
    states_max_abs_diff (the states' largest difference). ``outs``: name -> (out, final
    states or None[, varlen states or None])."""
    ref_out, *ref_states = outs[base]
    found = {}
    for name, (out, *states) in outs.items():
        pairs = list(zip(states, ref_states, strict=True))
        equal = torch.equal(out, ref_out) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in pairs)
        found[name] = dict(bit_equal=bool(equal),
                           max_abs_diff=float((out.double() - ref_out.double()).abs().max()))
        diffs = [float((a.double() - b.double()).abs().max()) for a, b in pairs
                 if a is not None and b is not None]
        if diffs:
            found[name]["states_max_abs_diff"] = max(diffs)
    return found


def plan_record(pipeline, base) -> dict:
    """What ``pipeline`` runs beside ``base`` (the dispatched one), so a record says what each
    arm timed, a rule's arm included: its chunk size, the walk's segments and their parts
    (``ssd.walk_segments``, ``ssd.segment_split``) and, per kernel it launches, the config
    fields that differ from base's kernel of that name (all fields where base has none)."""
    base_configs = dict(base.plan.named_configs())
    changed = {}
    for stage, config in pipeline.plan.named_configs():
        fields = _config_text(config)
        if stage in base_configs:
            base_fields = _config_text(base_configs[stage])
            fields = {k: v for k, v in fields.items() if base_fields.get(k) != v}
        if fields:
            changed[stage] = fields
    return dict(chunk_size=pipeline.problem.chunk_size, walk_segments=pipeline.plan.walk_segments,
                segment_split=pipeline.plan.segment_split, changed=changed)


def _config_text(config) -> dict:
    """A kernel config's fields as text (dtypes and None as JSON cannot hold them)."""
    return {k: str(v) for k, v in dataclasses.asdict(config).items()}


def run_case(case: Case, arms: list[Arm], rounds: int, reps: int, device: str = "cuda") -> dict:
    """The case's record: the plan's changed configs as dispatched and each arm's figures."""
    problem = build_problem(case.spec, device, draw_on_device=True)
    base = ssd.stage_pipeline(problem, varlen=case.spec.return_varlen_states)    # as ssd_forward
    record: dict = dict(case=case.text, spec=dataclasses.asdict(case.spec), arms={DISPATCHED: {}})
    pipelines = {DISPATCHED: base}
    for arm in arms:
        replanned = base
        if arm.replans(problem.chunk_size):
            try:
                with ssd.dispatch_rules(arm.rules):
                    replanned = ssd.stage_pipeline(
                        dataclasses.replace(problem, chunk_size=arm.replanned(problem.chunk_size)),
                        precision=arm.precision, varlen=case.spec.return_varlen_states)
            except ssd.SSDInputError as exc:    # a mode the case's dtypes do not take
                record["arms"][arm.name] = dict(changes=arm.describe(), not_applicable=str(exc))
                continue
        plan = arm_plan(arm, base.plan, replanned.plan,
                        replanned.problem.chunk_size == problem.chunk_size)
        if isinstance(plan, str):
            record["arms"][arm.name] = dict(changes=arm.describe(), not_applicable=plan)
            continue
        record["arms"][arm.name] = dict(changes=arm.describe())
        pipelines[arm.name] = dataclasses.replace(replanned, plan=plan)
    for name, pipeline in pipelines.items():
        record["arms"][name]["launches"] = [kernel for kernel, _ in
                                            pipeline.plan.named_configs()]
        record["arms"][name]["plan"] = plan_record(pipeline, base)
    record["dispatched"] = {stage: _config_text(getattr(base.plan, stage)) for arm in arms
                            for stage in arm.changes if getattr(base.plan, stage) is not None}
    rows, heads, groups = bench.error_slice(case.spec)
    exact = bench.reference_out(problem, rows, heads, groups)
    outs, calls = {}, {}
    for name, pipeline in pipelines.items():
        entry = record["arms"][name]
        try:
            result = ssd.launch_stages(pipeline)
            if problem.x.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # an arm that fails to compile or launch: recorded, not fatal
            entry["failed"] = f"{type(exc).__name__}: {exc}"[:2000]
            continue
        outs[name] = (result.out, result.final_states, result.varlen_states)
        entry["error"] = error_metrics(result.out[:rows, :, :heads], exact,
                                       DTYPES[case.spec.x_dtype])
        calls[name] = lambda pipeline=pipeline: ssd.launch_stages(pipeline)
    if DISPATCHED not in outs:
        record["failed"] = "the dispatched plan: " + record["arms"][DISPATCHED]["failed"]
        return record
    for name, found in compare(outs).items():
        record["arms"][name].update(found)
    timer = bench.CudaTimer(bench.FULL_TIMING)
    interleaved_times(calls, 1, reps, timer.times)      # warm-up round, not recorded
    timed = interleaved_times(calls, rounds, reps, timer.times)
    base_ms = statistics.median(timed[DISPATCHED])
    for name, ms in timed.items():
        record["arms"][name].update(ms=statistics.median(ms), ratio=statistics.median(ms) / base_ms,
                                    times_ms=ms)
    return record


def case_key(spec: ProblemSpec):
    """The dispatcher's key of the case's call (``kernels.ssd.ProblemKey``), read off the case
    drawn at one chunk of one row (its features, dtypes and flags) with its sizes put back: no
    data of the case's size on the CPU. Packed sequences are drawn whole (their offsets are
    the sequence's)."""
    if spec.cu_seqlens is not None:     # varlen as ssd_forward's stage_pipeline takes it
        return ssd._key(build_problem(spec), spec.return_varlen_states, None)
    small = dataclasses.replace(spec, batch=1, seqlen=spec.chunk_size)
    sizes = {name: getattr(spec, name)
             for name in ("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups")}
    return dataclasses.replace(ssd._key(build_problem(small), False, None), **sizes)


def compiled_kernels(key, plan, target: str, done: dict) -> dict:
    """kernel name -> its compile for ``target`` on ``key``'s launches of ``plan`` (ok, registers,
    spill_bytes, shared_bytes, tensor_core_mmas, seconds; the error where it failed); ``done``
    holds the compiles of earlier calls, by config and signature."""
    found = {}
    for name, config, signature in variants.launch_signatures(key, plan):
        memo = (config, repr(signature))
        if memo not in done:
            variant = variants.Variant(name, config, signature, ("ab",),
                                       getattr(config, "precision", ""))
            result = variants.compile_variant(variant, target)
            done[memo] = dict(ok=result.ok, registers=result.registers,
                              spill_bytes=result.spill_bytes, shared_bytes=result.shared_bytes,
                              tensor_core_mmas=result.tensor_core_mmas,
                              seconds=round(result.seconds, 1))
            if not result.ok:
                done[memo]["error"] = result.error[-2000:]
        found[name] = done[memo]
    return found


def compile_case(case: Case, arms: list[Arm], target: str, done: dict) -> dict:
    """The case's record of ``--compile``: the dispatched plan's kernels and each arm's."""
    key = case_key(case.spec)
    base = ssd.make_plan(key, capability=variants.target_capability(target))
    record: dict = dict(case=case.text, spec=dataclasses.asdict(case.spec), target=target,
                        arms={DISPATCHED: dict(kernels=compiled_kernels(key, base, target, done))})
    for arm in arms:
        arm_key = dataclasses.replace(key, chunk_size=arm.replanned(key.chunk_size))
        replanned = base
        if arm.replans(key.chunk_size):
            try:
                with ssd.dispatch_rules(arm.rules):
                    replanned = ssd.make_plan(arm_key, precision=arm.precision,
                                              capability=variants.target_capability(target))
            except ssd.SSDInputError as exc:
                record["arms"][arm.name] = dict(changes=arm.describe(), not_applicable=str(exc))
                continue
        plan = arm_plan(arm, base, replanned, arm_key == key)
        if isinstance(plan, str):
            record["arms"][arm.name] = dict(changes=arm.describe(), not_applicable=plan)
        else:
            record["arms"][arm.name] = dict(changes=arm.describe(),
                                            kernels=compiled_kernels(arm_key, plan, target, done))
    return record


def format_record(record: dict) -> list[str]:
    lines = [record["case"] + (f": failed: {record['failed']}" if "failed" in record else "")]
    for name, arm in record["arms"].items():
        if "ms" in arm:
            plan = arm.get("plan")
            layout = "" if plan is None else (f"  Q{plan['chunk_size']}, {plan['walk_segments']} "
                                              f"segments, {plan['segment_split']} parts")
            lines.append(f"  {name:14s} {arm['ms']:8.4f} ms {arm['ratio']:6.3f}x  bit-equal "
                         f"{arm['bit_equal']!s:5s} max diff {arm['max_abs_diff']:.3g}"
                         + (f" (states {arm['states_max_abs_diff']:.3g})"
                            if "states_max_abs_diff" in arm else "")
                         + f"  normwise {arm['error']['normwise_rel']:.3g}{layout}")
        elif "kernels" in arm:
            # An arm's line names the kernels whose compile differs from the dispatched plan's.
            as_dispatched = record["arms"][DISPATCHED]["kernels"] if name != DISPATCHED else {}
            shown = {kernel: k for kernel, k in arm["kernels"].items()
                     if as_dispatched.get(kernel) != k}
            lines.append(f"  {name:14s} " + ("; ".join(
                f"{kernel} {k['registers']} regs, {k['spill_bytes']} B spilled, "
                f"{k['shared_bytes']} B shared" if k["ok"] else f"{kernel} FAILED to compile"
                for kernel, k in shown.items()) or "as dispatched"))
        else:
            lines.append(f"  {name:14s} {arm.get('failed') or arm.get('not_applicable')}")
    return lines


def default_out(arms: list[Arm], target: str | None = None) -> Path:
    commit = collect().get("git_commit") or "nocommit"
    tag = "_".join([arm.name for arm in arms] + ([target] if target else []))
    return REPO_ROOT / "reports" / device_label() / "experiments" / f"ab_{tag}_{commit[:7]}.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", action="append", required=True, metavar="'B,L,H,P,N,G [k=v ...]'",
                        help="a problem (repeatable): bf16 x/B/C, fp32 dt/A, out alone, unless "
                             "ProblemSpec fields say otherwise (x_dtype=fp16 bc_dtype=fp16 "
                             "return_final_states=true z=true D=channel ...)")
    parser.add_argument("--arm", action="append", required=True, metavar="'NAME stage.field=v ...'",
                        help="a named change of the plan's kernel configs (repeatable), e.g. "
                             "'t2 scan_out.occupancy=2 scan_out.out_transposed=true', or of "
                             "its chunk size or kernels.ssd's dispatch constants, re-planned: "
                             "'q256 chunk_size=256', 'w80 ssd.WALK_MIN_SPLIT_ROW_HEADS=80'; "
                             "'p2 precision=2xbf16' plans it in that mode")
    parser.add_argument("--chunk-size", type=int, default=64,
                        help="the cases' chunk size (default 64, where the walk runs)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7, help="timed calls of each arm a round")
    parser.add_argument("--compile", metavar="TARGET", default=None,
                        help="no GPU: compile each plan's kernels for TARGET (sm_80, sm_90, "
                             "sm_100, ...) and record their registers, spills and shared memory")
    parser.add_argument("--out", type=Path, default=None,
                        help="the record (default reports/<device>/experiments/"
                             "ab_<arm names>[_<target>]_<commit>.json); never overwritten")


def main(args: argparse.Namespace) -> int:
    try:
        if args.rounds < 1 or args.reps < 1:
            raise ValueError(f"--rounds, --reps: expected positive counts, got {args.rounds}, "
                             f"{args.reps}")
        cases = [parse_case(text, args.chunk_size) for text in args.case]
        arms = [parse_arm(text) for text in args.arm]
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"--arm: expected distinct names, got {names}")
        if args.compile is not None and not re.fullmatch(r"sm_\d+", args.compile):
            raise ValueError(f"--compile: expected a target such as sm_90, got {args.compile!r}")
    except ValueError as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    if args.compile is None and not torch.cuda.is_available():
        print("ab: needs a CUDA device and none is visible to torch (--compile TARGET needs none)",
              file=sys.stderr)
        return 2
    out = args.out or default_out(arms, args.compile)
    if out.exists():
        print(f"ab: --out {out} exists; give another path (records are never overwritten)",
              file=sys.stderr)
        return 2
    doc = dict(schema=SCHEMA, provenance=collect(),
               chunk_size=args.chunk_size, rounds=args.rounds, reps=args.reps,
               compile_target=args.compile, arms={arm.name: arm.describe() for arm in arms},
               cases=[])
    done: dict = {}
    for case in cases:
        try:
            if args.compile is not None:
                record = compile_case(case, arms, args.compile, done)
            else:
                record = run_case(case, arms, args.rounds, args.reps)
        except Exception as exc:  # the case's problem or plan: recorded, the next case runs
            record = dict(case=case.text, failed=f"{type(exc).__name__}: {exc}"[:2000], arms={})
        doc["cases"].append(record)
        write_json(out, doc)
        print("\n".join(format_record(doc["cases"][-1])), flush=True)
    print(f"wrote {out}", file=sys.stderr)
    return 0
