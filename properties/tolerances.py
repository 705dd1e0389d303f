"""The one table of accuracy tolerances, and the a-priori bounds for checks that have no baseline.

Accuracy rule (every implementation under test, every stage it returns):

    max |impl - exact| <= k * max(max |reference_fp32 - exact|, u_out * max |exact|) + floor

where exact is float64 (the best oracle tier that fits) and reference_fp32 is the chunked reference
computing in float32 on the same inputs, rounding to the same output dtypes. The baseline carries
the problem's conditioning (cancellation in y = h . C + D x, long accumulations, large exponents),
so k only has to cover a different but equally sound evaluation order and rounding of the same
algorithm. The baseline is never taken below u_out * max|exact| (u_out: the output dtype's unit
roundoff), the largest error one correct rounding may make at the largest exact magnitude: on a
problem of a few entries the reference's largest error can fall far below that by luck (seen on
the H200: a single fp32 output, the reference 0.30 ulp from exact, the 3xTF32 kernel 1.30 ulp, one
ulp from the reference's result), and no implementation delivering that dtype is owed better than about one rounding.
A test never loosens a value here without a written reason next to it.

The baseline is the worst of four float32 evaluations (``BASELINE_EVALUATIONS``): the reference
with its decays 2^e as torch's exp2 rounds them, the same with every decay in (0, 1) one ulp
higher, and one ulp lower, and the first with its log2 decay cumsum S rounded once. An exp2
within one ulp (libm's; the GPU's ex2.approx is within about two) is as sound as torch's, and on
a large carried state that ulp alone moves the result by several of its ulps: on the pinned case
large-initial-state-mixed-dtypes (initial states of 4000, final states up to 17) the reference's
final_states error was 1.4e-6 on the H200 and 7.0e-6 on the CPU, and on the CPU with every decay
one ulp up 3.2e-6, one ulp down 1.1e-5 (on an AVX2 AMD EPYC with torch 2.13.0: 8.9e-6, 5.1e-6
and 1.08e-5, its vector code rounding otherwise). One evaluation's rounding pattern is a sample,
not the conditioning; the worst of the three bounds the spread that the decays' last bit makes.

The fourth evaluation sums S in float64 from the float32 steps and rounds each S once, as the
kernels' hi + lo scan does (and torch's CPU cumsum, whose accumulator is float64); torch's CUDA
cumsum rounds every partial sum. Each step dt * A * log2(e) carries a rounding shared by every
step of the head (A * log2(e) is rounded once), so under a long strong decay S is off by a
coherent ~|S| * 2^-24 whichever way it is summed, a backward error of half an ulp in A whose
forward effect on a decayed state is ln2 * |S| * 2^-24 relative. The CUDA scan's own roundings
can cancel part of it by luck: on the H200 at 6f8d33e the gpu profile found a pure decay (x = 0,
|S| = 31 and 42 over 511 steps, final states up to 1.4e-9) where the kernels' final_states error,
1.03e-15 (7.6e-7 relative, ln2 * 31 * 2^-24 = 1.3e-6), was 4.13x the GPU reference's 2.49e-16
and so 1.03x the allowance, while the same float32 reference on the CPU makes 1.03e-15 to three
digits (reports/h200/failures/property-pure-decay_cutile_6f8d33e.json). A more accurate S is no less
sound an evaluation, so its error is part of the baseline. It does not hide what the rule caught
before: at the artifact of strong-decay-neighbour-differences (tests/regressions.json), the
kernels' final_states error at 431dbb8 is 17x this evaluation's on the CPU and 2x the allowance
there.

Checks where that baseline is the implementation itself (the reference under test) or where no
oracle runs (metamorphic relations) use the a-priori bounds below instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STAGES = ("out", "final_states", "varlen_states", "dt", "log2_decay_cumsum", "chunk_states")
# The reference's decays as torch rounds them, one ulp up, one ulp down, and its cumsum rounded
# once (module docstring): keyword arguments of ``properties.impls.reference``.
BASELINE_EVALUATIONS = ({}, {"decay_nudge_ulps": 1}, {"decay_nudge_ulps": -1},
                        {"cumsum_rounded_once": True})


@dataclass(frozen=True)
class Tolerance:
    k: float
    floor: float

    def allowed(self, reference_error: float, least_error: float = 0.0) -> float:
        """k * max(the reference's max error, the least error owed: u_out * max|exact|) + floor."""
        return self.k * max(reference_error, least_error) + self.floor


# Floors: the absolute error allowed where the baseline happens to be exact. GPU float32 arithmetic
# may flush subnormal results to zero (FTZ) where the CPU reference keeps them: an absolute error
# below the smallest normal, finfo.tiny (fp32 and bf16 share it). fp16 outputs are converted from
# float32 with gradual underflow on every target, so their floor is one fp16 subnormal spacing
# (2^-24): the two sides may round a subnormal result to neighbouring values.
_FLOOR = {torch.float32: torch.finfo(torch.float32).tiny,
          torch.bfloat16: torch.finfo(torch.bfloat16).tiny,
          torch.float16: 2.0 ** -24,
          torch.float64: torch.finfo(torch.float64).tiny}

# k per stage and output dtype.
# - out in fp16/bf16: the baseline's error is essentially the final rounding (<= 1/2 ulp at each
#   entry). A tensor-core kernel legitimately rounds two more intermediates to the input dtype
#   (the intra-chunk weights C.B * decay * dt and the state before the C . h product), each worth up
#   to 1/2 ulp of a term of the output's size, and its float32 value may straddle a rounding
#   boundary the reference's does not (one more ulp). 1/2 + 1/2 + 1/2 + 1 ulp = 2.5 x the
#   baseline's 1/2 ulp; k = 4 leaves headroom for terms somewhat larger than the output.
# - out in fp32 and the float32 stages: same arithmetic, different order of the same sums (tree vs
#   sequential cumsum, MMA tiling vs torch matmul). Summation-order changes move the error's
#   constant, not its order: k = 4. A TF32 matmul (10-bit mantissa) on float32 inputs is ~2^13
#   times worse and fails this on purpose: float32 inputs are owed float32 accuracy.
# - dt: elementwise (bias add, softplus via exp/log1p, clamp); fast exp2/log2 intrinsics are
#   within 2 ulp where libm is within 1/2: k = 8. Without softplus the baseline is exact (a plain
#   upcast and at most one add) and only the floor remains, which is the point.
_K = {
    "out": {torch.float32: 4.0, torch.bfloat16: 4.0, torch.float16: 4.0, torch.float64: 4.0},
    "final_states": {torch.float32: 4.0},
    "varlen_states": {torch.float32: 4.0},
    "chunk_states": {torch.float32: 4.0, torch.bfloat16: 4.0, torch.float16: 4.0},
    "dt": {torch.float32: 8.0},
    "log2_decay_cumsum": {torch.float32: 4.0},
}


def tolerance(stage: str, dtype: torch.dtype) -> Tolerance:
    """k and floor for ``stage`` produced in ``dtype``."""
    if stage not in _K:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")
    if dtype not in _K[stage]:
        raise ValueError(f"dtype: expected one of {sorted(map(str, _K[stage]))} for stage "
                         f"{stage!r}, got {dtype}")
    return Tolerance(k=_K[stage][dtype], floor=_FLOOR[dtype])


# A-priori rounding bound (for an implementation computing in ``compute`` precision, checked
# without a baseline): |err| <= u_out * |exact| + gamma * u_compute * magnitude + floor, where
# magnitude is the same quantity computed from |x|, |B|, |C|, |D|, |initial state| (so every term
# of every sum counts with its absolute value) and gamma counts the longest chain of roundings a
# term goes through: a dot product over dstate (C . h), one over the chunk (intra-chunk sum and the
# chunk's state), the state passing over nchunks, and a fixed few for dt, exp and the gates.
# This is the classical worst-case bound n * u * sum|terms| (Higham, Accuracy and Stability of
# Numerical Algorithms, ch. 3): pessimistic by design, it still catches every structural error,
# which costs O(1) relative to the terms, not O(n u).
APRIORI_FIXED_TERMS = 16


def apriori_gamma(chunk_size: int, nchunks: int, dstate: int) -> int:
    return chunk_size + nchunks + dstate + APRIORI_FIXED_TERMS


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


# Relations between two runs of one implementation whose exact answers agree (chunk sizes, splits,
# packing, group broadcast, additivity): |a - b| <= RELATION_ULPS * eps(dtype) * max|a| + floor,
# plus each run's a-priori compute error (``properties.check.relation_slack``). Each side's
# error is its rounding of the output (<= 1/2 ulp) plus its compute error; scaled by the largest
# output it covers 1 ulp of rounding disagreement and leaves 2 ulp per side for compute in
# float32 (fp16/bf16 outputs: compute error is far below their ulp). For fp32 outputs the compute
# error of sums over a chunk and over the chunks is a few fp32 ulp of the largest term, so 64 ulp
# of the largest output, 2^-17 relative, far below a structural error's O(1); where terms cancel
# to an output far below them, or strong decays take exponents far from 0, the compute error is
# the a-priori bound's (``properties.check.apriori_compute_bound``), which that slack adds.
RELATION_ULPS = {torch.float32: 64.0, torch.bfloat16: 4.0, torch.float16: 4.0,
                 torch.float64: 64.0}


def relation_tolerance(dtype: torch.dtype, scale: float) -> float:
    """Allowed |a - b| between two runs related exactly in real arithmetic, outputs in ``dtype``
    whose largest magnitude is ``scale``."""
    return RELATION_ULPS[dtype] * torch.finfo(dtype).eps * scale + _FLOOR[dtype]
