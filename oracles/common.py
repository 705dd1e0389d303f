"""What every oracle tier shares: exact upcasting, the dt transform, resets, and the result type."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kernels.contract import SSDProblem

LOG2_E = 1.4426950408889634


class OracleBudgetError(RuntimeError):
    """An oracle refuses a problem past its cost budget; the message says how to shrink it."""


def check_positions(problem: SSDProblem, positions: Optional[Sequence[int]]) -> list[int]:
    """``positions`` as distinct ints, each a step count in [0, seqlen]; [] for None."""
    positions = [] if positions is None else [int(p) for p in positions]
    if any(not 0 <= p <= problem.seqlen for p in positions):
        raise ValueError(f"positions: expected step counts in [0, {problem.seqlen}], got {positions}")
    if len(set(positions)) != len(positions):
        raise ValueError(f"positions: expected distinct step counts, got {positions}")
    return positions


@dataclass
class SSDResult:
    """What every tier returns. ``states`` holds h after ``positions[k]`` steps (pre-reset).

    out (batch, seqlen, nheads, headdim); final_states (batch, nheads, headdim, dstate);
    varlen_states (nseq, nheads, headdim, dstate) or None; states (batch, len(positions), nheads,
    headdim, dstate) or None. Oracles return them in their compute dtype; ``stages`` holds the
    named intermediate results of implementations that expose them (see chunked_reference).
    """

    out: torch.Tensor
    final_states: torch.Tensor
    varlen_states: Optional[torch.Tensor] = None
    states: Optional[torch.Tensor] = None
    positions: Optional[Sequence[int]] = None
    stages: dict = field(default_factory=dict)


def softplus_exact(v: torch.Tensor) -> torch.Tensor:
    """log(1 + e^v) without overflow or cancellation, in v's dtype."""
    return torch.where(v > 0, v + torch.log1p(torch.exp(-v.abs())), torch.log1p(torch.exp(-v.abs())))


@dataclass
class PreparedInputs:
    """The problem's tensors upcast exactly to one compute dtype, dt already transformed.

    x, z (b, L, H, P); dt (b, L, H); A (H,); B, C (b, L, G, N); D (H, P) or None.
    reset (b, L) bool: the state before position t is replaced by ``start_state(b, t)``.
    """

    problem: SSDProblem
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: Optional[torch.Tensor]
    z: Optional[torch.Tensor]
    seq_idx: Optional[torch.Tensor]
    reset: torch.Tensor
    initial_states: Optional[torch.Tensor]

    @property
    def heads_per_group(self) -> int:
        return self.x.shape[2] // self.B.shape[2]

    def start_state(self, b: int, t: int) -> Optional[torch.Tensor]:
        """The state (H, P, N) a sequence starting at (b, t) begins from; None means zeros."""
        p = self.problem
        if self.initial_states is None:
            return None
        if p.per_sequence_initial_states:
            return self.initial_states[int(self.seq_idx[0, t])]
        return self.initial_states[b] if t == 0 else None


def step_sizes(problem: SSDProblem, dtype=torch.float64, device=None) -> torch.Tensor:
    """The steps dt (b, L, H) after the call's bias, softplus and limit, computed in ``dtype``
    from its inputs upcast exactly."""
    device = problem.device if device is None else device
    dt = problem.dt.to(device=device, dtype=dtype)
    if problem.dt_bias is not None:
        dt = dt + problem.dt_bias.to(device=device, dtype=dtype)
    if problem.dt_softplus:
        dt = softplus_exact(dt)
    if problem.has_dt_limit:
        dt = dt.clamp(problem.dt_limit[0], problem.dt_limit[1])
    return dt


def prepare(problem: SSDProblem, dtype=torch.float64, device=None) -> PreparedInputs:
    """Upcast every input exactly (dtype is float64 or float32) and apply dt's bias/softplus/limit."""
    device = problem.device if device is None else device
    up = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    dt = step_sizes(problem, dtype, device)
    D = up(problem.D)
    if D is not None and D.dim() == 1:
        D = D[:, None].expand(problem.nheads, problem.headdim)
    seq_idx = problem.resolved_seq_idx()
    b, L = problem.batch, problem.seqlen
    reset = torch.zeros(b, L, dtype=torch.bool, device=device)
    reset[:, 0] = True
    if seq_idx is not None:
        seq_idx = seq_idx.to(device)
        reset[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return PreparedInputs(problem=problem, x=up(problem.x), dt=dt, A=up(problem.A), B=up(problem.B),
                          C=up(problem.C), D=D, z=up(problem.z), seq_idx=seq_idx, reset=reset,
                          initial_states=up(problem.initial_states))


def finish_output(inp: PreparedInputs, y: torch.Tensor) -> torch.Tensor:
    """Add the D skip and apply the z gate to y = h . C, in y's dtype."""
    if inp.D is not None:
        y = y + inp.D * inp.x
    if inp.z is not None:
        y = y * inp.z * torch.sigmoid(inp.z)
    return y


def varlen_ends(problem: SSDProblem) -> Optional[list[int]]:
    """Last position of each cu_seqlens sequence (batch row 0), or None."""
    if problem.cu_seqlens is None:
        return None
    return [int(e) - 1 for e in problem.cu_seqlens[1:].tolist()]


def chunk_boundaries(problem: SSDProblem, chunk_size: Optional[int] = None) -> list[int]:
    """Positions c*Q for every chunk c: the states entering each chunk."""
    q = problem.chunk_size if chunk_size is None else chunk_size
    return [c * q for c in range(math.ceil(problem.seqlen / q))]
