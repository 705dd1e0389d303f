"""The three oracle tiers against closed forms, against each other across regimes and features,
and their self-check and budget refusals. CPU only, fast.

Tolerances (normwise relative, ||a - b||_F / ||b||_F): float64 against a closed form or mpmath
1e-12 (float64 carries ~1e-16 per operation; a few thousand accumulated steps stay far below
1e-12); float64 sequential against the float64 parallel scan 1e-10 (the scan reassociates the
recurrence and exponentiates span sums, so its rounding differs from the step-by-step loop).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.contract import validate
from oracles.chunked_reference import chunked_ssd
from oracles.common import OracleBudgetError, SSDResult
from oracles.mpmath_recurrence import DEFAULT_DPS, mpmath_ssd, sample_slices
from oracles.parallel_scan import MEMORY_FACTOR, parallel_scan_ssd, scan_bytes
from oracles.sequential import sequential_ssd
from properties.problems import ProblemSpec, build_problem
from properties.regimes import REGIMES

FLOAT64_TOL = 1e-12
SCAN_TOL = 1e-10
FIELDS = ("out", "final_states", "states", "varlen_states")


def normwise_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def replaced(problem, **tensors):
    """The problem with some tensors replaced, validated again."""
    return validate(**{**problem.call_kwargs(), **tensors})


def up(t):
    return None if t is None else t.to(torch.float64)


def per_head(problem, t):
    """B or C (b, L, G, N) as float64 (b, L, H, N)."""
    return up(t).repeat_interleave(problem.nheads // problem.ngroups, dim=2)


def assert_close(got: SSDResult, want: SSDResult, tol: float, what: str):
    for name in FIELDS:
        w = getattr(want, name)
        if w is None:
            continue
        err = normwise_rel(getattr(got, name), w)
        assert err <= tol, f"{what} {name}: normwise relative error {err:.3e} > {tol:.0e}"


def assert_mpmath_close(problem, want: SSDResult, positions, tol=FLOAT64_TOL, count=4):
    """mpmath on ``count`` sampled slices against the same slices of ``want``."""
    exact = mpmath_ssd(problem, sample_slices(problem, count), positions=positions)
    got, ref = exact.float64(), exact.pick(want)
    assert got.keys() == ref.keys()
    for name in got:
        err = normwise_rel(ref[name], got[name])
        assert err <= tol, f"mpmath vs float64 {name}: normwise relative error {err:.3e} > {tol:.0e}"


def assert_tiers_agree(problem, positions):
    seq = sequential_ssd(problem, positions=positions)
    scan = parallel_scan_ssd(problem, positions=positions)
    assert_close(scan, seq, SCAN_TOL, "parallel scan vs sequential")
    assert_mpmath_close(problem, seq, positions)
    return seq


def assert_all_tiers_match(problem, want: SSDResult, positions=None, tol=FLOAT64_TOL):
    """Every tier against a closed form ``want``."""
    assert_close(sequential_ssd(problem, positions=positions), want, tol, "sequential")
    assert_close(parallel_scan_ssd(problem, positions=positions), want, tol, "parallel scan")
    assert_mpmath_close(problem, want, positions, tol)


def states_at(h_all: torch.Tensor, h0: torch.Tensor, positions):
    """(b, K, H, P, N) states after each step count, from all states h_t (b, L, H, P, N)."""
    return torch.stack([h0 if p == 0 else h_all[:, p - 1] for p in positions], dim=1)


# ---------------------------------------------------------------------------------------------
# Closed forms

def test_no_decay_is_a_prefix_sum():
    """A = 0: h_t = h_0 + sum_{s <= t} dt_s x_s B_s^T."""
    p = build_problem(ProblemSpec(batch=2, seqlen=100, nheads=4, headdim=8, dstate=8, ngroups=2,
                                  chunk_size=32, initial_states=True, D="head"))
    p = replaced(p, A=torch.zeros_like(p.A))
    x, dt, h0 = up(p.x), up(p.dt), up(p.initial_states)
    h = ((dt[..., None] * x)[..., None] * per_head(p, p.B)[:, :, :, None, :]).cumsum(1) + h0[:, None]
    y = torch.einsum("blhpn,blhn->blhp", h, per_head(p, p.C)) + up(p.D)[:, None] * x
    positions = [0, 37, 100]
    want = SSDResult(out=y, final_states=h[:, -1], states=states_at(h, h0, positions),
                     positions=positions)
    assert_all_tiers_match(p, want, positions)


def test_constant_step_is_a_geometric_series():
    """Constant dt, A, x_t = x, B_t = B: h_t = a^(t+1) h_0 + dt x B^T (1 - a^(t+1)) / (1 - a)."""
    p = build_problem(ProblemSpec(seqlen=200, nheads=2, headdim=4, dstate=4, initial_states=True))
    dt_value, A_value = 2.0 ** -6, -4.0   # both exact in fp32
    x_first, B_first = p.x[:, :1], p.B[:, :1]
    p = replaced(p, dt=torch.full_like(p.dt, dt_value), A=torch.full_like(p.A, A_value),
                 x=x_first.expand_as(p.x).contiguous(), B=B_first.expand_as(p.B).contiguous())
    log_a = dt_value * A_value
    steps = torch.arange(1, p.seqlen + 1, dtype=torch.float64)[None, :, None, None, None]
    h0 = up(p.initial_states)[:, None]
    update = (dt_value * up(x_first))[..., None] * per_head(p, B_first)[:, :, :, None, :]
    h = torch.exp(steps * log_a) * h0 + update * torch.expm1(steps * log_a) / math.expm1(log_a)
    y = torch.einsum("blhpn,blhn->blhp", h, per_head(p, p.C))
    positions = [0, 1, 199, 200]
    want = SSDResult(out=y, final_states=h[:, -1], states=states_at(h, h0[:, 0], positions),
                     positions=positions)
    assert_all_tiers_match(p, want, positions)


def test_seqlen_one():
    """One step with every feature: y = silu(z) ((e^(dt A) h_0 + dt x B^T) C + D x)."""
    p = build_problem(ProblemSpec(batch=2, seqlen=1, nheads=4, headdim=8, dstate=8, ngroups=2,
                                  initial_states=True, D="channel", z=True, dt_bias=True,
                                  dt_softplus=True))
    dt = F.softplus(up(p.dt) + up(p.dt_bias), threshold=1e9)[:, 0]            # (b, H)
    x, B, C = up(p.x)[:, 0], per_head(p, p.B)[:, 0], per_head(p, p.C)[:, 0]
    h = torch.exp(dt * up(p.A))[..., None, None] * up(p.initial_states) + \
        (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (torch.einsum("bhpn,bhn->bhp", h, C) + up(p.D) * x) * F.silu(up(p.z)[:, 0])
    want = SSDResult(out=y[:, None], final_states=h, states=torch.stack([up(p.initial_states), h], 1),
                     positions=[0, 1])
    assert_all_tiers_match(p, want, [0, 1])


def quadratic_form(p) -> SSDResult:
    """The whole sequence as one masked matrix product (the SSD 'attention' form), no recurrence:
    y_t = sum_{s<=t} e^(cs_t - cs_s) (C_t . B_s) dt_s x_s + e^(cs_t) C_t . h_0, cs = cumsum(dt A)."""
    x, dt, A, h0 = up(p.x), up(p.dt), up(p.A), up(p.initial_states)
    B, C = per_head(p, p.B), per_head(p, p.C)
    cs = torch.cumsum(dt * A, dim=1)                                       # (b, L, H)
    causal = torch.ones(p.seqlen, p.seqlen, dtype=torch.bool).tril()[None, :, :, None]
    gaps = (cs[:, :, None] - cs[:, None, :]).masked_fill(~causal, -math.inf)  # (b, t, s, H)
    scores = torch.exp(gaps) * torch.einsum("bthn,bshn->btsh", C, B)
    y = torch.einsum("btsh,bsh,bshp->bthp", scores, dt, x) + \
        torch.einsum("bth,bthn,bhpn->bthp", torch.exp(cs), C, h0)
    to_end = torch.exp(cs[:, -1:] - cs)                                    # (b, s, H)
    final = torch.einsum("bsh,bsh,bshp,bshn->bhpn", to_end, dt, x, B) + \
        torch.exp(cs[:, -1])[..., None, None] * h0
    return SSDResult(out=y, final_states=final)


def test_single_chunk_matches_the_quadratic_form():
    p = build_problem(ProblemSpec(batch=2, seqlen=64, chunk_size=64, nheads=4, headdim=8, dstate=8,
                                  ngroups=2, initial_states=True))
    assert p.nchunks == 1
    assert_all_tiers_match(p, quadratic_form(p))


def zero_input_problem(initial_states: bool):
    p = build_problem(ProblemSpec(batch=2, seqlen=80, nheads=2, headdim=4, dstate=8,
                                  initial_states=initial_states, D="head", z=True))
    return replaced(p, x=torch.zeros_like(p.x))


def test_zero_input_without_a_state_stays_exactly_zero():
    p = zero_input_problem(initial_states=False)
    positions = [0, 40, 80]
    for tier, result in (("sequential", sequential_ssd(p, positions)),
                         ("parallel scan", parallel_scan_ssd(p, positions))):
        for name in ("out", "final_states", "states"):
            assert torch.count_nonzero(getattr(result, name)) == 0, f"{tier} {name}"
    for name, value in mpmath_ssd(p, sample_slices(p, 3), positions=positions).float64().items():
        assert torch.count_nonzero(value) == 0, f"mpmath {name}"


def test_zero_input_is_pure_decay_of_the_initial_state():
    """x = 0: h_t = e^(cs_t) h_0 with cs = cumsum(dt A); y_t = (h_t . C_t) silu(z_t)."""
    p = zero_input_problem(initial_states=True)
    positions = [0, 40, 80]
    cs = torch.cumsum(up(p.dt) * up(p.A), dim=1)
    h0 = up(p.initial_states)
    h = torch.exp(cs)[..., None, None] * h0[:, None]
    y = torch.einsum("blhpn,blhn->blhp", h, per_head(p, p.C)) * F.silu(up(p.z))
    want = SSDResult(out=y, final_states=h[:, -1], states=states_at(h, h0, positions),
                     positions=positions)
    assert_all_tiers_match(p, want, positions)


@pytest.mark.parametrize("zeroed", ["B", "C"])
@pytest.mark.parametrize("D", ["head", "channel"])
def test_skip_only(zeroed, D):
    """B = 0 or C = 0: out = D x silu(z), and with B = 0 and no initial state the state stays 0."""
    p = build_problem(ProblemSpec(seqlen=70, nheads=4, headdim=8, dstate=4, ngroups=2, D=D, z=True,
                                  chunk_size=32, initial_states=zeroed == "C"))
    p = replaced(p, **{zeroed: torch.zeros_like(getattr(p, zeroed))})
    D64 = up(p.D) if p.D.dim() == 2 else up(p.D)[:, None]
    want_out = D64 * up(p.x) * F.silu(up(p.z))
    exact = mpmath_ssd(p, sample_slices(p, 4))
    results = {"sequential": sequential_ssd(p), "parallel scan": parallel_scan_ssd(p)}
    for name, result in results.items():
        # The same few roundings in a different order (silu as z * sigmoid(z) vs F.silu).
        assert normwise_rel(result.out, want_out) <= 1e-14, name
        if zeroed == "B":
            assert torch.count_nonzero(result.final_states) == 0, name
    want_slices = torch.stack([want_out[b, :, h, q] for b, h, q in exact.slices])
    assert normwise_rel(exact.float64()["out"], want_slices) <= 1e-14
    if zeroed == "C":
        # The state still evolves; out must not see it.
        assert torch.count_nonzero(results["sequential"].final_states) > 0


# ---------------------------------------------------------------------------------------------
# Tier agreement across regimes and contract features

# Features each regime is about (the rest get a plain 300-step problem plus the regime's own
# dt_limit and x dtype, when it names them).
REGIME_FEATURES = {
    "mamba2_init": dict(D="head", z=True),
    "strong_decay": dict(initial_states=True),
    # Long: the state accumulates for thousands of steps with decay ~ 1 - 1e-5.
    "near_unit_decay": dict(seqlen=4000, nheads=2, headdim=4, dstate=8, chunk_size=256,
                            initial_states=True),
    "large_magnitude": dict(D="channel"),
    "tiny_magnitude": dict(D="channel", z=True),
    "large_initial_state": dict(initial_states=True),
    "softplus_edge": dict(dt_bias=True, dt_softplus=True),
}


def regime_spec(name: str) -> ProblemSpec:
    regime = REGIMES[name]
    spec = dict(batch=1, seqlen=300, nheads=4, headdim=8, dstate=16, ngroups=2, chunk_size=64,
                regime=name, seed=3)
    if getattr(regime, "dt_limit", None) is not None:
        spec["dt_limit"] = regime.dt_limit
    if getattr(regime, "x_dtypes", ()):
        spec["x_dtype"] = regime.x_dtypes[0]
    return ProblemSpec(**{**spec, **REGIME_FEATURES.get(name, {})})


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_tiers_agree_across_regimes(regime):
    p = build_problem(regime_spec(regime))
    assert_tiers_agree(p, positions=[0, 64, p.seqlen // 2 + 1, p.seqlen])


FEATURE_SPECS = {
    "seqlen_not_multiple_of_chunk": dict(seqlen=150, chunk_size=64),
    "ngroups_equals_nheads": dict(nheads=4, ngroups=4),
    "ngroups_2": dict(nheads=4, ngroups=2),
    "initial_states_batch_form": dict(batch=3, initial_states=True),
    "initial_states_per_sequence": dict(cu_seqlens=(0, 50, 64, 130, 150), initial_states=True,
                                        per_sequence_initial_states=True,
                                        return_varlen_states=True),
    "D_per_head": dict(D="head"),
    "D_per_channel": dict(D="channel"),
    "z_gate": dict(z=True),
    "dt_bias_softplus_limit": dict(dt_bias=True, dt_softplus=True, dt_limit=(0.004, 0.05)),
    # Sequences starting mid-chunk, resets implied by cu_seqlens alone.
    "cu_seqlens_only": dict(cu_seqlens=(0, 10, 75, 76, 150), pass_seq_idx=False,
                            return_varlen_states=True, initial_states=True),
    "cu_seqlens_and_seq_idx": dict(cu_seqlens=(0, 10, 75, 76, 150), return_varlen_states=True),
    "half_precision_inputs": dict(x_dtype="bf16", bc_dtype="fp16", param_dtype="bf16",
                                  state_dtype="bf16", initial_states=True, D="channel", z=True),
}


@pytest.mark.parametrize("feature", sorted(FEATURE_SPECS))
def test_tiers_agree_on_features(feature):
    shape = dict(seqlen=150, nheads=4, headdim=8, dstate=16, ngroups=2, chunk_size=64)
    p = build_problem(ProblemSpec(**{**shape, **FEATURE_SPECS[feature]}, seed=11))
    # States at: the start, mid-chunk, a chunk boundary, where sequences start (pre-reset), the end.
    seq = assert_tiers_agree(p, positions=[0, 10, 64, 75, 76, 149, 150])
    if p.cu_seqlens is not None:
        assert seq.varlen_states is not None and seq.varlen_states.shape[0] == p.nseq


def test_tiers_agree_with_seq_idx_alone_in_several_rows():
    """seq_idx without cu_seqlens (batch > 1, different resets per row): a batch-form initial
    state starts each row; later sequences start from zeros."""
    p = build_problem(ProblemSpec(batch=2, seqlen=150, nheads=4, headdim=8, dstate=16, ngroups=2,
                                  initial_states=True, D="head", z=True, seed=5))
    seq_idx = torch.zeros(2, 150, dtype=torch.int32)
    seq_idx[0, 33:] = 1
    seq_idx[0, 100:] = 4
    seq_idx[1, 64:] = 7
    p = replaced(p, seq_idx=seq_idx)
    seq = assert_tiers_agree(p, positions=[0, 33, 64, 100, 150])
    # The reset is real: the state right after a reset is the first step's update alone.
    x, dt, B = up(p.x), up(p.dt), per_head(p, p.B)
    first = (dt[1, 64, :, None] * x[1, 64])[..., None] * B[1, 64, :, None, :]
    y_first = torch.einsum("hpn,hn->hp", first, per_head(p, p.C)[1, 64])
    y_first = (y_first + up(p.D)[:, None] * x[1, 64]) * F.silu(up(p.z)[1, 64])
    assert normwise_rel(seq.out[1, 64], y_first) <= FLOAT64_TOL


def test_parallel_scan_float32():
    """The float32 scan: a float32 computation, so float32 accuracy (300 steps, ~1e-6 expected)."""
    p = build_problem(ProblemSpec(seqlen=300, nheads=4, headdim=8, dstate=16, ngroups=2,
                                  initial_states=True, D="head", z=True,
                                  cu_seqlens=(0, 100, 230, 300), return_varlen_states=True))
    scan = parallel_scan_ssd(p, positions=[0, 100, 300], dtype=torch.float32)
    assert scan.out.dtype == torch.float32
    assert_close(scan, sequential_ssd(p, positions=[0, 100, 300]), 1e-5, "float32 scan")


@pytest.mark.gpu
def test_parallel_scan_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    p = build_problem(ProblemSpec(seqlen=300, nheads=4, headdim=8, dstate=16, ngroups=2,
                                  initial_states=True, cu_seqlens=(0, 100, 230, 300),
                                  per_sequence_initial_states=True, return_varlen_states=True),
                      device="cuda")
    scan = parallel_scan_ssd(p, positions=[0, 100, 300])
    assert scan.out.is_cuda
    assert_close(scan, sequential_ssd(p, positions=[0, 100, 300], device="cpu"), SCAN_TOL,
                 "CUDA scan vs CPU sequential")


# ---------------------------------------------------------------------------------------------
# mpmath self-check, budgets, argument errors

def test_mpmath_self_check_reports_the_precision():
    p = build_problem(ProblemSpec(seqlen=100, nheads=2, headdim=4, dstate=8, initial_states=True,
                                  dt_bias=True, dt_softplus=True, z=True, D="head"))
    slices = sample_slices(p, 3)
    exact = mpmath_ssd(p, slices, positions=[0, 50], self_check=True)
    check = exact.self_check
    assert (check.dps, check.check_dps) == (DEFAULT_DPS, 2 * DEFAULT_DPS)
    assert check.max_rel_diff < 10.0 ** (5 - DEFAULT_DPS)
    # At 12 digits the rerun at 24 must see the difference: the check is not blind.
    coarse = mpmath_ssd(p, slices, dps=12, self_check=True).self_check
    assert 1e-16 < coarse.max_rel_diff < 1e-8


def test_mpmath_refuses_past_its_budget():
    p = build_problem(ProblemSpec(seqlen=100, dstate=16))
    with pytest.raises(OracleBudgetError) as info:
        mpmath_ssd(p, sample_slices(p, 5), max_cost=7999)
    message = str(info.value)
    for words in ("8,000", "max_cost=7,999", "fewer slices", "shorter seqlen", "smaller dstate"):
        assert words in message
    mpmath_ssd(p, sample_slices(p, 5)[:1], max_cost=7999)   # 1600 multiply-adds fit


def test_parallel_scan_refuses_past_its_budget():
    p = build_problem(ProblemSpec(batch=2, seqlen=128, nheads=4, headdim=16, dstate=16))
    need = MEMORY_FACTOR * 2 * 128 * 4 * 16 * 16 * 8
    assert scan_bytes(p) == need and scan_bytes(p, torch.float32) == need // 2
    with pytest.raises(OracleBudgetError) as info:
        parallel_scan_ssd(p, max_bytes=need - 1)
    message = str(info.value)
    for words in ("max_bytes", "seqlen 128", "dstate 16", "dtype=torch.float32"):
        assert words in message
    parallel_scan_ssd(p, dtype=torch.float32, max_bytes=need - 1)


def test_bad_slices_and_positions_are_refused():
    p = build_problem(ProblemSpec(seqlen=20, nheads=2, headdim=4, dstate=4))
    with pytest.raises(ValueError, match=r"slices: .* h < 2, .* got \(0, 2, 0\)"):
        mpmath_ssd(p, [(0, 2, 0)])
    with pytest.raises(ValueError, match=r"positions: expected step counts in \[0, 20\], got \[21\]"):
        mpmath_ssd(p, [(0, 0, 0)], positions=[21])
    with pytest.raises(ValueError, match=r"positions: .* got \[-1\]"):
        parallel_scan_ssd(p, positions=[-1])
    # The sequential loop too: an out-of-range position must not come back as a zero state.
    for bad in ([21], [-1]):
        with pytest.raises(ValueError, match=r"positions: expected step counts in \[0, 20\]"):
            sequential_ssd(p, positions=bad)
    # Repeated positions would leave states slots unfilled or misaligned: every tier refuses them.
    for tier in (sequential_ssd, parallel_scan_ssd, chunked_ssd):
        with pytest.raises(ValueError, match=r"positions: expected distinct step counts"):
            tier(p, positions=[5, 5])
    with pytest.raises(ValueError, match=r"positions: expected distinct step counts"):
        mpmath_ssd(p, [(0, 0, 0)], positions=[5, 5])
    exact = mpmath_ssd(p, [(0, 0, 0)], positions=[3])
    with pytest.raises(ValueError, match=r"result.positions: expected \[3\], got \[4\]"):
        exact.pick(sequential_ssd(p, positions=[4]))


def test_sample_slices_are_distinct_sorted_and_include_the_corners():
    p = build_problem(ProblemSpec(batch=2, seqlen=4, nheads=3, headdim=5, dstate=2))
    slices = sample_slices(p, 7, seed=1)
    assert len(set(slices)) == 7 and slices == sorted(slices)
    assert slices[0] == (0, 0, 0) and slices[-1] == (1, 2, 4)
    assert sample_slices(p, 7, seed=1) == slices
    assert len(sample_slices(p, 1000)) == 2 * 3 * 5
