"""``mamba2-cutile ab`` on the CPU: its cases and arms checked before any GPU work, the rounds'
interleaving, the comparison with the dispatched plan and one case end to end with stand-ins for
the kernels and the CUDA timer. tests/test_bench_gpu.py runs it on the kernels."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

from kernels import ssd
from kernels.variants import _anchor
from oracles.chunked_reference import chunked_ssd
from properties import ab, bench
from properties.problems import build_problem

WALK_ARM = "t2 scan_out.occupancy=2 scan_out.out_transposed=true scan_out.b_latency=0"


def test_a_case_is_a_benchmark_problem_with_spec_fields_changed():
    case = ab.parse_case("8,4096,64,64,128,1 x_dtype=fp16 bc_dtype=fp16 z=true D=channel "
                         "dt_limit=[0.0,6.0]", chunk_size=64)
    assert case.spec == dataclasses.replace(
        bench.bench_spec((8, 4096, 64, 64, 128, 1), 64), x_dtype="fp16", bc_dtype="fp16", z=True,
        D="channel", dt_limit=(0.0, 6.0))
    assert ab.parse_case("2,512,8,64,64,2", 128).spec.chunk_size == 128


@pytest.mark.parametrize("text, named", [
    ("8,4096,64,64,128", "B,L,H,P,N,G"),
    ("8,4096,0,64,128,1", "B,L,H,P,N,G"),
    ("8,4096,6,64,128,4", "G dividing H"),
    ("8,4096,64,64,128,1 z", "NAME=VALUE"),
    ("8,4096,64,64,128,1 zz=true", "'zz'"),
    ("8,4096,64,64,128,1 chunk_size=64", "--chunk-size"),
    ("8,4096,64,64,128,1 z=1", "ProblemSpec.z expected bool, got 1"),
    ("8,4096,64,64,128,1 seed=true", "ProblemSpec.seed expected int, got True"),
    ("8,4096,64,64,128,1 x_dtype=fp8", "ProblemSpec.x_dtype expected one of"),
    ("8,4096,64,64,128,1 D=row", "ProblemSpec.D expected one of"),
    ("8,4096,64,64,128,1 regime=calm", "ProblemSpec.regime expected one of"),
])
def test_a_bad_case_is_refused_naming_what_was_expected(text, named):
    with pytest.raises(ValueError, match="--case") as refused:
        ab.parse_case(text, 64)
    assert named in str(refused.value)


def test_an_arm_names_config_fields_of_the_plan_with_values_of_their_types():
    arm = ab.parse_arm(WALK_ARM + " scan_out.x_dtype=fp16 cumsum.head_block=8")
    assert arm.name == "t2"
    assert arm.changes == {"scan_out": dict(occupancy=2, out_transposed=True, b_latency=0,
                                            x_dtype=torch.float16),
                           "cumsum": dict(head_block=8)}
    assert ab.parse_arm("none scan_out.occupancy=null").changes == {"scan_out": {"occupancy": None}}
    assert "scan_out.out_transposed=true" in arm.describe()
    assert ab.parse_arm("t2 " + arm.describe()) == arm      # the record's words replay it
    assert arm.chunk_size is None and arm.replanned(64) == 64


def test_an_arm_may_replan_the_call_at_another_chunk_size():
    arm = ab.parse_arm("q256 chunk_size=256 out.row_block=32")
    assert (arm.chunk_size, arm.changes) == (256, {"out": dict(row_block=32)})
    assert arm.replanned(64) == 256
    assert arm.describe() == "chunk_size=256 out.row_block=32"
    assert ab.parse_arm("q128 chunk_size=128") == ab.Arm("q128", {}, 128)


def test_an_arm_may_replan_the_call_in_another_mode():
    arm = ab.parse_arm("p2 precision=2xbf16 chunk_size=256")
    assert (arm.precision, arm.chunk_size, arm.changes) == ("2xbf16", 256, {})
    assert arm.replans(256) and not ab.parse_arm("q chunk_size=256").replans(256)
    assert ab.parse_arm("p2 " + arm.describe()) == arm      # the record's words replay it


@pytest.mark.parametrize("text, named", [
    ("t2", "a name"),
    ("dispatched scan_out.occupancy=2", "not 'dispatched'"),
    ("t/2 scan_out.occupancy=2", "a name"),
    ("t2 scan_outs.occupancy=2", "a kernel config of the plan"),
    ("t2 walk_segments.x=2", "a kernel config of the plan"),
    ("t2 scan_out.occ=2", "a field of ScanOutConfig"),
    ("t2 scan_out.occupancy=true", "scan_out.occupancy expected int or None, got True"),
    ("t2 scan_out.out_transposed=1", "scan_out.out_transposed expected bool, got 1"),
    ("t2 scan_out.b_latency=1.5", "scan_out.b_latency expected int, got 1.5"),
    ("t2 scan_out.precision=3", "scan_out.precision expected str, got 3"),
    ("t2 scan_out.x_dtype=fp8", "scan_out.x_dtype expected dtype"),
    ("q chunk_size=100", "chunk_size expected one of (64, 128, 256), got 100"),
    ("q chunk_size=true", "chunk_size expected one of (64, 128, 256), got True"),
    ("q chunk_size=big", "chunk_size expected one of (64, 128, 256), got 'big'"),
    ("p precision=bf16", "precision expected one of ('ieee', "),
    ("p precision=auto", "precision expected one of ('ieee', "),
    ("w ssd.walk_segments=1", "a dispatch constant of kernels.ssd"),
    ("w ssd.NO_SUCH_RULE=1", "a dispatch constant of kernels.ssd"),
    ("w ssd.WALK_PAIRING=[64,1.5]", "ssd.WALK_PAIRING is a dict: expected ssd.WALK_PAIRING.<key>"),
    ("w ssd.AUTO_PRECISION.bf16=input", "ssd.AUTO_PRECISION is a dict"),    # keys are dtypes
    ("w ssd.WALK_MIN_SPLIT_ROW_HEADS.x=1", "takes no '.<key>'"),
    ("w ssd.WALK_MIN_SPLIT_ROW_HEADS=1.5", "ssd.WALK_MIN_SPLIT_ROW_HEADS expected int, got 1.5"),
    ("w ssd.WALK_X_LATENCY=true", "ssd.WALK_X_LATENCY expected int, got True"),
    ("w ssd.WALK_PAIRING.input=64", "ssd.WALK_PAIRING.input expected tuple (written as a JSON "
                                    "list, e.g. [128,1.5]), got 64"),
    ("w ssd.WALK_PAIRING.2xbf16=(128,1.7)", "expected tuple (written as a JSON list"),
    ("w ssd.TUNED.x={}", "ssd.TUNED.x is a dict: expected a constant that is a number"),
])
def test_a_bad_arm_is_refused_naming_what_was_expected(text, named):
    with pytest.raises(ValueError, match="--arm") as refused:
        ab.parse_arm(text)
    assert named in str(refused.value)


def test_an_arm_may_plan_the_call_with_dispatch_constants_changed():
    arm = ab.parse_arm("w80 ssd.WALK_MIN_SPLIT_ROW_HEADS=80 ssd.WALK_PAIRING.input=[64,1.5] "
                       "ssd.SCAN_OUT_PAIRED_COST=2 scan_out.b_latency=0")
    assert arm.rules == {("WALK_MIN_SPLIT_ROW_HEADS", None): 80,
                         ("WALK_PAIRING", "input"): (64, 1.5), ("SCAN_OUT_PAIRED_COST", None): 2.0}
    assert arm.changes == {"scan_out": dict(b_latency=0)} and arm.chunk_size is None
    assert arm.replans(64) and not ab.parse_arm("q chunk_size=64").replans(64)
    assert ab.parse_arm("w80 " + arm.describe()) == arm     # the record's words replay it
    # A dict's new key takes the type of its items.
    assert ab.parse_arm("p ssd.WALK_PAIRING_SM90.input=[256,1.4]").rules == {
        ("WALK_PAIRING_SM90", "input"): (256, 1.4)}


def _walks(key) -> bool:
    return ssd.make_plan(key, capability=90).scan_out is not None


def test_dispatch_constants_hold_while_the_arm_is_planned_and_no_longer():
    key = dataclasses.replace(_anchor(8, 4096, 64, 1), chunk_size=64, states_returned=False)
    before = ssd.make_plan(key, capability=90)
    assert _walks(key)
    arm = ab.parse_arm("nowalk ssd.SCAN_OUT_MIN_ROW_HEADS=1024 ssd.WALK_MIN_SPLIT_ROW_HEADS=1024 "
                       "ssd.WALK_PAIRING.input=[64,1.5] ssd.WALK_PAIRING.2xfp16=[32,1.4]")
    pairing = ssd.WALK_PAIRING
    with ssd.dispatch_rules(arm.rules):
        assert ssd.SCAN_OUT_MIN_ROW_HEADS == 1024
        assert ssd.WALK_PAIRING == {**pairing, "input": (64, 1.5), "2xfp16": (32, 1.4)}
        assert not _walks(key)      # planned anew, not the plan cached before
    assert ssd.WALK_PAIRING is pairing and pairing["input"] != (64, 1.5)
    assert ssd.SCAN_OUT_MIN_ROW_HEADS != 1024
    assert ssd.make_plan(key, capability=90) == before
    with pytest.raises(RuntimeError), ssd.dispatch_rules(arm.rules):
        raise RuntimeError("an arm that fails to plan")
    assert ssd.SCAN_OUT_MIN_ROW_HEADS != 1024 and _walks(key)


def _plan() -> ssd.Plan:
    """The plan of 2 x 4096 x 64 heads on the H200 in fp16, out alone (the walk one block an SM,
    in out's orientation: its 128 blocks take one round either way)."""
    fp16 = dict(x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    key = dataclasses.replace(_anchor(2, 4096, 64, 1, **fp16), chunk_size=64,
                              states_returned=False)
    return ssd.make_plan(key, capability=90)


def test_an_arm_changes_only_its_fields_and_says_where_it_does_not_apply():
    plan = _plan()
    changed = ab.apply_arm(plan, ab.parse_arm(WALK_ARM))
    assert changed.scan_out == dataclasses.replace(plan.scan_out, occupancy=2,
                                                   out_transposed=True, b_latency=0)
    assert dataclasses.replace(changed, scan_out=plan.scan_out) == plan
    for stage in ("out", "state_scan"):   # held by the walk's plan, not launched
        assert ab.apply_arm(plan, ab.parse_arm(f"s {stage}.p_block=32")) == (
            f"the plan does not launch its {stage} (it launches chunk_cumsum, chunk_scores, "
            "scan_out)")


def test_rounds_interleave_the_arms_in_a_rotating_order():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}

    def times(fn, reps):
        for _ in range(reps):
            fn()
        return [float(len(order))] * reps

    timed = ab.interleaved_times(calls, rounds=3, reps=2, times=times)
    assert order == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a",
                     "c", "c", "a", "a", "b", "b"]
    assert {name: len(t) for name, t in timed.items()} == {"a": 6, "b": 6, "c": 6}
    assert timed["a"][:2] == [2.0, 2.0] and timed["a"][2:4] == [12.0, 12.0]


def test_comparison_is_bit_for_bit_on_out_and_final_and_varlen_states():
    out, states, varlen = torch.ones(2, 3), torch.zeros(2), torch.zeros(3)
    nudged = out.clone()
    nudged[1, 2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    found = ab.compare({"dispatched": (out, states, varlen),
                        "same": (out.clone(), states.clone(), varlen.clone()),
                        "nudged": (nudged, states, varlen), "states": (out, states + 1, varlen),
                        "varlen": (out, states, varlen - 2), "no_states": (out, None, None)})
    assert {name: f["bit_equal"] for name, f in found.items()} == dict(
        dispatched=True, same=True, nudged=False, states=False, varlen=False, no_states=False)
    assert found["nudged"]["max_abs_diff"] == pytest.approx(2.0 ** -23)
    assert found["states"]["max_abs_diff"] == 0.0
    assert {name: f.get("states_max_abs_diff") for name, f in found.items()} == dict(
        dispatched=0.0, same=0.0, nudged=0.0, states=1.0, varlen=2.0, no_states=None)


@dataclasses.dataclass
class _StandInPipeline:
    """The float32 chunked reference in the kernels' place (``_stand_in_launch``)."""

    problem: object
    plan: ssd.Plan


def _stand_in_launch(pipeline):
    """A transposed walk adds 1e-3 to out; B's hint 7 fails to compile."""
    result = chunked_ssd(pipeline.problem)
    if pipeline.plan.scan_out.out_transposed:
        result = dataclasses.replace(result, out=result.out + 1e-3)
    if pipeline.plan.scan_out.b_latency == 7:
        raise RuntimeError("failed to compile Tile IR program")
    return result


class _CountingTimer:
    def __init__(self, plan):
        pass

    def times(self, fn, reps):
        fn()
        return [2.0] * reps


def test_one_case_end_to_end_with_stand_ins(monkeypatch):
    spec_text = "2,128,8,16,16,2 return_final_states=true"
    case = ab.parse_case(spec_text, 64)
    plan = _plan()
    monkeypatch.setattr(ssd, "stage_pipeline",
                        lambda problem, varlen: _StandInPipeline(problem, plan))
    monkeypatch.setattr(ssd, "launch_stages", _stand_in_launch)
    monkeypatch.setattr(bench, "CudaTimer", _CountingTimer)
    arms = [ab.parse_arm(WALK_ARM), ab.parse_arm("pair scan_out.occupancy=2"),
            ab.parse_arm("broken scan_out.b_latency=7"), ab.parse_arm("s state_scan.p_block=32")]
    record = ab.run_case(case, arms, rounds=2, reps=3, device="cpu")
    found = record["arms"]
    assert list(found) == ["dispatched", "t2", "pair", "broken", "s"]
    assert found["pair"]["bit_equal"] and not found["t2"]["bit_equal"]
    assert 0 < found["t2"]["max_abs_diff"] < 4e-3        # 1e-3 added, out in bf16
    errors = {name: found[name]["error"]["normwise_rel"] for name in ("dispatched", "pair", "t2")}
    assert errors["t2"] > 2 * errors["pair"] and errors["pair"] == errors["dispatched"]
    assert found["pair"]["ms"] == 2.0 and found["pair"]["ratio"] == 1.0
    assert len(found["pair"]["times_ms"]) == 6
    assert found["broken"]["failed"].startswith("RuntimeError: failed to compile")
    assert found["s"]["not_applicable"].startswith("the plan does not launch its state_scan")
    assert record["dispatched"]["scan_out"]["out_transposed"] == "False"
    assert "state_scan" not in record["dispatched"]
    lines = ab.format_record(record)
    assert lines[0] == spec_text and "1.000x" in lines[2] and "failed to compile" in lines[4]
    json.dumps(record)      # the record is JSON as it stands


def test_a_case_from_initial_states_is_held_to_the_float64_out_from_them(monkeypatch):
    case = ab.parse_case("2,128,8,16,16,2 initial_states=true", 64)
    plan = _plan()
    monkeypatch.setattr(ssd, "stage_pipeline",
                        lambda problem, varlen: _StandInPipeline(problem, plan))
    monkeypatch.setattr(ssd, "launch_stages", _stand_in_launch)
    monkeypatch.setattr(bench, "CudaTimer", _CountingTimer)
    record = ab.run_case(case, [ab.parse_arm("pair scan_out.occupancy=2")], rounds=1, reps=1,
                         device="cpu")
    # The stand-in is the reference from the same initial states, its out in bf16: bf16's
    # rounding (~1.7e-3), not the error of an out held to the float64 out without them.
    errors = [record["arms"][name]["error"]["normwise_rel"] for name in ("dispatched", "pair")]
    assert errors[0] == errors[1] < 2.5e-3, errors


def test_a_chunk_size_arm_times_the_call_replanned_on_the_same_tensors(monkeypatch):
    case = ab.parse_case("2,300,8,16,16,2 z=true D=channel", 64)
    plan = _plan()
    planned, modes = [], []

    def stage_pipeline(problem, varlen, precision=None):
        planned.append(problem)
        modes.append(precision)
        return _StandInPipeline(problem, plan)

    monkeypatch.setattr(ssd, "stage_pipeline", stage_pipeline)
    monkeypatch.setattr(ssd, "launch_stages", _stand_in_launch)
    monkeypatch.setattr(bench, "CudaTimer", _CountingTimer)
    arms = [ab.parse_arm("q256 chunk_size=256"), ab.parse_arm("q64 chunk_size=64"),
            ab.parse_arm("p2 precision=2xbf16")]
    record = ab.run_case(case, arms, rounds=1, reps=2, device="cpu")
    # q64 reuses the dispatched plan; p2 is planned anew, in its mode, at the case's size.
    assert [p.chunk_size for p in planned] == [64, 256, 64]
    assert modes == [None, None, "2xbf16"]
    assert planned[1].x is planned[0].x and planned[1].B is planned[0].B
    found = record["arms"]
    assert found["q64"]["bit_equal"] and found["q64"]["changes"] == "chunk_size=64"
    # The stand-in is the chunked reference: another chunk size moves only its roundings (out
    # in bf16: a few of its ulps, out's error against float64 the same to 2 digits).
    errors = {name: found[name]["error"]["normwise_rel"] for name in ("dispatched", "q256")}
    assert not found["q256"]["bit_equal"] and 0 < found["q256"]["max_abs_diff"] < 1e-3
    assert errors["q256"] == pytest.approx(errors["dispatched"], rel=1e-2)


def test_a_chunk_size_arm_compiles_the_plan_made_at_that_size(monkeypatch):
    seen = []
    monkeypatch.setattr(ab, "compiled_kernels", lambda key, plan, target, done: seen.append(
        (key.chunk_size, [name for name, _ in plan.named_configs()])) or {})
    case = ab.parse_case("8,4096,64,64,128,1 x_dtype=fp16 bc_dtype=fp16 z=true D=channel", 64)
    record = ab.compile_case(case, [ab.parse_arm("q256 chunk_size=256")], "sm_90", {})
    assert seen == [(64, ["chunk_cumsum", "chunk_scores", "scan_out"]),
                    (256, ["chunk_cumsum", "chunk_state", "state_passing", "chunk_scores",
                           "compute_out"])]
    assert record["arms"]["q256"]["changes"] == "chunk_size=256"


def test_a_precision_arm_compiles_the_plan_made_in_that_mode(monkeypatch):
    seen = []
    monkeypatch.setattr(ab, "compiled_kernels", lambda key, plan, target, done: seen.append(
        [(name, config.precision) for name, config in plan.named_configs()
         if name in ("scan_out", "compute_out")]) or {})
    case = ab.parse_case("8,4096,64,64,128,1", 64)
    arms = [ab.parse_arm("p2 precision=2xbf16"), ab.parse_arm("p3 precision=3xfp16"),
            ab.parse_arm("c2 precision=2xbf16 chunk_size=256")]
    record = ab.compile_case(case, arms, "sm_90", {})
    assert seen == [[("scan_out", "input")], [("scan_out", "2xbf16")],
                    [("compute_out", "2xbf16")]]
    # fp16's split takes no bf16 x: the arm is recorded as not applicable, naming why.
    assert "expected '3xfp16' only with float16 x" in record["arms"]["p3"]["not_applicable"]


def test_a_dispatch_constants_arm_is_timed_on_the_plan_made_under_them(monkeypatch):
    case = ab.parse_case("2,300,8,16,16,2", 64)
    plan = _plan()
    planned = []

    def stage_pipeline(problem, varlen, precision=None):
        # A stand-in dispatcher that reads one constant: out transposed where it is 1.
        planned.append(ssd.WALK_X_LATENCY)
        transposed = dataclasses.replace(plan.scan_out, out_transposed=True)
        return _StandInPipeline(problem, dataclasses.replace(
            plan, scan_out=transposed if ssd.WALK_X_LATENCY == 1 else plan.scan_out))

    monkeypatch.setattr(ssd, "stage_pipeline", stage_pipeline)
    monkeypatch.setattr(ssd, "launch_stages", _stand_in_launch)
    monkeypatch.setattr(bench, "CudaTimer", _CountingTimer)
    latency = ssd.WALK_X_LATENCY
    arms = [ab.parse_arm("x1 ssd.WALK_X_LATENCY=1"),
            ab.parse_arm(f"same ssd.WALK_X_LATENCY={latency}")]
    record = ab.run_case(case, arms, rounds=1, reps=2, device="cpu")
    assert planned == [latency, 1, latency] and ssd.WALK_X_LATENCY == latency
    found = record["arms"]
    assert not found["x1"]["bit_equal"] and found["x1"]["changes"] == "ssd.WALK_X_LATENCY=1"
    assert found["same"]["not_applicable"] == "its dispatch constants leave the plan as dispatched"
    assert found["x1"]["launches"] == found["dispatched"]["launches"] == [
        "chunk_cumsum", "chunk_scores", "scan_out"]
    assert found["dispatched"]["plan"] == dict(chunk_size=64, walk_segments=plan.walk_segments,
                                               segment_split=plan.segment_split, changed={})
    assert found["x1"]["plan"]["changed"] == {"scan_out": {"out_transposed": "True"}}
    assert ab.format_record(record)[2].endswith(
        f"  Q64, {plan.walk_segments} segments, {plan.segment_split} parts")


def test_a_dispatch_constants_arm_compiles_the_plan_made_under_them(monkeypatch):
    seen = []
    monkeypatch.setattr(ab, "compiled_kernels", lambda key, plan, target, done: seen.append(
        [name for name, _ in plan.named_configs()]) or {})
    # 1 x 65536 x 80 heads (Mamba-2 2.7B at batch 1): too many pairs to split in one round one
    # block an SM, too few to walk unsplit, so two segments paired; the arms undo that rule.
    case = ab.parse_case("1,65536,80,64,128,1", 64)
    arms = [ab.parse_arm("scan ssd.WALK_MIN_PAIRED_SPLIT_ROW_HEADS=1000"),
            ab.parse_arm("w80 ssd.WALK_MIN_PAIRED_SPLIT_ROW_HEADS=1000 "
                         "ssd.WALK_MIN_SPLIT_ROW_HEADS=80"),
            ab.parse_arm("same ssd.WALK_MIN_SPLIT_ROW_HEADS=96")]
    record = ab.compile_case(case, arms, "sm_90", {})
    assert seen == [["chunk_cumsum", "segment_states", "entering_states", "chunk_scores",
                     "scan_out"],
                    ["chunk_cumsum", "state_scan", "chunk_scores", "compute_out"],
                    ["chunk_cumsum", "chunk_scores", "scan_out"]]
    assert record["arms"]["same"]["not_applicable"].startswith("its dispatch constants leave")


def test_a_case_whose_dispatched_plan_fails_says_so(monkeypatch):
    plan = _plan()
    monkeypatch.setattr(ssd, "stage_pipeline", lambda problem, varlen: _StandInPipeline(
        problem, dataclasses.replace(plan, scan_out=dataclasses.replace(plan.scan_out,
                                                                        b_latency=7))))
    monkeypatch.setattr(ssd, "launch_stages", _stand_in_launch)
    record = ab.run_case(ab.parse_case("1,64,4,16,16,1", 64), [ab.parse_arm(WALK_ARM)], 1, 1,
                         device="cpu")
    assert record["failed"].startswith("the dispatched plan: RuntimeError")
    assert "ms" not in record["arms"]["t2"]
    assert "failed: the dispatched plan" in ab.format_record(record)[0]


def _args(tmp_path: Path, **changes) -> argparse.Namespace:
    args = dict(case=["2,128,8,16,16,2"], arm=[WALK_ARM], chunk_size=64, rounds=5, reps=7,
                compile=None, out=tmp_path / "ab.json")
    return argparse.Namespace(**{**args, **changes})


@pytest.mark.parametrize("changes, named", [
    (dict(arm=[WALK_ARM, WALK_ARM]), "--arm: expected distinct names"),
    (dict(rounds=0), "--rounds, --reps"),
    (dict(case=["2,128,8,16,16"]), "--case"),
    (dict(compile="hopper"), "--compile: expected a target such as sm_90, got 'hopper'"),
])
def test_the_command_refuses_bad_options_before_any_gpu_work(tmp_path, capsys, changes, named):
    assert ab.main(_args(tmp_path, **changes)) == 2
    assert named in capsys.readouterr().err


def test_the_command_needs_a_gpu_and_never_overwrites_a_record(tmp_path, capsys, monkeypatch):
    if not torch.cuda.is_available():
        assert ab.main(_args(tmp_path)) == 2
        assert "needs a CUDA device" in capsys.readouterr().err
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "ab.json").write_text("{}")
    assert ab.main(_args(tmp_path)) == 2
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "ab.json").read_text() == "{}"


def test_the_default_record_is_named_after_the_arms_and_the_commit():
    path = ab.default_out([ab.parse_arm(WALK_ARM), ab.parse_arm("pair scan_out.occupancy=2")])
    assert path.parent.name == "experiments" and path.name.startswith("ab_t2_pair_")
    assert path.suffix == ".json"



@pytest.mark.parametrize("changes", [
    dict(x_dtype="fp16", bc_dtype="fp16", return_final_states=True, z=True, D="channel"),
    dict(x_dtype="fp32", dt_bias=True, dt_softplus=True, dt_limit=(0.0, 6.0), D="head",
         initial_states=True),
    dict(batch=1, cu_seqlens=(0, 100, 130, 256), initial_states=True,
         per_sequence_initial_states=True, return_varlen_states=True),
])
def test_the_case_key_is_the_key_of_the_whole_call(changes):
    spec = dataclasses.replace(ab.parse_case("2,256,8,16,32,2", 64).spec, **changes)
    problem = build_problem(spec)
    whole = ssd._key(problem, problem.cu_seqlens is not None and spec.return_varlen_states, None)
    assert ab.case_key(spec) == whole


def test_compile_mode_records_each_plans_kernels_without_a_gpu(tmp_path, capsys):
    # What session 61 found by hand at b1212d5 for the fp16 walk (kernels/ssd.py,
    # WALK_PAIRING_SM90), as one command, at 2 rows, where the dispatcher keeps one block an SM:
    # the compiles are the toolchain's, so only their bookkeeping is pinned.
    args = argparse.Namespace(case=["2,4096,64,64,128,1 x_dtype=fp16 bc_dtype=fp16"],
                              arm=[WALK_ARM, "rows out.row_block=32"], chunk_size=64, rounds=5,
                              reps=7, compile="sm_90", out=tmp_path / "ab.json")
    assert ab.main(args) == 0
    doc = json.loads(args.out.read_text())
    assert doc["compile_target"] == "sm_90"
    (record,) = doc["cases"]
    dispatched, t2 = (record["arms"][name]["kernels"] for name in ("dispatched", "t2"))
    assert list(dispatched) == list(t2) == ["chunk_cumsum", "chunk_scores", "scan_out"]
    for kernel in (*dispatched.values(), *t2.values()):
        assert kernel["ok"] and 0 < kernel["registers"] <= 255 and kernel["shared_bytes"] > 0
    assert dispatched["scan_out"]["tensor_core_mmas"] > 0
    assert t2["chunk_cumsum"] == dispatched["chunk_cumsum"]    # the same config: compiled once
    assert record["arms"]["rows"]["not_applicable"].startswith("the plan does not launch its out")
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:2] == ["t2", "scan_out"]      # the arm's line: what differs
    assert ab.main(args) == 2                            # the record is never overwritten


def test_the_recorded_command_replays_as_it_ran():
    # ab's cases and arms are words with spaces: the provenance quotes them.
    from properties.provenance import collect
    argv = ["mamba2-cutile", "ab", "--case", "8,4096,64,64,128,1 x_dtype=fp16", "--arm", WALK_ARM]
    assert shlex.split(collect(argv)["command"]) == argv


def test_each_arms_record_says_what_it_runs_beside_the_dispatched_plan():
    """``ab.plan_record`` on real plans (CPU): a rule's arm, 80 pairs with final states in two
    segments paired (``ssd.WALK_FOUR_MAX_ROUNDS`` 0) against four alone, records its
    segments, parts and the walk's two changed fields; chunk 256's arm every field of the
    kernels the walk does not launch, and of the cumsum only its chunk size."""
    key = ab.case_key(ab.parse_case("1,16384,80,64,128,1 return_final_states=true", 64).spec)
    four = ssd.make_plan(key)
    with ssd.dispatch_rules({("WALK_FOUR_MAX_ROUNDS", None): 0}):
        two = ssd.make_plan(key)
    assert (four.walk_segments, four.segment_split) == (4, 1)
    dispatched = _StandInPipeline(_Chunked(64), four)
    assert ab.plan_record(dispatched, dispatched) == dict(chunk_size=64, walk_segments=4,
                                                          segment_split=1, changed={})
    assert ab.plan_record(_StandInPipeline(_Chunked(64), two), dispatched) == dict(
        chunk_size=64, walk_segments=2, segment_split=2,
        changed={"scan_out": {"occupancy": "2", "b_latency": "0"}})
    q256 = ssd.make_plan(dataclasses.replace(key, chunk_size=256))
    found = ab.plan_record(_StandInPipeline(_Chunked(256), q256), dispatched)
    assert (found["chunk_size"], found["walk_segments"]) == (256, 1)
    assert found["changed"]["chunk_cumsum"] == {"chunk_size": "256"}
    assert found["changed"]["compute_out"] == {
        name: str(value) for name, value in dataclasses.asdict(
        dict(q256.named_configs())["compute_out"]).items()}


@dataclasses.dataclass
class _Chunked:
    """A problem as plan_record reads one: its chunk size."""

    chunk_size: int
