"""Tier 1: the plain recurrence in mpmath at a chosen precision, on selected (batch, head, row) slices.

One slice is one headdim row p of one head h of one batch row b: its state row h_t[p, :] (dstate
values) evolves on its own, so a slice needs only x[b, :, h, p], dt[b, :, h], A[h], B and C of its
group, and nothing else. Every input element is the problem's own rounded value, converted exactly
(``mpf(float(v))`` of the float64 upcast); dt's bias, softplus (log1p(exp(v)), no identity switch)
and limit, the decay exp(dt * A), D and the silu gate are all evaluated in mpmath, so the only
error left is the working precision's. Cost, at 50 digits on the 2-core CI machine: 3-6 us per
multiply-add (one slice, one step, one state entry) with the input conversions, i.e. 0.05-0.1 s
per slice of 1000 steps with dstate 16; ``self_check`` about doubles it.

Results are mpf values at the working precision (``SliceResult``); ``MpmathResult.float64()`` rounds
them to float64 tensors and ``MpmathResult.pick(ssd_result)`` takes the same slices out of another
tier's ``SSDResult`` in the same layout, so tiers compare with one call.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import mpmath
import torch

from kernels.contract import SSDProblem
from oracles.common import (OracleBudgetError, PreparedInputs, SSDResult, check_positions, prepare,
                            varlen_ends)

DEFAULT_DPS = 50
# About 15-30 s at 50 digits on the CI machine (per run; self_check adds a run at twice the digits).
DEFAULT_MAX_COST = 5_000_000

Slice = tuple[int, int, int]  # (batch row b, head h, headdim row p)


@dataclass(frozen=True)
class SliceResult:
    """One slice's results as mpf lists: out (L,); final_state (N,); states (len(positions), N) =
    h[p, :] after positions[k] steps (pre-reset); varlen_states (nseq, N) when cu_seqlens is given."""

    out: list
    final_state: list
    states: list
    varlen_states: Optional[list]


@dataclass(frozen=True)
class SelfCheck:
    """The largest difference between the run at ``dps`` and a rerun at ``check_dps`` digits, over
    every value returned; ``max_rel_diff`` divides each quantity's differences by its largest
    magnitude (so a value that is 0 up to cancellation does not blow it up)."""

    dps: int
    check_dps: int
    max_abs_diff: mpmath.mpf
    max_rel_diff: mpmath.mpf


@dataclass(frozen=True)
class MpmathResult:
    """Per-slice mpf results at ``dps`` digits, in the order of ``slices``."""

    slices: tuple[Slice, ...]
    positions: tuple[int, ...]
    dps: int
    results: tuple[SliceResult, ...]
    self_check: Optional[SelfCheck] = None

    def float64(self) -> dict[str, torch.Tensor]:
        """out (S, L), final_states (S, N), states (S, K, N), varlen_states (S, nseq, N) in float64
        (absent keys: not requested); S = len(slices), rounded to nearest from the mpf values."""
        f = lambda rows: torch.tensor([[float(v) for v in r] for r in rows], dtype=torch.float64)  # noqa: E731
        nested = lambda rows: torch.stack([f(r) for r in rows])  # noqa: E731
        got = {"out": f([r.out for r in self.results]),
               "final_states": f([r.final_state for r in self.results])}
        if self.positions:
            got["states"] = nested([r.states for r in self.results])
        if self.results[0].varlen_states is not None:
            got["varlen_states"] = nested([r.varlen_states for r in self.results])
        return got

    def pick(self, result: SSDResult) -> dict[str, torch.Tensor]:
        """The same slices of another tier's result, in ``float64()``'s layout and keys (float64,
        CPU). ``result.states`` must be for the same positions."""
        got = {"out": torch.stack([result.out[b, :, h, p] for b, h, p in self.slices]),
               "final_states": torch.stack([result.final_states[b, h, p] for b, h, p in self.slices])}
        if self.positions:
            if result.positions is None or list(result.positions) != list(self.positions):
                raise ValueError(f"result.positions: expected {list(self.positions)}, "
                                 f"got {result.positions}")
            got["states"] = torch.stack([result.states[b, :, h, p] for b, h, p in self.slices])
        if self.results[0].varlen_states is not None:
            got["varlen_states"] = torch.stack(
                [result.varlen_states[:, h, p] for _, h, p in self.slices])
        return {k: v.detach().to("cpu", torch.float64) for k, v in got.items()}


def sample_slices(problem: SSDProblem, count: int, seed: int = 0) -> list[Slice]:
    """``count`` distinct slices drawn from ``seed``, always including the first and the last
    (index mistakes show at the edges); sorted."""
    b, H, P = problem.batch, problem.nheads, problem.headdim
    total = b * H * P
    count = min(count, total)
    corners = {0, total - 1}
    rest = [i for i in range(total) if i not in corners]
    picked = sorted(corners | set(random.Random(seed).sample(rest, max(0, count - len(corners)))))
    return [(i // (H * P), (i // P) % H, i % P) for i in picked[:count]]


def _mp_rows(t: torch.Tensor) -> list:
    """mpf of each element (exact: float64 holds every fp32/fp16/bf16 value) as nested lists."""
    return [[mpmath.mpf(v) for v in row] for row in t.tolist()] if t.dim() == 2 else \
        [mpmath.mpf(v) for v in t.tolist()]


def _one_slice(problem: SSDProblem, b: int, h: int, p: int) -> SSDProblem:
    """The problem cut down to batch row b, head h, headdim row p (batch, nheads, headdim and ngroups
    all 1): a slice's recurrence reads nothing else, so the semantics are unchanged, and only the
    slice's inputs are ever upcast or copied off the device."""
    g = h // (problem.nheads // problem.ngroups)
    init, D = problem.initial_states, problem.D
    if init is not None:
        lead = slice(None) if problem.per_sequence_initial_states else slice(b, b + 1)
        init = init[lead, h:h + 1, p:p + 1]
    if D is not None:
        D = D[h:h + 1] if D.dim() == 1 else D[h:h + 1, p:p + 1]
    row, head, ch, grp = slice(b, b + 1), slice(h, h + 1), slice(p, p + 1), slice(g, g + 1)
    maybe = lambda t, *index: None if t is None else t[index]  # noqa: E731
    return problem.with_tensors(
        x=problem.x[row, :, head, ch], z=maybe(problem.z, row, slice(None), head, ch),
        dt=problem.dt[row, :, head], A=problem.A[head], dt_bias=maybe(problem.dt_bias, head),
        B=problem.B[row, :, grp], C=problem.C[row, :, grp], D=D, initial_states=init,
        seq_idx=maybe(problem.seq_idx, row))


def _dt_mp(problem: SSDProblem) -> list:
    """dt of a one-slice problem after bias, softplus and limit, in mpmath from the rounded inputs."""
    dt = _mp_rows(problem.dt[0, :, 0].to("cpu", torch.float64))
    if problem.dt_bias is not None:
        bias = mpmath.mpf(float(problem.dt_bias[0]))
        dt = [v + bias for v in dt]
    if problem.dt_softplus:
        dt = [mpmath.log1p(mpmath.exp(v)) for v in dt]
    if problem.has_dt_limit:
        lo, hi = (mpmath.mpf(v) for v in problem.dt_limit)
        dt = [min(max(v, lo), hi) for v in dt]
    return dt


def _start_row(inp: PreparedInputs, t: int, dstate: int) -> list:
    """The state row a one-slice problem's sequence starting at t begins from."""
    start = inp.start_state(0, t)
    return [mpmath.mpf(0)] * dstate if start is None else _mp_rows(start[0, 0])


def _run(problem: SSDProblem, slices: Sequence[Slice], positions: Sequence[int]) -> list[SliceResult]:
    L, N = problem.seqlen, problem.dstate
    want = {p: k for k, p in enumerate(positions)}
    ends = varlen_ends(problem)
    end_index = {} if ends is None else {e: k for k, e in enumerate(ends)}
    # dt and the decay depend on (b, h) only, B and C on (b, group): converted once per call.
    dt_cache, bc_cache = {}, {}
    results = []
    for b, h, p in slices:
        inp = prepare(_one_slice(problem, b, h, p), dtype=torch.float64, device="cpu")
        if (b, h) not in dt_cache:
            dt = _dt_mp(inp.problem)
            A = mpmath.mpf(float(inp.A[0]))
            dt_cache[(b, h)] = (dt, [mpmath.exp(v * A) for v in dt])
        dt, decay = dt_cache[(b, h)]
        g = h // (problem.nheads // problem.ngroups)
        if (b, g) not in bc_cache:
            bc_cache[(b, g)] = (_mp_rows(inp.B[0, :, 0]), _mp_rows(inp.C[0, :, 0]))
        B, C = bc_cache[(b, g)]
        x = _mp_rows(inp.x[0, :, 0, 0])
        resets = set(inp.reset[0, 1:].nonzero().flatten().add(1).tolist())
        state = _start_row(inp, 0, N)
        states = [None] * len(want)
        varlen = None if ends is None else [None] * len(ends)
        y = []
        for t in range(L):
            # state lists are replaced, never mutated, so recording a reference is a snapshot.
            if t in want:
                states[want[t]] = state
            if t in resets:
                state = _start_row(inp, t, N)
            a, u = decay[t], dt[t] * x[t]
            state = [a * s + u * bn for s, bn in zip(state, B[t])]
            y.append(mpmath.fdot(state, C[t]))
            if t in end_index:
                varlen[end_index[t]] = state
        if L in want:
            states[want[L]] = state
        if inp.D is not None:
            d = mpmath.mpf(float(inp.D[0, 0]))
            y = [yt + d * xt for yt, xt in zip(y, x)]
        if inp.z is not None:
            z = _mp_rows(inp.z[0, :, 0, 0])
            y = [yt * zt / (1 + mpmath.exp(-zt)) for yt, zt in zip(y, z)]
        results.append(SliceResult(out=y, final_state=state, states=states, varlen_states=varlen))
    return results


def _max_diffs(low: list[SliceResult], high: list[SliceResult]) -> tuple[mpmath.mpf, mpmath.mpf]:
    """Largest |low - high| and that divided by each quantity's largest |high|, over all values."""
    max_abs = max_rel = mpmath.mpf(0)
    for lo, hi in zip(low, high):
        for a, b in ((lo.out, hi.out), (lo.final_state, hi.final_state),
                     *zip(lo.states, hi.states), *zip(lo.varlen_states or (), hi.varlen_states or ())):
            diff = max((abs(u - v) for u, v in zip(a, b)), default=mpmath.mpf(0))
            scale = max((abs(v) for v in b), default=mpmath.mpf(0))
            max_abs = max(max_abs, diff)
            if diff:
                max_rel = max(max_rel, diff / scale)
    return max_abs, max_rel


def mpmath_ssd(problem: SSDProblem, slices: Sequence[Slice], positions: Optional[Sequence[int]] = None,
               dps: int = DEFAULT_DPS, self_check: bool = False,
               max_cost: int = DEFAULT_MAX_COST) -> MpmathResult:
    """The recurrence at ``dps`` digits for each (b, h, p) in ``slices``, all time steps.

    ``positions``: report h[p, :] after each of these step counts (0: the row's starting state;
    others pre-reset), like ``sequential_ssd``. ``self_check`` reruns at 2 * dps digits and records
    the largest difference in ``result.self_check``. Raises OracleBudgetError when
    len(slices) * seqlen * dstate exceeds ``max_cost``.
    """
    slices = [tuple(int(i) for i in s) for s in slices]
    if not slices:
        raise ValueError("slices: expected at least one (batch, head, headdim row), got none")
    for s in slices:
        if len(s) != 3 or not all(0 <= i < n for i, n in
                                  zip(s, (problem.batch, problem.nheads, problem.headdim))):
            raise ValueError(f"slices: expected (b, h, p) with b < {problem.batch}, "
                             f"h < {problem.nheads}, p < {problem.headdim}, got {s}")
    positions = check_positions(problem, positions)
    cost = len(slices) * problem.seqlen * problem.dstate
    if cost > max_cost:
        raise OracleBudgetError(
            f"mpmath_ssd: {len(slices)} slices * seqlen {problem.seqlen} * dstate {problem.dstate} = "
            f"{cost:,} multiply-adds exceeds max_cost={max_cost:,} (3-6 us each at 50 digits); "
            "pass fewer slices, a shorter seqlen or a smaller dstate, or raise max_cost")
    with mpmath.workdps(dps):
        results = _run(problem, slices, positions)
    check = None
    if self_check:
        with mpmath.workdps(2 * dps):
            max_abs, max_rel = _max_diffs(results, _run(problem, slices, positions))
        check = SelfCheck(dps=dps, check_dps=2 * dps, max_abs_diff=max_abs, max_rel_diff=max_rel)
    return MpmathResult(slices=tuple(slices), positions=tuple(positions), dps=dps,
                        results=tuple(results), self_check=check)
