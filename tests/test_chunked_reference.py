"""The chunked reference: float64 against the sequential oracle (every stage), float32's error.

Figures are normwise relative errors ||got - ref||_F / ||ref||_F.
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels.contract import SSDInputError, validate
from oracles.chunked_reference import chunked_ssd, ssd_reference
from oracles.common import LOG2_E, chunk_boundaries
from oracles.sequential import sequential_ssd
from properties.problems import ProblemSpec, build_problem
from properties.regimes import REGIMES

# float64 against float64, the same sums in another order: the difference is a few hundred u64
# (u64 = 1.1e-16) at most, far below 1e-10. A chunking or reset mistake is O(1).
FLOAT64_TOL = 1e-10
U32 = 2.0 ** -24
U_BF16 = 2.0 ** -8

# Packed sequences over seqlen 601: starts at 63 = 9*7, 64, 256 = 4*64 and 448 = 64*7 fall exactly
# on chunk boundaries of Q = 7, 64, 256; the others (3, 130, 259) fall inside a chunk. Lengths 3,
# 60, 1, 66, 126, 3, 189, 153: three shorter than a chunk of 7, four than 64, all than 256 (whose
# first chunk then holds five sequences).
PACKED = (0, 3, 63, 64, 130, 256, 259, 448, 601)


def regime_dtype_and_limit(regime: str, x_dtype: str = "fp32") -> dict:
    """The x/B/C dtype a regime is meant for (x_dtype when it names none) and its dt_limit."""
    r = REGIMES[regime]
    dtype = x_dtype if not r.x_dtypes or x_dtype in r.x_dtypes else r.x_dtypes[0]
    return dict(x_dtype=dtype, bc_dtype=dtype, dt_limit=r.dt_limit)


def normwise(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm())


def chunked_float64(problem, chunk_size, positions=None):
    """The float64 stand-in, storing states and out in float64 too."""
    return chunked_ssd(problem, state_dtype=torch.float64, out_dtype=torch.float64,
                       chunk_size=chunk_size, positions=positions)


def assert_matches_sequential(problem, chunk_size):
    ref = sequential_ssd(problem, positions=chunk_boundaries(problem, chunk_size))
    got = chunked_float64(problem, chunk_size)
    errors = {"out": normwise(got.out, ref.out),
              "final_states": normwise(got.final_states, ref.final_states),
              "chunk_states": normwise(got.stages["chunk_states"], ref.states)}
    if problem.cu_seqlens is not None:
        errors["varlen_states"] = normwise(got.varlen_states, ref.varlen_states)
    assert all(e <= FLOAT64_TOL for e in errors.values()), errors


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 256])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_float64_matches_sequential_across_regimes(regime, chunk_size):
    # seqlen 300 is a multiple of none of the chunk sizes but 1; ngroups 2 of 4 heads. Inputs in
    # the regime's own dtype where it names one (fp16 for the fp16 range regimes).
    spec = ProblemSpec(batch=2, seqlen=300, nheads=4, headdim=8, dstate=8, ngroups=2,
                       chunk_size=chunk_size, regime=regime, D="head", z=True, dt_bias=True,
                       dt_softplus=True, initial_states=True, **regime_dtype_and_limit(regime))
    assert_matches_sequential(build_problem(spec), chunk_size)


@pytest.mark.parametrize("chunk_size", [7, 64])
@pytest.mark.parametrize("features", [
    dict(D="channel", ngroups=4),
    dict(D="head", z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.01, 0.05)),
    dict(dt_limit=(0.0, 0.02), initial_states=True, regime="large_initial_state"),
    dict(regime="softplus_edge", dt_bias=True, dt_softplus=True, dt_limit=(0.0, 21.0)),
], ids=["D_channel_groups", "bias_softplus_limit", "limit_initial_state", "softplus_edge"])
def test_float64_matches_sequential_with_features(features, chunk_size):
    spec = ProblemSpec(batch=3, seqlen=150, nheads=4, headdim=6, dstate=5, chunk_size=chunk_size,
                       **features)
    assert_matches_sequential(build_problem(spec), chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 256])
@pytest.mark.parametrize("packing", ["cu_seqlens", "cu_seqlens_and_seq_idx", "per_sequence_init"])
def test_float64_matches_sequential_packed(packing, chunk_size):
    starts = PACKED[1:-1]
    if chunk_size > 1:   # the recipe really has starts on and off chunk boundaries
        assert any(s % chunk_size == 0 for s in starts) and any(s % chunk_size for s in starts)
    spec = ProblemSpec(seqlen=PACKED[-1], nheads=4, headdim=8, dstate=8, ngroups=2,
                       chunk_size=chunk_size, D="head", z=True, cu_seqlens=PACKED,
                       pass_seq_idx=packing != "cu_seqlens", return_varlen_states=True,
                       initial_states=packing == "per_sequence_init",
                       per_sequence_initial_states=packing == "per_sequence_init",
                       regime="large_initial_state" if packing == "per_sequence_init"
                       else "mamba2_init")
    problem = build_problem(spec)
    assert problem.per_sequence_initial_states == (packing == "per_sequence_init")
    assert_matches_sequential(problem, chunk_size)


def test_float64_matches_sequential_seq_idx_per_row():
    # seq_idx alone, batch 2, different resets per row and ids not starting at 0; batch-form
    # initial states start each row, sequences starting mid-row start from zeros.
    spec = ProblemSpec(batch=2, seqlen=90, nheads=2, headdim=4, dstate=4, chunk_size=16,
                       initial_states=True, D="head")
    base = build_problem(spec)
    seq_idx = torch.zeros(2, 90, dtype=torch.int64)
    seq_idx[0, 10:] = 1
    seq_idx[0, 32:] = 2     # 32 = 2 * 16, on a boundary
    seq_idx[0, 33:] = 3     # length 1
    seq_idx[1] += 5
    seq_idx[1, 47:] = 6
    problem = validate(**{**base.call_kwargs(), "seq_idx": seq_idx})
    assert_matches_sequential(problem, 16)


def test_states_at_positions_match_sequential():
    spec = ProblemSpec(seqlen=PACKED[-1], nheads=2, headdim=4, dstate=4, chunk_size=64,
                       cu_seqlens=PACKED, initial_states=True, per_sequence_initial_states=True)
    problem = build_problem(spec)
    positions = [0, 1, 3, 4, 63, 64, 65, 130, 200, 256, 600, 601]
    got = chunked_float64(problem, 64, positions=positions)
    ref = sequential_ssd(problem, positions=positions)
    assert normwise(got.states, ref.states) <= FLOAT64_TOL


def softplus_condition(v: torch.Tensor) -> torch.Tensor:
    """Relative condition number of softplus at v: v * sigmoid(v) / softplus(v) (-> |v| for v
    -> -inf, -> 1 for v -> +inf)."""
    return (v * torch.sigmoid(v) / torch.log1p(torch.exp(v))).abs()


@pytest.mark.parametrize("compute_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("regime", ["mamba2_init", "strong_decay", "softplus_edge",
                                    "dt_limit_bounds"])
def test_stage_log2_decay_cumsum(regime, compute_dtype):
    """dt and log2_decay_cumsum against an independent float64 derivation, elementwise.

    Bounds (u = the compute dtype's unit roundoff, v = dt + dt_bias): the bias sum rounds v by
    u|v|, which softplus amplifies by its condition number k(v), plus a few u for softplus itself,
    so |dt - dt64| <= (k(v) + 4) u dt64 (clamping is exact). The log2 step a = dt * (A * log2e)
    adds 2 roundings, and the inclusive cumsum at local index i adds i additions (recursive
    summation: <= i u sum|a_j|); all a_j share a sign, so sum|a_j| = |S_i|. Twice the sum
    covers the float64 reference's own rounding when the compute dtype is float64 too.
    """
    Q = 64
    spec = ProblemSpec(batch=2, seqlen=150, nheads=4, headdim=4, dstate=4, chunk_size=Q,
                       regime=regime, dt_bias=True, dt_softplus=True,
                       dt_limit=REGIMES[regime].dt_limit or (0.0, 3.0))
    problem = build_problem(spec)
    stages = chunked_ssd(problem, compute_dtype=compute_dtype).stages
    u = torch.finfo(compute_dtype).eps / 2
    v = problem.dt.double() + problem.dt_bias.double()
    dt64 = torch.log1p(torch.exp(v)).clamp(*problem.dt_limit)
    step_error = (softplus_condition(v) + 4) * u * dt64                       # (b, L, H)
    log2_step = dt64 * problem.A.double() * LOG2_E

    b, L, H = dt64.shape
    pad = Q * problem.nchunks - L
    chunked = lambda t: torch.cat([t, t.new_zeros(b, pad, H)], 1).view(b, -1, Q, H)  # noqa: E731
    dt = stages["dt"].double()                                                # (b, H, c, Q)
    assert dt.shape == (b, H, problem.nchunks, Q)
    assert bool((dt.flatten(2)[..., L:] == 0).all())
    assert bool(((dt - chunked(dt64).permute(0, 3, 1, 2)).abs()
                 <= 2 * chunked(step_error).permute(0, 3, 1, 2)).all())

    S = stages["log2_decay_cumsum"].double()
    S64 = chunked(log2_step).cumsum(2).permute(0, 3, 1, 2)
    step_bound = (chunked(step_error * problem.A.double().abs() * LOG2_E).cumsum(2)
                  .permute(0, 3, 1, 2))
    index = torch.arange(Q, dtype=torch.float64)
    bound = 2 * ((index + 2) * u * S64.abs() + step_bound)
    assert bool(((S - S64).abs() <= bound).all()), float(((S - S64).abs() / bound).max())
    flat = S.flatten(2)
    assert bool((flat[..., L:] == flat[..., L - 1:L]).all())   # flat past seqlen


# Float32 compute, the baseline of the error rules, against the float64 reference (which matches
# the sequential oracle to 1e-10, above; u32 = 2^-24):
#   arithmetic (out kept in fp32, final and chunk states): <= 32 u32 + sqrt(Q + N) 2^-150 / rms.
#     Each entry is a sum of up to Q + N = 320 products of mixed sign, each with an exp2 weight
#     whose exponent carries the rounded cumsum's error (about |S| u32, damped by the decay where
#     |S| is large); a random-walk model of the roundings gives about sqrt(Q + N) = 18 u32.
#     Measured on these problems: out 2.8-13.2, final_states 0.9-6.9, chunk_states 0-18 u32
#     (largest: large_magnitude, whose states are all input contributions); 32 u32 is
#     1.8 sqrt(Q + N). Where outputs are fp32 subnormals (fp32_subnormal: rms 7e-40) the products
#     underflow and each rounding errs by up to 2^-150 absolutely, whatever the value: the second
#     term (random walk again, relative to the output's rms). Measured there: 93 u32 = 5.5e-6,
#     bound 556 u32 = 3.3e-5 (rounding float64's out to fp32 alone costs 17 u32 there).
#   out rounded to x's dtype: <= (rounding float64's out to x's dtype) + 2 * arithmetic. Entrywise,
#     |round(y32) - y| <= |round(y32) - y32| + |y32 - y| <= |round(y) - y32| + |y32 - y| (round
#     is to nearest) <= |round(y) - y| + 2 |y32 - y|; the triangle inequality carries it to the
#     norm. So float32 compute costs at most 64 u32 (0.001 u_bf16) beyond the output dtype's own
#     rounding, which is about 0.42 u_out: measured 0.42-0.49 u_bf16 with an excess < 0.01 u32 for
#     bf16 outputs; for fp32 outputs the arithmetic dominates (excess 2.3-12.8 u32).
# D is left out: D * x would swamp the outputs the range regimes place at a dtype's limits.
ARITHMETIC_ULPS = 32


def float32_arithmetic_bound(reference_out: torch.Tensor, chunk_size: int, dstate: int) -> float:
    rms = float(reference_out.double().pow(2).mean().sqrt())
    return ARITHMETIC_ULPS * U32 + math.sqrt(chunk_size + dstate) * 2.0 ** -150 / rms


@pytest.mark.parametrize("x_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("regime", sorted(r.name for r in REGIMES.values()
                                          if not r.x_dtypes or "fp32" in r.x_dtypes))
def test_float32_compute_error(regime, x_dtype):
    spec = ProblemSpec(seqlen=1100, nheads=4, headdim=32, dstate=64, ngroups=2, chunk_size=256,
                       regime=regime, z=True, dt_bias=True, dt_softplus=True, initial_states=True,
                       **regime_dtype_and_limit(regime, x_dtype))
    problem = build_problem(spec)
    assert problem.x.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[x_dtype]
    ref = chunked_float64(problem, 256)
    rounded = chunked_ssd(problem, compute_dtype=torch.float32)
    unrounded = chunked_ssd(problem, compute_dtype=torch.float32, out_dtype=torch.float32)
    assert rounded.stages["chunk_states"].dtype == torch.float32
    assert torch.equal(rounded.out, unrounded.out.to(problem.x.dtype))   # rounded at the very end
    arithmetic = float32_arithmetic_bound(ref.out, 256, 64)
    errors = {"out_fp32": normwise(unrounded.out, ref.out),
              "final_states": normwise(rounded.final_states, ref.final_states),
              "chunk_states": normwise(rounded.stages["chunk_states"], ref.stages["chunk_states"])}
    assert errors["out_fp32"] <= arithmetic, errors
    assert max(errors["final_states"], errors["chunk_states"]) <= ARITHMETIC_ULPS * U32, errors
    output_rounding = normwise(ref.out.to(problem.x.dtype), ref.out)
    assert normwise(rounded.out, ref.out) <= output_rounding + 2 * arithmetic, errors


def test_target_shape_float32_against_float64():
    """seqlen 8k, 8 heads, headdim 64, dstate 64, Q 256: the size the CPU must handle in seconds."""
    spec = ProblemSpec(seqlen=8192, nheads=8, headdim=64, dstate=64, chunk_size=256, D="head",
                       z=True, initial_states=True)
    problem = build_problem(spec)
    ref = chunked_float64(problem, 256)
    got = chunked_ssd(problem, compute_dtype=torch.float32)
    output_rounding = normwise(ref.out.to(problem.x.dtype), ref.out)
    assert normwise(got.out, ref.out) <= output_rounding + 2 * float32_arithmetic_bound(
        ref.out, 256, 64)
    assert normwise(got.final_states, ref.final_states) <= ARITHMETIC_ULPS * U32


def test_stored_states_are_rounded_and_read_back():
    spec = ProblemSpec(seqlen=200, nheads=2, headdim=8, dstate=8, chunk_size=32,
                       initial_states=True, cu_seqlens=(0, 70, 200), return_varlen_states=True)
    problem = build_problem(spec)
    exact = chunked_float64(problem, 32)
    default = chunked_ssd(problem)
    assert default.out.dtype == problem.x.dtype
    assert default.stages["chunk_states"].dtype == torch.float32
    bf16 = chunked_ssd(problem, state_dtype=torch.bfloat16, out_dtype=torch.float64)
    # The recurrence runs unrounded; only the stored copy is rounded...
    assert torch.equal(bf16.stages["chunk_states"], exact.stages["chunk_states"].bfloat16())
    assert torch.equal(bf16.final_states, exact.final_states)
    # ...and stage 3 and the varlen states read that copy.
    for name in ("out", "varlen_states"):
        err = normwise(getattr(bf16, name), getattr(exact, name))
        assert 0 < err <= U_BF16, (name, err)


def test_contract_entry_is_a_drop_in():
    spec = ProblemSpec(seqlen=PACKED[-1], nheads=4, headdim=8, dstate=8, chunk_size=64,
                       x_dtype="bf16", cu_seqlens=PACKED, return_varlen_states=True,
                       return_final_states=True, initial_states=True,
                       per_sequence_initial_states=True, D="channel", z=True)
    problem = build_problem(spec)
    out, final_states, varlen_states = ssd_reference(**problem.call_kwargs(),
                                                     compute_dtype=torch.float32)
    result = chunked_ssd(problem, compute_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and torch.equal(out, result.out)
    assert final_states.dtype == varlen_states.dtype == torch.float32
    assert torch.equal(final_states, result.final_states)
    assert torch.equal(varlen_states, result.varlen_states)
    plain = ssd_reference(problem.x, problem.dt, problem.A, problem.B, problem.C, 64)
    assert isinstance(plain, torch.Tensor) and plain.dtype == torch.bfloat16


@pytest.mark.parametrize("call, argument", [
    (lambda p: chunked_ssd(p, compute_dtype=torch.float16), "compute_dtype"),
    (lambda p: chunked_ssd(p, state_dtype=torch.int32), "state_dtype"),
    (lambda p: chunked_ssd(p, chunk_size=0), "chunk_size"),
    (lambda p: chunked_ssd(p, positions=[0, 65]), "positions"),
    (lambda p: ssd_reference(**{**p.call_kwargs(), "x": p.x[0]}), "x"),
])
def test_bad_arguments_name_the_argument(call, argument):
    # SSDInputError is a ValueError; positions share the oracles' check (a plain ValueError).
    problem = build_problem(ProblemSpec(seqlen=64, nheads=2, headdim=4, dstate=4, chunk_size=16))
    with pytest.raises(ValueError, match=f"^{argument}: expected"):
        call(problem)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = ProblemSpec(seqlen=PACKED[-1], nheads=4, headdim=16, dstate=16, ngroups=2,
                       chunk_size=64, cu_seqlens=PACKED, initial_states=True,
                       per_sequence_initial_states=True, return_varlen_states=True, D="head",
                       z=True, dt_bias=True, dt_softplus=True)
    cpu, cuda = build_problem(spec), build_problem(spec, device="cuda")
    ref = chunked_float64(cpu, 64)
    got64 = chunked_float64(cuda, 64)
    got32 = chunked_ssd(cuda, compute_dtype=torch.float32, out_dtype=torch.float32)
    for name in ("out", "final_states", "varlen_states"):
        assert getattr(got64, name).is_cuda
        assert normwise(getattr(got64, name).cpu(), getattr(ref, name)) <= FLOAT64_TOL
        # fp32 on the GPU means IEEE fp32 matmuls: TF32 (10-bit mantissas) would miss this.
        assert normwise(getattr(got32, name).cpu(), getattr(ref, name)) <= ARITHMETIC_ULPS * U32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ulps", [1, -1, 2])
def test_decay_nudge_moves_decays_inside_0_1_by_whole_ulps(dtype, ulps):
    """The baseline's evaluations with exp2 rounded the other way: 0 (masked) and 1 (no decay)
    stay exact, every decay in between moves by exactly |ulps| ulps in the asked direction."""
    from oracles.chunked_reference import ChunkedInputs
    ch = ChunkedInputs(*([None] * 9), decay_nudge_ulps=ulps)
    exponent = torch.tensor([-math.inf, 0.0, -1.0, -0.3, -40.0], dtype=dtype)
    plain, nudged = torch.exp2(exponent), ch.decay(exponent)
    assert nudged[0] == 0 and nudged[1] == 1
    expected = plain[2:]
    for _ in range(abs(ulps)):
        expected = torch.nextafter(expected, torch.full_like(expected, math.inf if ulps > 0 else 0))
    assert torch.equal(nudged[2:], expected)


def test_cumsum_rounded_once_is_the_float64_sum_of_the_float32_steps_and_is_validated():
    """The baseline's evaluation with S as the kernels' hi + lo scan delivers it: each S the
    float32 rounding of the float64 sum of the float32 steps; everything before S unchanged."""
    problem = build_problem(ProblemSpec(seqlen=300, chunk_size=256, regime="strong_decay"))
    plain = chunked_ssd(problem, compute_dtype=torch.float32)
    once = chunked_ssd(problem, compute_dtype=torch.float32, cumsum_rounded_once=True)
    assert torch.equal(once.stages["dt"], plain.stages["dt"])
    S = once.stages["log2_decay_cumsum"]
    assert S.abs().max() > 20                               # where rounding S matters
    steps = plain.stages["dt"] * (problem.A.float() * LOG2_E)[None, :, None, None]
    assert torch.equal(S, steps.double().cumsum(dim=-1).float())
    with pytest.raises(SSDInputError, match="cumsum_rounded_once: expected a bool, got 1"):
        chunked_ssd(problem, cumsum_rounded_once=1)


def test_decay_nudge_changes_the_float32_result_and_is_validated():
    problem = build_problem(ProblemSpec(seqlen=70, chunk_size=16, regime="large_initial_state",
                                        initial_states=True))
    plain = chunked_ssd(problem, compute_dtype=torch.float32)
    up = chunked_ssd(problem, compute_dtype=torch.float32, decay_nudge_ulps=1)
    assert not torch.equal(plain.final_states, up.final_states)
    moved = (up.final_states - plain.final_states).norm() / plain.final_states.norm()
    assert moved < 1e-5          # a rounding's worth, nothing structural
    with pytest.raises(SSDInputError, match="decay_nudge_ulps: expected an int, got 0.5"):
        chunked_ssd(problem, decay_nudge_ulps=0.5)
