"""Error metrics of a computed tensor against its float64 exact value, in the output dtype's terms.

Every metric is taken over the positions where the exact value rounds to a finite number of the
output dtype (|exact| below max + half its ulp, e.g. 65520 for fp16: round-to-nearest takes 65510
to 65504): there an implementation owes a finite answer. Positions where the exact value overflows the output dtype are counted
(``overflow``), not measured: the correctly rounded answer there is +-inf. A non-finite result where
a finite answer is owed is counted in ``nonfinite`` and makes every error metric inf.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# max_rel and ulp_max divide by max(|exact|, floor). Without a floor, an output that is 0 up to
# cancellation (y = h . C + D x summing terms of either sign) gets an arbitrarily large relative
# error from an absolute error that is the rounding error of its terms, a fact about the inputs,
# not the implementation. 2^-10 of the exact's RMS keeps every entry within three orders of
# magnitude of the typical one judged relatively, and judges smaller entries on that absolute scale.
DEFAULT_REL_FLOOR_FRACTION = 2.0 ** -10


def _finfo(dtype: torch.dtype) -> torch.finfo:
    if not dtype.is_floating_point:
        raise ValueError(f"out_dtype: expected a floating-point dtype, got {dtype}")
    return torch.finfo(dtype)


def overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf in ``dtype``: max + half an ulp at max (the tie
    goes to inf, max's mantissa being odd)."""
    fi = _finfo(dtype)
    exponent = math.frexp(fi.max)[1]        # max = 1.x * 2^(exponent - 1); half an ulp there:
    return fi.max + math.ldexp(fi.eps, exponent - 2)    # inf for float64, where all is owed


def owed_finite(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where ``exact`` (float64) rounds to a finite value of ``dtype``: a finite answer is owed."""
    return torch.isfinite(exact) & (exact.abs() < overflow_threshold(dtype))


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |values| (float64): 2^(exponent) * eps for normal magnitudes,
    the subnormal spacing (tiny * eps) below the smallest normal."""
    fi = _finfo(dtype)
    mag = values.abs().to(torch.float64).clamp(min=fi.tiny)
    _, exponent = torch.frexp(mag)              # mag = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(mag, fi.eps), (exponent - 1).to(torch.int64))


def error_metrics(actual: torch.Tensor, exact: torch.Tensor, out_dtype: torch.dtype,
                  rel_floor: Optional[float] = None) -> dict:
    """Errors of ``actual`` (any dtype/device) against ``exact`` (float64, same shape).

    max_abs: max |actual - exact|. max_rel: max |err| / max(|exact|, rel_floor). normwise_rel:
    ||err||_F / ||exact||_F. ulp_max: max |err| / ulp(max(|exact|, rel_floor)) in ``out_dtype``.
    rounding_floor_ratio: ||err||_F divided by ||round(exact) - exact||_F, the error of the exact
    result merely rounded to ``out_dtype`` (normwise, so one lucky exactly-representable entry does
    not divide by zero): 1.0 is as good as the output dtype allows, and the number compares across
    dtypes. exact_absmax: max |exact| over the measured entries. rel_floor defaults to DEFAULT_REL_FLOOR_FRACTION * RMS(exact) and is returned.
    Also: ``nonfinite`` (owed a finite value, got NaN/Inf), ``overflow`` (exact beyond the dtype's
    range: not measured), ``count`` (entries measured).
    """
    if tuple(actual.shape) != tuple(exact.shape):
        raise ValueError(f"actual: expected shape {tuple(exact.shape)} (the exact's), "
                         f"got {tuple(actual.shape)}")
    fi = _finfo(out_dtype)
    exact = exact.to(torch.float64)
    got = actual.detach().to(device=exact.device, dtype=torch.float64)
    owed = owed_finite(exact, out_dtype)
    overflow = int((torch.isfinite(exact) & ~owed).sum())
    e, a = exact[owed], got[owed]
    nonfinite = int((~torch.isfinite(a)).sum())
    count = e.numel()
    rms = float(e.square().mean().sqrt()) if count else 0.0
    floor = DEFAULT_REL_FLOOR_FRACTION * rms if rel_floor is None else float(rel_floor)
    # The smallest positive floor that still means something: the dtype's subnormal spacing.
    floor = max(floor, fi.tiny * fi.eps)
    metrics = dict(count=count, nonfinite=nonfinite, overflow=overflow, rel_floor=floor,
                   exact_absmax=float(e.abs().max()) if count else 0.0)
    if count == 0:
        return dict(metrics, max_abs=0.0, max_rel=0.0, normwise_rel=0.0, ulp_max=0.0,
                    rounding_floor_ratio=1.0)
    if nonfinite:
        return dict(metrics, max_abs=math.inf, max_rel=math.inf, normwise_rel=math.inf,
                    ulp_max=math.inf, rounding_floor_ratio=math.inf)
    err = (a - e).abs()
    scale = e.abs().clamp(min=floor)
    err_norm = float(torch.linalg.vector_norm(err))
    exact_norm = float(torch.linalg.vector_norm(e))
    rounding_norm = float(torch.linalg.vector_norm(e.to(out_dtype).to(torch.float64) - e))
    return dict(
        metrics,
        max_abs=float(err.max()),
        max_rel=float((err / scale).max()),
        normwise_rel=_ratio(err_norm, exact_norm, zero_over_zero=0.0),
        ulp_max=float((err / ulp(scale, out_dtype)).max()),
        # Exactly representable exact values and an exact answer: as good as the dtype allows.
        rounding_floor_ratio=_ratio(err_norm, rounding_norm, zero_over_zero=1.0),
    )


def _ratio(num: float, den: float, zero_over_zero: float) -> float:
    if den > 0:
        return num / den
    return zero_over_zero if num == 0 else math.inf
