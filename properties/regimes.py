"""Named input regimes: each is a documented distribution of dt, A and magnitudes of x, B, C.

Every draw comes from a CPU ``torch.Generator`` seeded by the caller, so a (regime, seed) pair
names the same tensors on every machine (see ``properties.problems.build_problem``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Regime:
    """dt ~ logUniform[dt_range] per (position, head); A ~ -logUniform[neg_A_range] per head.

    Magnitudes scale x, B, C (and the initial state) after a standard normal draw; ``dt_offset``
    shifts raw dt before the (optional) bias and softplus, to place it in the softplus tail.
    ``dt_limit``: the clamp the regime is built around (recipes drawing it pass it as their
    ``dt_limit``); ``x_dtypes``: the x/out dtypes it is meant for (empty: any), where its
    magnitudes sit at one dtype's range limits.
    """

    name: str
    doc: str
    dt_range: tuple[float, float] = (1e-3, 0.1)
    neg_A_range: tuple[float, float] = (1.0, 16.0)
    x_scale: float = 1.0
    bc_scale: float = 1.0
    state_scale: float = 1.0
    dt_offset: float = 0.0
    dt_limit: Optional[tuple[float, float]] = None
    x_dtypes: tuple[str, ...] = ()


def _log_uniform(gen: torch.Generator, shape, lo: float, hi: float) -> torch.Tensor:
    u = torch.rand(shape, generator=gen, dtype=torch.float64, device=gen.device)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


def draw_dt(regime: Regime, gen: torch.Generator, shape) -> torch.Tensor:
    return _log_uniform(gen, shape, *regime.dt_range) + regime.dt_offset


def draw_A(regime: Regime, gen: torch.Generator, nheads: int) -> torch.Tensor:
    return -_log_uniform(gen, (nheads,), *regime.neg_A_range)


REGIMES: dict[str, Regime] = {r.name: r for r in (
    Regime("mamba2_init", "Mamba-2 initialisation: A in [-16, -1], dt in [1e-3, 0.1]."),
    Regime("strong_decay", "|dt*A| per step up to 50 and beyond: exp underflows to 0 within a step.",
           dt_range=(0.5, 4.0), neg_A_range=(4.0, 16.0)),
    Regime("near_unit_decay", "|dt*A| ~ 1e-7..1e-4: states accumulate over 10^4+ steps.",
           dt_range=(1e-5, 1e-3), neg_A_range=(1e-2, 0.1)),
    Regime("large_magnitude", "x, B, C around 1e3: outputs near the top of fp16's range.",
           x_scale=1e3, bc_scale=30.0),
    Regime("tiny_magnitude", "x, B, C around 1e-4: products near fp16's subnormals.",
           x_scale=1e-4, bc_scale=1e-3),
    Regime("large_initial_state", "initial states 1e3 times larger than the inputs' contribution.",
           state_scale=1e3),
    Regime("softplus_edge", "dt + dt_bias above 20, where softplus may switch to the identity.",
           dt_range=(1e-3, 5.0), dt_offset=20.0, neg_A_range=(1e-3, 1e-2)),
    # With unit x, B, C the output's RMS is ~0.3-0.8 and its max ~2-6 (dstate 16-64, mamba2_init
    # decays); it scales as x_scale * bc_scale^2. The three below place it at a dtype's limits.
    Regime("dt_limit_bounds", "dt log-uniform on [2.5e-4, 0.4] around dt_limit (1e-3, 0.1): about "
           "a fifth of the steps clamped low, a fifth high.",
           dt_range=(2.5e-4, 0.4), dt_limit=(1e-3, 0.1)),
    Regime("fp16_overflow", "x ~ 150, B, C ~ 20: output RMS ~ 2e4, its largest entries past fp16's "
           "max 65504 (the correctly rounded answer there is inf); inputs stay finite in fp16.",
           x_scale=150.0, bc_scale=20.0, x_dtypes=("fp16",)),
    Regime("fp16_subnormal", "x ~ 2e-2, B, C ~ 1e-2: outputs ~ 1e-6, inside fp16's subnormal "
           "range [6e-8, 6.1e-5); inputs are normal fp16 numbers.",
           x_scale=2e-2, bc_scale=1e-2, state_scale=1e-4, x_dtypes=("fp16",)),
    Regime("fp32_subnormal", "x ~ 1e-19, B, C ~ 1e-10: outputs ~ 1e-40, inside the subnormal range "
           "of fp32 and bf16 (below 1.2e-38), where a GPU may flush to zero.",
           x_scale=1e-19, bc_scale=1e-10, state_scale=1e-30, x_dtypes=("fp32", "bf16")),
)}
