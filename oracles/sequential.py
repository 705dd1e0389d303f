"""Tier 2: the recurrence in float64, one time step at a time, vectorized over everything else.

The decay is exp(dt * A) of the float64 product (log space), never a product of rounded decays.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.contract import SSDProblem
from oracles.common import SSDResult, check_positions, finish_output, prepare, varlen_ends


def sequential_ssd(problem: SSDProblem, positions: Optional[Sequence[int]] = None,
                   dtype=torch.float64, device=None) -> SSDResult:
    """out (b, L, H, P), final_states (b, H, P, N), states after ``positions`` steps, varlen states."""
    if positions is not None:
        positions = check_positions(problem, positions)
    inp = prepare(problem, dtype=dtype, device=device)
    b, L, H, P = inp.x.shape
    N = inp.B.shape[3]
    rep = inp.heads_per_group
    B = inp.B.repeat_interleave(rep, dim=2)   # (b, L, H, N)
    C = inp.C.repeat_interleave(rep, dim=2)
    decay = torch.exp(inp.dt * inp.A)           # (b, L, H)
    # The state after 0 steps is the row's starting state; later recorded states are pre-reset.
    h = inp.x.new_zeros(b, H, P, N)
    for row in range(b):
        start = inp.start_state(row, 0)
        if start is not None:
            h[row] = start
    want = {} if positions is None else {int(p): k for k, p in enumerate(positions)}
    states = inp.x.new_zeros(b, len(want), H, P, N) if positions is not None else None
    ends = varlen_ends(problem)
    end_index = {} if ends is None else {e: k for k, e in enumerate(ends)}
    varlen = inp.x.new_zeros(len(ends), H, P, N) if ends is not None else None
    y = torch.empty_like(inp.x)
    resets = inp.reset.cpu()
    for t in range(L):
        if t in want:
            states[:, want[t]] = h
        for row in resets[:, t].nonzero().flatten().tolist() if t > 0 else ():
            start = inp.start_state(row, t)
            h[row] = 0.0 if start is None else start
        h = decay[:, t, :, None, None] * h + \
            (inp.dt[:, t, :, None] * inp.x[:, t])[..., None] * B[:, t, :, None, :]
        y[:, t] = torch.einsum("bhpn,bhn->bhp", h, C[:, t])
        if t in end_index:
            varlen[end_index[t]] = h[0]
    if L in want:
        states[:, want[L]] = h
    return SSDResult(out=finish_output(inp, y), final_states=h.clone(), varlen_states=varlen,
                     states=states, positions=None if positions is None else list(positions))
