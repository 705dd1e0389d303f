"""The error metrics and the tolerance table: definitions checked on constructed cases and, with
hypothesis.extra.numpy, on arbitrary arrays."""
from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from properties import tolerances
from properties.metrics import (DEFAULT_REL_FLOOR_FRACTION, error_metrics, overflow_threshold, owed_finite,
                                ulp)

LOW = (torch.float32, torch.bfloat16, torch.float16)


def exact_arrays(min_magnitude: float = 1e-3, max_magnitude: float = 6e4):
    """float64 arrays of zeros and normal-range values every output dtype can represent."""
    values = st.floats(-max_magnitude, max_magnitude, allow_nan=False).filter(
        lambda v: v == 0 or abs(v) >= min_magnitude)
    return hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=values)


@pytest.mark.parametrize("dtype, value, spacing", [
    (torch.float32, 1.0, 2.0 ** -23), (torch.float32, 1.5, 2.0 ** -23), (torch.float32, 2.0, 2.0 ** -22),
    (torch.bfloat16, 1.0, 2.0 ** -7), (torch.bfloat16, -3.0, 2.0 ** -6),
    (torch.float16, 1.0, 2.0 ** -10), (torch.float16, 65504.0, 32.0),
    (torch.float16, 1e-6, 2.0 ** -24),                       # subnormal: fixed spacing
    (torch.float32, 0.0, 2.0 ** -149), (torch.bfloat16, 1e-40, 2.0 ** -133),
])
def test_ulp_is_the_dtype_spacing_at_the_value(dtype, value, spacing):
    assert float(ulp(torch.tensor([value], dtype=torch.float64), dtype)) == spacing


@given(exact_arrays(), st.sampled_from(LOW))
def test_the_exact_value_rounded_to_the_dtype_is_the_rounding_floor(values, dtype):
    exact = torch.from_numpy(values)
    m = error_metrics(exact.to(dtype), exact, dtype)
    assert m["rounding_floor_ratio"] == 1.0
    assert m["ulp_max"] <= 0.5                 # round to nearest: at most half a spacing
    assert m["nonfinite"] == m["overflow"] == 0


@given(exact_arrays(1.0, 200.0), st.integers(-8, 8), st.sampled_from(LOW))
def test_relative_metrics_do_not_change_when_everything_scales_by_a_power_of_two(values, k, dtype):
    # Magnitudes in [1, 200] scaled by 2^-8..2^8 stay normal and finite in every dtype.
    exact = torch.from_numpy(values)
    actual = exact * (1 + 2.0 ** -9)
    a = error_metrics(actual, exact, dtype)
    b = error_metrics(actual * 2.0 ** k, exact * 2.0 ** k, dtype)
    for key in ("max_rel", "normwise_rel", "ulp_max"):
        assert b[key] == pytest.approx(a[key], rel=1e-12, abs=0)
    assert b["max_abs"] == pytest.approx(a["max_abs"] * 2.0 ** k, rel=1e-12)


def test_metrics_of_a_constructed_case():
    exact = torch.tensor([1.0, -2.0, 4.0, 0.0], dtype=torch.float64)
    actual = torch.tensor([1.0, -2.0 + 2 ** -10, 4.0, 2 ** -12], dtype=torch.float32)
    m = error_metrics(actual, exact, torch.float32)
    rms = math.sqrt((1 + 4 + 16) / 4)
    floor = DEFAULT_REL_FLOOR_FRACTION * rms
    assert m["rel_floor"] == floor
    assert m["max_abs"] == 2 ** -10
    assert m["max_rel"] == max(2 ** -10 / 2, 2 ** -12 / floor)
    assert m["normwise_rel"] == pytest.approx(math.hypot(2 ** -10, 2 ** -12) / math.sqrt(21))
    # At |exact| = 2 the spacing is 2^-22; the 0 entry is measured at the floor (in [2^-9, 2^-8):
    # spacing 2^-32), where its 2^-12 error is the larger count.
    assert 2 ** -9 <= floor < 2 ** -8
    assert m["ulp_max"] == max((2 ** -10) / 2 ** -22, 2 ** -12 / 2 ** -32)
    # Every exact value is representable: the rounding floor is 0 and the error is not.
    assert m["rounding_floor_ratio"] == math.inf


def test_an_explicit_floor_is_used_as_given():
    exact = torch.tensor([0.0, 1.0], dtype=torch.float64)
    actual = torch.tensor([1e-3, 1.0])
    assert error_metrics(actual, exact, torch.float32, rel_floor=0.5)["max_rel"] == \
        pytest.approx(float(torch.tensor(1e-3)) / 0.5)


def test_nan_where_a_finite_value_is_owed_makes_every_metric_inf():
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    m = error_metrics(torch.tensor([1.0, math.nan]), exact, torch.float32)
    assert m["nonfinite"] == 1
    assert all(m[k] == math.inf for k in ("max_abs", "max_rel", "normwise_rel", "ulp_max",
                                           "rounding_floor_ratio"))


def test_values_beyond_the_dtype_range_are_counted_not_measured():
    exact = torch.tensor([1.0, 70000.0, -1e6], dtype=torch.float64)
    actual = torch.tensor([1.0, math.inf, -math.inf], dtype=torch.float16)
    m = error_metrics(actual, exact, torch.float16)
    assert (m["overflow"], m["nonfinite"], m["count"], m["max_abs"]) == (2, 0, 1, 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_overflow_boundary_is_where_rounding_to_nearest_reaches_inf(dtype):
    """Between max and max + half an ulp the correctly rounded value is max: a finite answer is
    owed there (fp16: 65504 < 65510 < 65520); from the boundary on, the answer is inf."""
    boundary = overflow_threshold(dtype)
    fi = torch.finfo(dtype)
    below = torch.tensor([fi.max, (fi.max + boundary) / 2, -(fi.max + boundary) / 2],
                         dtype=torch.float64)
    assert torch.isfinite(below.to(dtype)).all()           # torch's own rounding agrees
    assert not torch.isfinite(torch.tensor([boundary], dtype=torch.float64).to(dtype)).any()
    assert owed_finite(below, dtype).all()
    assert not owed_finite(torch.tensor([boundary, -boundary, math.inf]), dtype).any()
    assert overflow_threshold(torch.float64) == math.inf     # float64 exact values: all owed
    if dtype == torch.float16:
        assert boundary == 65520.0
        # An Inf there is a wrong answer, not an overflow.
        m = error_metrics(torch.tensor([math.inf], dtype=dtype),
                          torch.tensor([65510.0], dtype=torch.float64), dtype)
        assert (m["overflow"], m["nonfinite"]) == (0, 1)


def test_mismatched_shapes_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="actual: expected shape"):
        error_metrics(torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        error_metrics(torch.zeros(3), torch.zeros(3, dtype=torch.float64), torch.int32)


def test_the_tolerance_table_covers_every_stage_in_float32_and_out_in_every_dtype():
    for stage in tolerances.STAGES:
        tol = tolerances.tolerance(stage, torch.float32)
        assert tol.k >= 1 and tol.floor > 0
        assert tol.allowed(1e-6) == tol.k * 1e-6 + tol.floor
    for dtype in LOW:
        assert tolerances.tolerance("out", dtype).k >= 1
    with pytest.raises(ValueError, match="stage"):
        tolerances.tolerance("nonsense", torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        tolerances.tolerance("dt", torch.float16)


def test_relation_tolerance_scales_with_the_output_and_keeps_a_floor():
    assert tolerances.relation_tolerance(torch.bfloat16, 0.0) == torch.finfo(torch.bfloat16).tiny
    assert tolerances.relation_tolerance(torch.float32, 2.0) == pytest.approx(
        2 * tolerances.relation_tolerance(torch.float32, 1.0), rel=1e-9)
