"""Every validation error of kernels/contract.py, the valid calls it accepts, pack_outputs, and
three things of ssd_forward's calls: outputs where an input requires grad (the kernels have no
backward), the stream its kernels launch on, and what torch.compile makes of it.

Each refusal must be an SSDInputError whose message is "<argument>: expected <what>, got <given>";
the tests check the argument, the expectation and the given value (the 'meta' device stands in for
a second device).
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels import contract
from kernels.contract import SSDInputError, pack_outputs, validate
from properties.problems import ProblemSpec, build_problem

# batch 2, seqlen 10, nheads 4, headdim 3, dstate 5, ngroups 2: every optional tensor present.
DENSE = build_problem(ProblemSpec(batch=2, seqlen=10, nheads=4, headdim=3, dstate=5, ngroups=2,
                                  chunk_size=4, D="head", z=True, dt_bias=True, dt_softplus=True,
                                  initial_states=True)).call_kwargs()
# batch 1 packed: cu_seqlens (0, 3, 7, 10) with seq_idx and per-sequence initial states.
PACKED = build_problem(ProblemSpec(batch=1, seqlen=10, nheads=4, headdim=3, dstate=5, ngroups=2,
                                   chunk_size=4, cu_seqlens=(0, 3, 7, 10), initial_states=True,
                                   per_sequence_initial_states=True,
                                   return_varlen_states=True)).call_kwargs()


def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def refusal(base: dict, **changes) -> str:
    with pytest.raises(SSDInputError) as info:
        validate(**{**base, **changes})
    return str(info.value)


def check(message: str, arg: str, expected: str, given: str):
    assert message.startswith(f"{arg}: expected "), message
    assert expected in message, message
    assert message.endswith(f"got {given}"), message


ACT = "dtype float32, float16 or bfloat16"
D, P = DENSE, PACKED

# (case, base, changes, argument named, expected words, given words)
CASES = [
    ("x_not_tensor", D, dict(x=[[1.0]]), "x", "a torch.Tensor", "list"),
    ("x_3d", D, dict(x=D["x"][..., 0]), "x", "4 dimensions (batch, seqlen, nheads, headdim)",
     "shape (2, 10, 4)"),
    ("x_float64", D, dict(x=f64(D["x"])), "x", ACT, "torch.float64"),
    ("x_int", D, dict(x=D["x"].to(torch.int32)), "x", ACT, "torch.int32"),
    ("x_seqlen_0", D, dict(x=D["x"][:, :0]), "x", "seqlen (dimension 1) >= 1", "seqlen 0"),
    ("x_headdim_0", D, dict(x=D["x"][..., :0]), "x", "batch, nheads and headdim >= 1",
     "shape (2, 10, 4, 0)"),
    ("x_batch_0", D, dict(x=D["x"][:0]), "x", "batch, nheads and headdim >= 1",
     "shape (0, 10, 4, 3)"),

    ("B_not_tensor", D, dict(B=None), "B", "a torch.Tensor", "NoneType"),
    ("B_3d", D, dict(B=D["B"][..., 0]), "B", "shape (2, 10, ngroups, dstate)", "shape (2, 10, 2)"),
    ("B_seqlen", D, dict(B=D["B"][:, :9]), "B", "shape (2, 10, ngroups, dstate)",
     "shape (2, 9, 2, 5)"),
    ("B_batch", D, dict(B=D["B"][:1]), "B", "shape (2, 10, ngroups, dstate)", "shape (1, 10, 2, 5)"),
    ("B_dstate_0", D, dict(B=D["B"][..., :0]), "B", "ngroups and dstate >= 1",
     "shape (2, 10, 2, 0)"),
    ("ngroups_not_dividing_nheads", D, dict(B=torch.zeros(2, 10, 3, 5), C=torch.zeros(2, 10, 3, 5)),
     "B", "ngroups (dimension 2) dividing nheads=4", "ngroups=3"),
    ("B_dtype", D, dict(B=f64(D["B"])), "B", ACT, "torch.float64"),
    ("B_device", D, dict(B=meta(D["B"])), "B", "a tensor on cpu (the device of x)",
     "a tensor on meta"),

    ("C_not_tensor", D, dict(C=1.0), "C", "a torch.Tensor", "float"),
    ("C_dstate", D, dict(C=torch.zeros(2, 10, 2, 6)), "C", "shape (2, 10, 2, 5)",
     "shape (2, 10, 2, 6)"),
    ("C_ngroups", D, dict(C=torch.zeros(2, 10, 1, 5)), "C", "shape (2, 10, 2, 5)",
     "shape (2, 10, 1, 5)"),
    ("C_dtype", D, dict(C=D["C"].to(torch.int64)), "C", ACT, "torch.int64"),
    ("C_device", D, dict(C=meta(D["C"])), "C", "a tensor on cpu", "a tensor on meta"),

    ("dt_shape", D, dict(dt=D["dt"][..., :3]), "dt", "shape (2, 10, 4)", "shape (2, 10, 3)"),
    ("dt_4d", D, dict(dt=D["dt"][..., None]), "dt", "shape (2, 10, 4)", "shape (2, 10, 4, 1)"),
    ("dt_dtype", D, dict(dt=f64(D["dt"])), "dt", ACT, "torch.float64"),
    ("dt_device", D, dict(dt=meta(D["dt"])), "dt", "a tensor on cpu", "a tensor on meta"),
    ("dt_not_tensor", D, dict(dt=0.1), "dt", "a torch.Tensor", "float"),

    ("A_shape", D, dict(A=D["A"][:, None]), "A", "shape (4,)", "shape (4, 1)"),
    ("A_nheads", D, dict(A=D["A"][:3]), "A", "shape (4,)", "shape (3,)"),
    ("A_dtype", D, dict(A=f64(D["A"])), "A", ACT, "torch.float64"),
    ("A_device", D, dict(A=meta(D["A"])), "A", "a tensor on cpu", "a tensor on meta"),

    ("D_not_tensor", D, dict(D=[1.0] * 4), "D", "shape (4,) or (4, 3)", "list"),
    ("D_3d", D, dict(D=torch.zeros(4, 3, 1)), "D", "shape (4,) or (4, 3)", "shape (4, 3, 1)"),
    ("D_head_shape", D, dict(D=torch.zeros(5)), "D", "shape (4,)", "shape (5,)"),
    ("D_channel_shape", D, dict(D=torch.zeros(4, 2)), "D", "shape (4, 3)", "shape (4, 2)"),
    ("D_dtype", D, dict(D=torch.zeros(4, dtype=torch.float64)), "D", ACT, "torch.float64"),
    ("D_device", D, dict(D=torch.zeros(4, device="meta")), "D", "a tensor on cpu",
     "a tensor on meta"),

    ("z_shape", D, dict(z=D["z"][..., :2]), "z", "shape (2, 10, 4, 3)", "shape (2, 10, 4, 2)"),
    ("z_dtype", D, dict(z=f64(D["z"])), "z", ACT, "torch.float64"),
    ("z_device", D, dict(z=meta(D["z"])), "z", "a tensor on cpu", "a tensor on meta"),

    ("dt_bias_shape", D, dict(dt_bias=torch.zeros(2, 4)), "dt_bias", "shape (4,)", "shape (2, 4)"),
    ("dt_bias_dtype", D, dict(dt_bias=f64(D["dt_bias"])), "dt_bias", ACT, "torch.float64"),
    ("dt_bias_device", D, dict(dt_bias=meta(D["dt_bias"])), "dt_bias", "a tensor on cpu",
     "a tensor on meta"),

    ("chunk_size_0", D, dict(chunk_size=0), "chunk_size", "a positive int", "0"),
    ("chunk_size_negative", D, dict(chunk_size=-64), "chunk_size", "a positive int", "-64"),
    ("chunk_size_float", D, dict(chunk_size=64.0), "chunk_size", "a positive int", "64.0"),
    ("chunk_size_bool", D, dict(chunk_size=True), "chunk_size", "a positive int", "True"),
    ("chunk_size_str", D, dict(chunk_size="64"), "chunk_size", "a positive int", "'64'"),
    ("chunk_size_unsupported", D, dict(chunk_size=32, supported_chunk_sizes=(64, 128),
                                       implementation="the cuTile kernel"),
     "chunk_size", "one of (64, 128) (the cuTile kernel)", "32"),

    ("cu_seqlens_not_tensor", P, dict(cu_seqlens=[0, 3, 7, 10]), "cu_seqlens",
     "a 1-D tensor (nseq + 1,) with nseq >= 1", "list"),
    ("cu_seqlens_2d", P, dict(cu_seqlens=P["cu_seqlens"][None]), "cu_seqlens",
     "a 1-D tensor (nseq + 1,)", "shape (1, 4)"),
    ("cu_seqlens_one_offset", P, dict(cu_seqlens=P["cu_seqlens"][:1]), "cu_seqlens",
     "with nseq >= 1", "shape (1,)"),
    ("cu_seqlens_dtype", P, dict(cu_seqlens=P["cu_seqlens"].float()), "cu_seqlens",
     "dtype int32 or int64", "torch.float32"),
    ("cu_seqlens_device", P, dict(cu_seqlens=meta(P["cu_seqlens"])), "cu_seqlens",
     "a tensor on cpu", "a tensor on meta"),
    ("cu_seqlens_batch_2", D, dict(cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
                                   initial_states=None),
     "cu_seqlens", "batch 1 (sequences packed along seqlen)", "batch 2"),
    ("cu_seqlens_not_from_0", P, dict(cu_seqlens=torch.tensor([1, 3, 7, 10]), seq_idx=None),
     "cu_seqlens", "cu_seqlens[0] == 0", "cu_seqlens[0] == 1"),
    ("cu_seqlens_empty_sequence", P, dict(cu_seqlens=torch.tensor([0, 3, 3, 10]), seq_idx=None),
     "cu_seqlens", "strictly increasing offsets (no empty sequence)", "[0, 3, 3, 10]"),
    ("cu_seqlens_decreasing", P, dict(cu_seqlens=torch.tensor([0, 7, 3, 10]), seq_idx=None),
     "cu_seqlens", "strictly increasing offsets", "[0, 7, 3, 10]"),
    ("cu_seqlens_short", P, dict(cu_seqlens=torch.tensor([0, 3, 7, 9]), seq_idx=None),
     "cu_seqlens", "cu_seqlens[-1] == seqlen == 10", "cu_seqlens[-1] == 9"),
    ("cu_seqlens_long", P, dict(cu_seqlens=torch.tensor([0, 3, 7, 11]), seq_idx=None),
     "cu_seqlens", "cu_seqlens[-1] == seqlen == 10", "cu_seqlens[-1] == 11"),

    ("seq_idx_shape", P, dict(seq_idx=P["seq_idx"][:, :9]), "seq_idx", "shape (1, 10)",
     "shape (1, 9)"),
    ("seq_idx_dtype", P, dict(seq_idx=P["seq_idx"].float()), "seq_idx", "dtype int32 or int64",
     "torch.float32"),
    ("seq_idx_device", P, dict(seq_idx=meta(P["seq_idx"])), "seq_idx", "a tensor on cpu",
     "a tensor on meta"),
    ("seq_idx_decreasing", D, dict(seq_idx=torch.tensor([[0] * 5 + [1] * 5, [0, 0, 2, 2, 1] + [3] * 5])),
     "seq_idx", "non-decreasing values along seqlen", "a decreasing step"),
    ("seq_idx_negative", D, dict(seq_idx=torch.tensor([[-1] * 5 + [0] * 5, [0] * 10])),
     "seq_idx", "non-negative values", "a negative value"),
    ("seq_idx_not_cu_seqlens", P, dict(seq_idx=torch.tensor([[0] * 4 + [1] * 3 + [2] * 3])),
     "seq_idx", "the sequence index implied by cu_seqlens", "a different index"),

    ("varlen_states_without_cu_seqlens", D, dict(return_varlen_states=True), "cu_seqlens",
     "a tensor when return_varlen_states=True", "None"),

    ("initial_states_not_tensor", D, dict(initial_states=0.0), "initial_states",
     "shape (2, 4, 3, 5)", "float"),
    ("initial_states_3d", D, dict(initial_states=D["initial_states"][0]), "initial_states",
     "shape (2, 4, 3, 5)", "shape (4, 3, 5)"),
    ("initial_states_lead", D, dict(initial_states=torch.zeros(3, 4, 3, 5)), "initial_states",
     "shape (2, 4, 3, 5)", "shape (3, 4, 3, 5)"),
    ("initial_states_lead_packed", P, dict(initial_states=torch.zeros(2, 4, 3, 5)),
     "initial_states", "shape (1, 4, 3, 5) or, per sequence, (3, 4, 3, 5)", "shape (2, 4, 3, 5)"),
    ("initial_states_dstate", D, dict(initial_states=torch.zeros(2, 4, 3, 6)), "initial_states",
     "shape (2, 4, 3, 5)", "shape (2, 4, 3, 6)"),
    ("initial_states_dtype", D, dict(initial_states=f64(D["initial_states"])), "initial_states",
     "dtype float32, bfloat16 or float16", "torch.float64"),
    ("initial_states_device", D, dict(initial_states=meta(D["initial_states"])), "initial_states",
     "a tensor on cpu", "a tensor on meta"),

    ("dt_limit_scalar", D, dict(dt_limit=0.1), "dt_limit", "a pair (lo, hi)", "0.1"),
    ("dt_limit_triple", D, dict(dt_limit=(0.0, 0.1, 1.0)), "dt_limit", "a pair (lo, hi)",
     "(0.0, 0.1, 1.0)"),
    ("dt_limit_not_numbers", D, dict(dt_limit=("low", "high")), "dt_limit",
     "a pair of numbers (lo, hi)", "('low', 'high')"),
    ("dt_limit_nan", D, dict(dt_limit=(math.nan, 1.0)), "dt_limit", "0 <= lo <= hi (non-NaN)",
     "(nan, 1.0)"),
    ("dt_limit_negative", D, dict(dt_limit=(-0.1, 1.0)), "dt_limit", "0 <= lo <= hi", "(-0.1, 1.0)"),
    ("dt_limit_reversed", D, dict(dt_limit=(0.2, 0.1)), "dt_limit", "0 <= lo <= hi", "(0.2, 0.1)"),
]


@pytest.mark.parametrize("case,base,changes,arg,expected,given", CASES, ids=[c[0] for c in CASES])
def test_refusal_names_argument_expectation_and_given(case, base, changes, arg, expected, given):
    check(refusal(base, **changes), arg, expected, given)


FINITE_CHECKED = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FINITE_CHECKED)
def test_check_finite_names_the_first_non_finite_argument(name, bad):
    tensor = D[name].clone()
    tensor.view(-1)[-1] = bad
    check(refusal(D, check_finite=True, **{name: tensor}), name,
          "finite values (check_finite=True)", "NaN or Inf")
    # Without check_finite the same call is accepted: non-finite values are not scanned (A's
    # sign always is, and +inf is a growth).
    if name == "A" and bad == math.inf:
        check(refusal(D, A=tensor), "A", "values <= 0", "A[3] = inf")
    else:
        validate(**{**D, name: tensor})


def test_check_finite_reports_arguments_in_order():
    bad_x, bad_C = D["x"].clone(), D["C"].clone()
    bad_x[0, 0, 0, 0] = math.nan
    bad_C[0, 0, 0, 0] = math.inf
    check(refusal(D, check_finite=True, x=bad_x, C=bad_C), "x", "finite values", "NaN or Inf")


def test_valid_calls_pass_and_derive_sizes():
    p = validate(**D, check_finite=True, supported_chunk_sizes=(4, 8))
    assert (p.batch, p.seqlen, p.nheads, p.headdim, p.ngroups, p.dstate) == (2, 10, 4, 3, 2, 5)
    assert p.nchunks == 3 and p.nseq is None and p.resolved_seq_idx() is None
    assert not p.per_sequence_initial_states and not p.has_dt_limit

    q = validate(**P, check_finite=True)
    assert q.nseq == 3 and q.per_sequence_initial_states and q.return_varlen_states
    assert q.resolved_seq_idx().tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    # cu_seqlens alone implies the same sequence index.
    assert torch.equal(validate(**{**P, "seq_idx": None}).resolved_seq_idx(), q.resolved_seq_idx())
    # A batch-form initial state is also accepted with cu_seqlens (it starts the row).
    assert not validate(**{**P, "initial_states": P["initial_states"][:1]}).per_sequence_initial_states


@pytest.mark.parametrize("changes", [
    dict(D=torch.zeros(4, 3)),                                       # D per channel
    dict(D=None, z=None, dt_bias=None, initial_states=None),         # every optional absent
    dict(x=D["x"].half(), z=D["z"].bfloat16(), B=D["B"].bfloat16(), C=D["C"].half(),
         dt=D["dt"].bfloat16(), A=D["A"].half(), initial_states=D["initial_states"].half()),
    dict(x=D["x"][:, :1], dt=D["dt"][:, :1], B=D["B"][:, :1], C=D["C"][:, :1], z=D["z"][:, :1]),
    dict(seq_idx=torch.tensor([[0] * 5 + [1] * 5, [2] * 10], dtype=torch.int64)),
    dict(chunk_size=256),                                            # longer than seqlen
], ids=["D_channel", "minimal", "half_precisions", "seqlen_1", "seq_idx_int64", "big_chunk"])
def test_other_valid_calls_pass(changes):
    validate(**{**D, **changes})


def test_dt_limit_is_normalised_to_floats():
    p = validate(**{**D, "dt_limit": [0, 1]})
    assert p.dt_limit == (0.0, 1.0) and isinstance(p.dt_limit, tuple) and p.has_dt_limit
    assert validate(**{**D, "dt_limit": (0.0, math.inf)}).has_dt_limit is False
    assert validate(**{**D, "dt_limit": (0.1, 0.1)}).dt_limit == (0.1, 0.1)


@pytest.mark.parametrize("final,varlen,expected", [
    (False, False, "out"),
    (True, False, ("out", "final")),
    (False, True, ("out", "varlen")),
    (True, True, ("out", "final", "varlen")),
])
def test_pack_outputs_follows_mamba_ssm(final, varlen, expected):
    """mamba_chunk_scan_combined returns out alone, else a tuple (out[, final_states][, varlen])."""
    p = validate(**{**P, "return_final_states": final, "return_varlen_states": varlen})
    assert pack_outputs(p, "out", final_states="final", varlen_states="varlen") == expected


def test_a_growing_decay_is_refused_naming_the_head():
    A = D["A"].clone()
    A[2] = 0.5
    check(refusal(D, A=A), "A", "values <= 0 (exp(dt*A) is a decay)", "A[2] = 0.5")
    # A = 0 (no decay) is inside the contract.
    validate(**{**D, "A": torch.zeros_like(A)})


@pytest.mark.parametrize("changes, arg, expected, given", [
    (dict(A=torch.tensor([-1.0, -0.5, 0.5, -2.0])), "A", "values <= 0 (exp(dt*A) is a decay)",
     "A[2] = 0.5"),
    (dict(seq_idx=torch.tensor([[0] * 5 + [1] * 5, [0, 0, 2, 2, 1] + [3] * 5])), "seq_idx",
     "non-decreasing values along seqlen", "a decreasing step"),
    (dict(seq_idx=torch.tensor([[-1] * 5 + [0] * 5, [0] * 10])), "seq_idx",
     "non-negative values", "a negative value"),
    *[(dict(base="packed", **changes), arg, expected, given)
      for case, _, changes, arg, expected, given in CASES
      if case.startswith(("cu_seqlens_not_from_0", "cu_seqlens_empty", "cu_seqlens_decreasing",
                          "cu_seqlens_short", "cu_seqlens_long", "seq_idx_not_cu_seqlens"))]],
    ids=["A", "seq_idx_decreasing", "seq_idx_negative", "cu_seqlens_not_from_0",
         "cu_seqlens_empty_sequence", "cu_seqlens_decreasing", "cu_seqlens_short",
         "cu_seqlens_long", "seq_idx_not_cu_seqlens"])
def test_a_deferred_value_check_raises_at_confirmation_with_the_same_message(changes, arg,
                                                                           expected, given):
    """ssd_forward queues the kernels before reading the A verdict, seq_idx's and cu_seqlens'
    values: validation passes, and confirm_values (called before any output is returned)
    raises what validate would have."""
    assert D["A"].shape == (4,)
    changes = dict(changes)
    base = P if changes.pop("base", None) == "packed" else D
    check(refusal(base, **changes), arg, expected, given)
    problem = validate(**{**base, **changes}, defer_value_checks=True)
    with pytest.raises(SSDInputError) as info:
        problem.confirm_values()
    check(str(info.value), arg, expected, given)
    validate(**D, defer_value_checks=True).confirm_values()
    validate(**P, defer_value_checks=True).confirm_values()


def test_under_graph_capture_nothing_is_read_back_and_value_checks_are_refused(monkeypatch):
    """During CUDA graph capture (kernels.contract.capturing, here stood in for on the CPU) the A
    verdict is not taken (the kernels make a growing head NaN; tests/test_kernels_gpu.py checks
    that on the GPU), and seq_idx, cu_seqlens and check_finite, whose values the host reads,
    are refused naming the argument, before any of them is read."""
    monkeypatch.setattr(contract, "capturing", lambda t: True)
    A = D["A"].clone()
    A[2] = 0.5
    validate(**{**D, "A": A}, defer_value_checks=True).confirm_values()
    validate(**{**D, "A": A})
    during = "during CUDA graph capture"
    check(refusal(P), "seq_idx", during, "a tensor")
    check(refusal(P, seq_idx=None), "cu_seqlens", during, "a tensor")
    check(refusal(D, check_finite=True), "check_finite", during, "True")
    monkeypatch.setattr(contract, "capturing", lambda t: False)
    check(refusal(D, A=A), "A", "values <= 0 (exp(dt*A) is a decay)", "A[2] = 0.5")


def test_a_negative_step_without_softplus_or_limit_is_refused_by_the_scan_only():
    plain = {**D, "dt_softplus": False, "dt_bias": None}
    dt = plain["dt"].abs()
    dt[1, 3, 2] = -0.25
    check(refusal(plain, dt=dt, check_finite=True), "dt",
          "dt + dt_bias >= 0 without dt_softplus or dt_limit", "a step of -0.25")
    validate(**{**plain, "dt": dt})                         # not scanned by default
    validate(**{**plain, "dt": dt, "dt_limit": (0.0, 1.0)}, check_finite=True)  # clamped
    validate(**{**plain, "dt": dt, "dt_softplus": True}, check_finite=True)   # softplus > 0


def test_a_signed_call_that_passed_skips_the_checks_and_any_change_is_checked(monkeypatch):
    """validate remembers the signatures of calls that passed (kernels.contract.call_signature:
    shapes, strides, dtypes, devices and options, no values); a call equal in all of them skips
    the checks, and one that differs in any of them is checked again."""
    from kernels import contract
    checked = []
    real = contract._check_call
    monkeypatch.setattr(contract, "_check_call", lambda *a: (checked.append(1), real(*a)))
    monkeypatch.setattr(contract, "_PASSED", set())
    first = validate(**D)
    assert first.signature is not None and len(checked) == 1

    def leaves(item):
        return [v for i in item for v in leaves(i)] if isinstance(item, tuple) else [item]
    # Remembered signatures must not keep a caller's tensors (or their memory) alive.
    assert not any(isinstance(v, torch.Tensor) for v in leaves(first.signature))
    again = validate(**{**D, "x": D["x"].clone()})         # other values, same signature
    assert again.signature == first.signature and len(checked) == 1
    assert again == first.with_tensors(x=again.x) and again.x is not first.x
    check(refusal(D, B=D["B"].to(torch.int32)), "B", ACT, "torch.int32")
    check(refusal(D, dt_limit=(0.2, 0.1)), "dt_limit", "0 <= lo <= hi", "(0.2, 0.1)")
    check(refusal(D, chunk_size=True), "chunk_size", "a positive int", "True")
    # Another layout of the same values is a new signature: checked, then passed.
    validate(**{**D, "x": D["x"].transpose(1, 2).contiguous().transpose(1, 2)})
    assert len(checked) == 5
    # A's values are read on every call, signed or not.
    A = D["A"].clone()
    A[1] = 0.25
    check(refusal(D, A=A), "A", "values <= 0", "A[1] = 0.25")


def test_calls_whose_validation_reads_values_are_never_signed():
    """seq_idx's and cu_seqlens' values, and with check_finite every input's, are checked on
    every call: a decreasing seq_idx is refused after a valid one of the same layout."""
    assert validate(**P).signature is None
    assert validate(**D, check_finite=True).signature is None
    seq_idx = torch.tensor([[0] * 5 + [1] * 5, [2] * 10], dtype=torch.int64)
    assert validate(**{**D, "seq_idx": seq_idx}).signature is None
    check(refusal(D, seq_idx=seq_idx.flip(1)), "seq_idx", "non-decreasing values along seqlen",
          "a decreasing step")
    # An option that is not a plain value leaves the call unsigned, not refused.
    assert validate(**{**D, "dt_limit": (torch.tensor(0.0), 1.0)}).signature is None
    assert validate(**D).with_tensors(x=D["x"].double()).signature is None


def test_a_packed_call_whose_values_are_deferred_is_signed_and_checked_at_every_call(
        monkeypatch):
    """ssd_forward's validation (defer_value_checks) leaves seq_idx's and cu_seqlens' values to
    ValueChecks, which read them on every call: such a call is signed (their layout in its
    signature), a second one of that layout skips the checks that read no values, and bad
    values of that layout are still refused, at confirm_values. More offsets than seqlen + 1
    are read at once (validate's message)."""
    checked = []
    real = contract._check_call
    monkeypatch.setattr(contract, "_check_call", lambda *a: (checked.append(1), real(*a)))
    monkeypatch.setattr(contract, "_PASSED", set())
    seq_idx = torch.tensor([[0] * 5 + [1] * 5, [2] * 10], dtype=torch.int64)
    first = validate(**{**D, "seq_idx": seq_idx}, defer_value_checks=True)
    first.confirm_values()
    assert first.signature is not None and len(checked) == 1
    assert validate(**D, defer_value_checks=True).signature != first.signature
    assert validate(**{**D, "seq_idx": seq_idx.to(torch.int32)},
                    defer_value_checks=True).signature != first.signature
    assert len(checked) == 3
    for given, word in ((seq_idx.flip(1), "a decreasing step"), (seq_idx - 1, "a negative value")):
        again = validate(**{**D, "seq_idx": given}, defer_value_checks=True)
        assert again.signature == first.signature and len(checked) == 3
        with pytest.raises(SSDInputError) as info:
            again.confirm_values()
        check(str(info.value), "seq_idx", "non-decreasing values along seqlen"
              if word == "a decreasing step" else "non-negative values", word)
    packed = validate(**P, defer_value_checks=True)
    packed.confirm_values()
    assert packed.signature is not None and len(checked) == 4
    other = torch.tensor([0, 2, 5, 10], dtype=P["cu_seqlens"].dtype)
    again = validate(**{**P, "cu_seqlens": other, "seq_idx": None}, defer_value_checks=True)
    assert len(checked) == 5            # seq_idx None: another signature
    again = validate(**{**P, "cu_seqlens": other, "seq_idx": None}, defer_value_checks=True)
    again.confirm_values()
    assert len(checked) == 5 and again.cu_seqlens.tolist() == other.tolist()
    bad = validate(**{**P, "cu_seqlens": torch.tensor([0, 3, 3, 10], dtype=other.dtype)},
                   defer_value_checks=True)
    assert bad.signature == packed.signature and len(checked) == 5
    with pytest.raises(SSDInputError) as info:
        bad.confirm_values()
    check(str(info.value), "cu_seqlens", "strictly increasing offsets", "[0, 3, 3, 10]")
    many = torch.arange(12)
    with pytest.raises(SSDInputError) as info:
        validate(**{**P, "cu_seqlens": many, "seq_idx": None, "initial_states": None},
                 defer_value_checks=True)
    check(str(info.value), "cu_seqlens", "cu_seqlens[-1] == seqlen == 10", "cu_seqlens[-1] == 11")


@pytest.mark.parametrize("offsets, seq_idx", [
    ((0, 3, 7, 10), None), ((0, 3, 7, 10), [0] * 3 + [1] * 4 + [2] * 3),
    ((0, 7, 3, 10), None), ((0, 3, 3, 10), None), ((4, 3, 7, 10), [0] * 10),
    ((0, 3, 7, 99), None), ((-5, -1, 7, 10), [0] * 3 + [1] * 4 + [2] * 3),
    ((0, 3, 7, 10), [0] * 4 + [1] * 3 + [2] * 3), ((0, 3, 7, 10), [5] * 10)],
    ids=["valid", "valid_with_seq_idx", "decreasing", "empty", "not_from_0", "past_the_end",
         "negative", "seq_idx_disagrees", "seq_idx_past_nseq"])
def test_deferred_packed_values_reach_the_kernels_only_as_valid_indices(offsets, seq_idx):
    """Where ssd_forward defers the packed values' checks (``PackedIndex``), the kernels read the
    caller's offsets and seq_idx where they pass and otherwise stand-ins that pass (0, 1, 2,
    seqlen), so that no kernel indexes past a tensor before confirm_values refuses the call; the
    verdict on the device is the host's."""
    cu = torch.tensor(offsets, dtype=torch.int32)
    given = None if seq_idx is None else torch.tensor([seq_idx], dtype=torch.int64)
    problem = validate(**{**P, "cu_seqlens": cu, "seq_idx": given}, defer_value_checks=True)
    try:
        contract._check_packed_values(given, cu, 10)
        passes = True
    except SSDInputError:
        passes = False
    index = problem.value_checks.packed
    assert bool(index.verdict) == passes
    assert problem.cu_seqlens.tolist() == (list(offsets) if passes else [0, 1, 2, 10])
    assert problem.cu_seqlens.dtype == cu.dtype
    kernel_seq = problem.resolved_seq_idx()
    lengths = torch.tensor(problem.cu_seqlens.tolist()).diff()
    assert kernel_seq.tolist() == [torch.arange(3).repeat_interleave(lengths).tolist()]
    if given is not None:
        assert problem.seq_idx.dtype == given.dtype
    if not passes:
        with pytest.raises(SSDInputError):
            problem.confirm_values()


def test_deferred_offsets_of_any_strides_pass_without_a_warning():
    """cu_seqlens as a strided view (every other offset of a longer tensor) passes the deferred
    verdict as its copy does, without torch's warning about searching a non-contiguous tensor."""
    import warnings
    strided = torch.tensor([0, 9, 3, 9, 7, 9, 10, 9], dtype=P["cu_seqlens"].dtype)[::2]
    assert not strided.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        problem = validate(**{**P, "cu_seqlens": strided}, defer_value_checks=True)
        problem.confirm_values()
    assert problem.cu_seqlens.tolist() == [0, 3, 7, 10]
    assert problem.seq_idx.tolist() == P["seq_idx"].tolist()


@pytest.mark.parametrize("spec, packing", [
    (dict(batch=2, seqlen=256, nheads=32, x_dtype="bf16", bc_dtype="bf16"), "seq_idx"),
    (dict(batch=1, seqlen=256, nheads=64, x_dtype="bf16", bc_dtype="bf16"), "cu_seqlens"),
    (dict(batch=1, seqlen=256, nheads=4, initial_states=True, return_varlen_states=True),
     "cu_seqlens")], ids=["seq_idx_walk", "cu_seqlens_walk", "cu_seqlens_varlen"])
def test_a_packed_call_seen_before_launches_its_own_sequences(monkeypatch, spec, packing):
    """ssd_forward remembers a packed call's plan by its signature (kernels.ssd._PREPARED), never
    its tensors: a second call of the same layout skips the planning and launches the same
    kernels on its own sequences (seq_idx alone, or cu_seqlens: the walk, and chunk 256's state
    kernels with per-sequence initial states and varlen states). CPU tensors, ct.launch and the
    stream stood in for."""
    import cuda.tile as ct
    from kernels import ssd
    launches = []
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    monkeypatch.setattr(ssd, "_PREPARED", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args:
                        launches.append((grid, kernel, args)))
    planned = []
    real = ssd.stage_pipeline
    monkeypatch.setattr(ssd, "stage_pipeline",
                        lambda *a, **k: (planned.append(1), real(*a, **k))[1])
    batch, seqlen = spec["batch"], spec["seqlen"]
    cuts = ((0, 100, 180, seqlen), (0, 30, 200, seqlen))     # one layout: as many offsets
    per_seq = spec.get("initial_states", False)
    call = build_problem(ProblemSpec(headdim=64, dstate=128, chunk_size=64,
                                     cu_seqlens=cuts[0] if per_seq else None,
                                     per_sequence_initial_states=per_seq,
                                     **spec)).call_kwargs()
    runs = []
    for offsets in cuts:
        index = torch.zeros(batch, seqlen, dtype=torch.int32)
        for start in offsets[1:-1]:
            index[:, start:] += 1
        given = dict(seq_idx=index) if packing == "seq_idx" else dict(
            seq_idx=None, cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
        if per_seq:
            given["initial_states"] = call["initial_states"][:1].expand(
                len(offsets) - 1, *call["initial_states"].shape[1:]).contiguous()
        launches.clear()
        ssd.ssd_forward(**{**call, **given, "chunk_size": None})
        indices = [[torch.equal(arg, index) for arg in args
                    if isinstance(arg, torch.Tensor) and arg.shape == index.shape
                    and not arg.is_floating_point()] for _, _, args in launches]
        runs.append(([(grid, kernel) for grid, kernel, _ in launches], indices))
    assert len(planned) == 1
    (kernels, indices), (kernels_again, indices_again) = runs
    assert kernels == kernels_again and any(map(any, indices)) and indices == indices_again


@pytest.mark.parametrize("graded", [("x",), ("A", "D", "dt_bias", "initial_states")])
def test_a_backward_through_ssd_forward_raises_naming_the_inputs_that_require_grad(monkeypatch,
                                                                                  graded):
    """The kernels have no backward. Where grad mode is on and an input requires grad, every
    output of ssd_forward carries a backward that raises naming those inputs: without it their
    gradients would be silently missing while the rest of a model trains. Under no_grad, or with
    no such input, the outputs carry none, and the same kernels launch in all three calls, on
    tensors that do not require grad. CPU tensors, ct.launch and the stream stood in for."""
    import cuda.tile as ct
    from kernels import ssd
    launches = []
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    monkeypatch.setattr(ssd, "_PREPARED", {})
    problem = build_problem(ProblemSpec(batch=2, seqlen=100, nheads=4, headdim=16, dstate=32,
                                        ngroups=2, chunk_size=64, D="channel", dt_bias=True,
                                        dt_softplus=True, initial_states=True,
                                        return_final_states=True))
    call = problem.call_kwargs()
    with_grad = {**call, **{name: call[name].detach().clone().requires_grad_()
                            for name in graded}}

    def record(stream, grid, kernel, args):
        # Every array a kernel gets must not require grad as it launches (cuTile may read it
        # through __cuda_array_interface__, which torch refuses for one that does).
        launches.append((grid, kernel, any(isinstance(arg, torch.Tensor) and arg.requires_grad
                                           for arg in args)))

    monkeypatch.setattr(ct, "launch", record)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)

    def run(kwargs):
        launches.clear()
        outs = ssd.ssd_forward(**kwargs)
        assert not any(graded_arg for _, _, graded_arg in launches)
        return outs, [(grid, kernel) for grid, kernel, _ in launches]

    (out, states), launched = run(with_grad)
    assert out.requires_grad and states.requires_grad
    for output in (out, states):
        with pytest.raises(NotImplementedError) as info:
            output.float().sum().backward()
        assert str(info.value).startswith(
            f"ssd_forward: expected no backward through its outputs (the cuTile kernels are "
            f"forward-only), got one for {', '.join(graded)}, which require grad")
    assert all(with_grad[name].grad is None for name in graded)
    with torch.no_grad():
        (out_no_grad, states_no_grad), launched_no_grad = run(with_grad)
    (out_plain, states_plain), launched_plain = run(call)
    for output in (out_no_grad, states_no_grad, out_plain, states_plain):
        assert output.grad_fn is None and not output.requires_grad
    assert launched == launched_no_grad == launched_plain and launched
    launches.clear()          # the stages' entry point reads them detached too
    ssd.ssd_forward_stages(problem.with_tensors(**{name: with_grad[name] for name in graded}))
    assert launches and not any(graded_arg for _, _, graded_arg in launches)


@pytest.mark.parametrize("spec", [
    dict(batch=8, seqlen=256, nheads=32, headdim=64, dstate=128, x_dtype="bf16", bc_dtype="bf16"),
    dict(batch=1, seqlen=16448, nheads=48, headdim=64, dstate=128, x_dtype="bf16",
         bc_dtype="bf16"),
    dict(batch=2, seqlen=300, nheads=4, headdim=32, dstate=16, D="channel", z=True,
         return_final_states=True)], ids=["walk", "split_walk", "state_kernels"])
def test_every_launch_goes_to_the_current_stream_of_the_inputs_device(monkeypatch, spec):
    """Not the current device's stream: cuTile launches in the stream's context, so with the
    inputs on another GPU the kernels would read them from there, unordered with the work that
    wrote them. Each path of the dispatcher (the walk, split, and chunk 256's state kernels),
    and a kernel's wrapper called without a stream. CPU tensors, ct.launch and the streams
    stood in for."""
    import cuda.tile as ct
    from kernels import ssd
    from kernels.chunk_cumsum import chunk_cumsum
    streams = []
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    monkeypatch.setattr(ssd, "_PREPARED", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args: streams.append(stream))
    call = build_problem(ProblemSpec(chunk_size=64, **spec)).call_kwargs()
    ssd.ssd_forward(**{**call, "chunk_size": None})
    plan = ssd.stage_pipeline(build_problem(ProblemSpec(chunk_size=64, **spec))).plan
    chunk_cumsum(call["dt"], call["A"], plan.cumsum)
    assert len(streams) >= 3 and set(streams) == {("stream of", call["x"].device)}


def test_torch_compile_runs_ssd_forward_as_it_runs_eagerly(monkeypatch):
    """A compiled layer that calls ssd_forward: dynamo captures the layer's own op (one graph,
    one op), not ssd_forward's host code (without torch.compiler.disable it traced 15 ops into
    7 graphs, through lru_caches it warns it may get wrong), and the compiled layer launches
    the kernels the eager one does. CPU tensors, ct.launch and the stream stood in for."""
    import warnings

    import cuda.tile as ct
    from kernels import ssd
    launches = []
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args:
                        launches.append((grid, kernel)))
    call = build_problem(ProblemSpec(batch=2, seqlen=100, nheads=4, headdim=16, dstate=32,
                                     ngroups=2, chunk_size=64, D="channel", dt_bias=True,
                                     dt_softplus=True)).call_kwargs()
    args = [call[name] for name in ("x", "dt", "A", "B", "C", "D", "dt_bias")]

    def layer(x, dt, A, B, C, D, dt_bias):
        return ssd.ssd_forward(x, dt, A, B, C, None, D, None, dt_bias, dt_softplus=True) * 2

    layer(*args)
    eager = list(launches)
    with warnings.catch_warnings():          # torch's own deprecations, from inside dynamo
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(*args)
        torch._dynamo.reset()
        launches.clear()
        torch.compile(layer)(*args)
    assert (explained.graph_count, explained.op_count) == (1, 1)
    assert launches == eager and eager
