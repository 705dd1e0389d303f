"""Deliberately broken implementations whose bug sits in one known stage.

The property tests and ``mamba2-cutile repro`` must catch each and, for the repro, name the stage
the bug is in. Contract signature (``--impl tests.broken_stages:<name>``); each returns an
``SSDResult`` with its stages. Both are the fp32 chunked reference with one plausible kernel bug.
"""
from __future__ import annotations

import torch

from kernels.contract import validate
from oracles.chunked_reference import chunk_cumsum, compute_out, fwd_pass_state
from oracles.common import SSDResult, prepare


def exclusive_decay_cumsum(*args, **kwargs) -> SSDResult:
    """Stage 1 bug: an exclusive scan where the layout says inclusive (each position misses its
    own step's decay); the later stages consume it faithfully."""
    problem = validate(*args, **kwargs)
    inp = prepare(problem, dtype=torch.float32)
    ch = chunk_cumsum(inp, problem.chunk_size)
    ch.log2_decay_cumsum = ch.log2_decay_cumsum - ch.log2_decay
    starts = inp.x.new_zeros(problem.batch, problem.nheads, problem.headdim, problem.dstate)
    for row in range(problem.batch):
        start = inp.start_state(row, 0)
        if start is not None:
            starts[row] = start
    chunk_states, final_states = fwd_pass_state(ch, starts, torch.float32)
    out = compute_out(ch, chunk_states, inp, problem.x.dtype)
    return SSDResult(out=out, final_states=final_states,
                     stages={"dt": ch.dt, "log2_decay_cumsum": ch.log2_decay_cumsum,
                             "chunk_states": chunk_states})


def causal_mask_off_by_one(*args, **kwargs) -> SSDResult:
    """Stage 3 bug: the intra-chunk mask lets position i see j <= i + 1, so each output also gets
    the next position's term C_i . B_{i+1} dt_{i+1} x_{i+1} 2^(S_i - S_{i+1}) (same chunk)."""
    from properties.impls import get_impl  # noqa: PLC0415
    problem = validate(*args, **kwargs)
    result = get_impl("reference")(problem)
    inp = prepare(problem, dtype=torch.float32)
    Q, L = problem.chunk_size, problem.seqlen
    rep = inp.heads_per_group
    B = inp.B.repeat_interleave(rep, dim=2)                                # (b, L, H, N)
    C = inp.C.repeat_interleave(rep, dim=2)
    step = inp.dt * inp.A * 1.4426950408889634                             # (b, L, H)
    i = torch.arange(L - 1)
    same_chunk = ((i // Q) == ((i + 1) // Q)).to(inp.x.dtype)[None, :, None]
    weight = torch.exp2(-step[:, 1:]) * inp.dt[:, 1:] * same_chunk        # (b, L-1, H)
    leak = torch.einsum("blhn,blhn->blh", C[:, :-1], B[:, 1:]) * weight
    extra = torch.zeros_like(inp.x)
    extra[:, :-1] = leak[..., None] * inp.x[:, 1:]
    if inp.z is not None:
        extra = extra * inp.z * torch.sigmoid(inp.z)
    result.out = (result.out.float() + extra).to(problem.x.dtype)
    return result


exclusive_decay_cumsum.exposes_stages = True
causal_mask_off_by_one.exposes_stages = True
