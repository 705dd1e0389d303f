"""Tier 3: every hidden state at once, by a doubling (Hillis-Steele) scan over time, in torch.

One step h_t = a_t h_{t-1} + u_t is the pair (a_t, u_t); applying (a1, u1) then (a2, u2) is
(a2 a1, a2 u1 + u2), an associative combine, so log2(seqlen) rounds of "combine with the pair d
steps back" (d = 1, 2, 4, ...) turn every u_t into h_t. The decay of a span is kept as its log
(a sum of dt * A), exponentiated once per round, never a product of rounded decays. A reset sets
the log-decay to -inf (nothing before it is carried) and folds the decayed start state into u_t.
It materializes all states: memory ~ 3 * batch * seqlen * nheads * headdim * dstate * itemsize
(an upper bound: the states plus one round's carried term, 2.06x, measured on an H200).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.contract import SSDProblem
from oracles.common import (OracleBudgetError, SSDResult, check_positions, finish_output, prepare,
                            varlen_ends)

DEFAULT_MAX_BYTES = 2 * 2**30
# The states, the carried term of one round, and slack for the temporaries around them.
MEMORY_FACTOR = 3


def scan_bytes(problem: SSDProblem, dtype=torch.float64) -> int:
    """Bytes ``parallel_scan_ssd`` needs at its peak (an estimate from above)."""
    elems = problem.batch * problem.seqlen * problem.nheads * problem.headdim * problem.dstate
    return MEMORY_FACTOR * elems * torch.empty((), dtype=dtype).element_size()


def parallel_scan_ssd(problem: SSDProblem, positions: Optional[Sequence[int]] = None,
                      dtype=torch.float64, device=None,
                      max_bytes: int = DEFAULT_MAX_BYTES) -> SSDResult:
    """out (b, L, H, P), final_states (b, H, P, N), states after ``positions`` steps, varlen states.

    Same results and conventions as ``sequential_ssd``; dtype float64 or float32, any device.
    Raises OracleBudgetError when ``scan_bytes`` exceeds ``max_bytes``.
    """
    need = scan_bytes(problem, dtype)
    if need > max_bytes:
        raise OracleBudgetError(
            f"parallel_scan_ssd: materializing every state needs ~{need / 2**30:.2f} GiB "
            f"({MEMORY_FACTOR} x batch {problem.batch} x seqlen {problem.seqlen} x nheads "
            f"{problem.nheads} x headdim {problem.headdim} x dstate {problem.dstate} x "
            f"{torch.empty((), dtype=dtype).element_size()} bytes), over max_bytes="
            f"{max_bytes / 2**30:.2f} GiB; shrink batch, seqlen, nheads, headdim or dstate, use "
            "dtype=torch.float32, or raise max_bytes")
    want = check_positions(problem, positions)
    inp = prepare(problem, dtype=dtype, device=device)
    b, L, H, P = inp.x.shape
    rep = inp.heads_per_group
    B = inp.B.repeat_interleave(rep, dim=2)   # (b, L, H, N)
    C = inp.C.repeat_interleave(rep, dim=2)
    log_decay = inp.dt * inp.A                 # (b, L, H)
    h = (inp.dt[..., None] * inp.x)[..., None] * B[:, :, :, None, :]   # (b, L, H, P, N): u_t
    for row, t in inp.reset.nonzero().tolist():
        start = inp.start_state(row, t)
        if start is not None:
            h[row, t] += torch.exp(log_decay[row, t])[:, None, None] * start
    log_decay = log_decay.masked_fill(inp.reset[..., None], -torch.inf)
    d = 1
    while d < L:
        carried = torch.exp(log_decay[:, d:])[..., None, None] * h[:, :-d]
        # Across a reset nothing is carried, not even a NaN/Inf of the previous sequence (0 * inf).
        carried.masked_fill_(torch.isneginf(log_decay[:, d:])[..., None, None], 0.0)
        h[:, d:] += carried
        log_decay[:, d:] = log_decay[:, d:] + log_decay[:, :-d]
        d *= 2
        del carried
    y = torch.einsum("blhpn,blhn->blhp", h, C)
    states = None
    if positions is not None:
        states = h.new_zeros(b, len(want), H, P, inp.B.shape[3])
        for k, pos in enumerate(want):
            if pos > 0:
                states[:, k] = h[:, pos - 1]   # pre-reset: h after pos steps is h_{pos-1}
                continue
            for row in range(b):
                start = inp.start_state(row, 0)
                if start is not None:
                    states[row, k] = start
    ends = varlen_ends(problem)
    varlen = None if ends is None else h[0, ends].clone()
    return SSDResult(out=finish_output(inp, y), final_states=h[:, -1].clone(), varlen_states=varlen,
                     states=states, positions=None if positions is None else list(positions))
