"""The chunked reference: the cuTile kernels' three-stage SSD algorithm, in torch, stage by stage.

Not an oracle tier. It computes what the kernels compute (chunks of Q positions, decays as exp2 of
differences of a per-chunk log2 cumsum), in float64 (a stand-in for the kernels) or float32 (the
baseline of the error rules: the error the algorithm makes in the kernels' own precision). Stages
and their shared layouts (b batch, H heads, P headdim, N dstate, G groups, c chunks):

    chunk_cumsum    dt, log2_decay_cumsum (b, H, c, Q), in the compute dtype
    fwd_pass_state  chunk_states (b, c, H, P, N) in state_dtype, final_states (b, H, P, N)
    compute_out     out (b, L, H, P), rounded to x's dtype at the very end

Resets (seq_idx / cu_seqlens, also mid-chunk): a sequence that begins inside a chunk (at a reset
other than the row's first position) starts from its own start state H0, decayed from just before
its first position; positions see the state carried into the chunk only while no such start has
occurred in the chunk.
"""
from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kernels.contract import SSDInputError, SSDProblem, pack_outputs, validate
from oracles.common import (LOG2_E, PreparedInputs, SSDResult, check_positions, finish_output,
                            prepare)

COMPUTE_DTYPES = (torch.float64, torch.float32)
STORAGE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ChunkedInputs:
    """The prepared inputs cut into chunks, zero-padded past seqlen, plus the reset structure.

    x (b, c, Q, H, P); B, C (b, c, Q, G, N); dt, log2_decay (the step dt*A*log2e) and
    log2_decay_cumsum (b, H, c, Q); seq (b, c, Q) sequence index; start_pos (b, c, Q) local index of
    the latest sequence start at or before each position in its chunk, -1 when there is none (the
    position continues the state carried into the chunk); start_states (nseq, H, P, N) or None
    (sequences beginning mid-row start from zeros).
    """

    x: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    log2_decay: torch.Tensor
    log2_decay_cumsum: torch.Tensor
    seq: torch.Tensor
    start_pos: torch.Tensor
    start_states: Optional[torch.Tensor]
    decay_nudge_ulps: int = 0

    def decay(self, exponent: torch.Tensor) -> torch.Tensor:
        """2^exponent; with decay_nudge_ulps = k, every decay strictly between 0 and 1 moved k
        float32/float64 ulps up (k > 0) or down (k < 0). 0 and 1 stay exact: every exp2 gets
        them right."""
        w = torch.exp2(exponent)
        if self.decay_nudge_ulps:
            toward = torch.full_like(w, math.inf if self.decay_nudge_ulps > 0 else 0.0)
            inside = (w > 0) & (w < 1)
            for _ in range(abs(self.decay_nudge_ulps)):
                w = torch.where(inside, torch.nextafter(w, toward), w)
        return w

    @property
    def chunk_size(self) -> int:
        return self.x.shape[2]

    @property
    def nchunks(self) -> int:
        return self.x.shape[1]


def _chunked(t: torch.Tensor, Q: int, fill=0) -> torch.Tensor:
    """(b, L, ...) -> (b, nchunks, Q, ...), padded past seqlen with ``fill``."""
    b, L = t.shape[:2]
    nchunks = -(-L // Q)
    padded = t.new_full((b, nchunks * Q) + tuple(t.shape[2:]), fill)
    padded[:, :L] = t
    return padded.view((b, nchunks, Q) + tuple(t.shape[2:]))


def chunk_cumsum(inp: PreparedInputs, Q: int, decay_nudge_ulps: int = 0,
                 cumsum_rounded_once: bool = False) -> ChunkedInputs:
    """Stage 1: processed dt per chunk, 0 past seqlen, and its inclusive log2 decay cumsum.
    decay_nudge_ulps: how the later stages round their decays (``ChunkedInputs.decay``).
    cumsum_rounded_once: each S accumulated in float64 from the compute dtype's steps and rounded
    once, as the kernels' hi + lo scan and torch's CPU cumsum deliver it; otherwise the device's
    cumsum in the compute dtype (CUDA's scan rounds each partial sum).

    dt comes from ``prepare``: the exact softplus in both compute dtypes. In float32 it equals
    the kernels' identity above 20, since there log1p(e^-v) < e^-20 is below half an ulp of v.
    """
    b, L, H, _ = inp.x.shape
    dt = _chunked(inp.dt, Q).permute(0, 3, 1, 2)                        # (b, H, c, Q)
    log2_decay = dt * (inp.A * LOG2_E)[:, None, None]
    seq = inp.seq_idx if inp.seq_idx is not None else inp.reset.new_zeros(b, L, dtype=torch.int64)
    # Padding continues the row's last sequence: dt = 0 there, so it neither decays nor adds.
    seq = torch.cat([seq, seq[:, -1:].expand(b, -(-L // Q) * Q - L)], dim=1).view(b, -1, Q)
    starts = _chunked(inp.reset, Q, fill=False)
    starts[:, 0, 0] = False   # the row's first sequence is the state entering chunk 0
    local = torch.arange(Q, device=starts.device)
    start_pos = torch.where(starts, local, -1).cummax(dim=-1).values
    per_sequence = inp.problem.per_sequence_initial_states
    cumsum = (log2_decay.double().cumsum(dim=-1).to(log2_decay.dtype) if cumsum_rounded_once
              else log2_decay.cumsum(dim=-1))
    return ChunkedInputs(x=_chunked(inp.x, Q), B=_chunked(inp.B, Q), C=_chunked(inp.C, Q), dt=dt,
                         log2_decay=log2_decay, log2_decay_cumsum=cumsum,
                         seq=seq, start_pos=start_pos,
                         start_states=inp.initial_states if per_sequence else None,
                         decay_nudge_ulps=decay_nudge_ulps)


def _gather_last(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t (..., Q) at index (...,) along the last dimension."""
    return t.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _state_increments(ch: ChunkedInputs, chunk: torch.Tensor, end: torch.Tensor):
    """How the state moves from entering chunk[k] to after its local position end[k].

    chunk, end (K,) int64. Returns carry_weight (b, K, H) and increment (b, K, H, P, N): the state
    after the position is carry_weight * (state entering the chunk) + increment.
    """
    b, _, Q, G, N = ch.B.shape
    H, P = ch.x.shape[3:]
    K = chunk.numel()
    S = ch.log2_decay_cumsum[:, :, chunk]                                    # (b, H, K, Q)
    S_end = _gather_last(S, end.expand(b, H, K))                             # (b, H, K)
    start = _gather_last(ch.start_pos[:, chunk], end.expand(b, K))           # (b, K)
    local = torch.arange(Q, device=end.device)
    # Only the end position's own sequence contributes: positions from its start (or the chunk's
    # first position) up to the end.
    contributes = (local <= end[:, None]) & (local >= start[..., None])      # (b, K, Q)
    exponent = torch.where(contributes[:, None], S_end[..., None] - S, -math.inf)
    weight = ch.decay(exponent) * ch.dt[:, :, chunk]                         # (b, H, K, Q)
    weighted_x = ch.x[:, chunk] * weight.permute(0, 2, 3, 1)[..., None]      # (b, K, Q, H, P)
    increment = torch.einsum("bkjgrp,bkjgn->bkgrpn", weighted_x.view(b, K, Q, G, H // G, P),
                             ch.B[:, chunk]).reshape(b, K, H, P, N)
    carried = (start < 0)[:, None]                                           # (b, 1, K)
    carry_weight = ch.decay(torch.where(carried, S_end, -math.inf)).transpose(1, 2)
    if ch.start_states is not None:
        s = start.clamp(min=0).expand(H, b, K).permute(1, 0, 2)              # (b, H, K)
        # The decay from just before the sequence's first position s: S_end - S_s + a_s <= 0.
        from_start = S_end - _gather_last(S, s) + _gather_last(ch.log2_decay[:, :, chunk], s)
        start_weight = ch.decay(torch.where(carried, -math.inf, from_start)).transpose(1, 2)
        sequence = _gather_last(ch.seq[:, chunk], end.expand(b, K))          # (b, K)
        increment = increment + start_weight[..., None, None] * ch.start_states[sequence]
    return carry_weight, increment


def fwd_pass_state(ch: ChunkedInputs, row_start_states: torch.Tensor, state_dtype: torch.dtype):
    """Stage 2: chunk_states (b, c, H, P, N) entering each chunk, in state_dtype, and the state
    after the last position (b, H, P, N) in the compute dtype, never rounded on the way."""
    chunks = torch.arange(ch.nchunks, device=ch.x.device)
    carry_weight, increment = _state_increments(
        ch, chunks, torch.full_like(chunks, ch.chunk_size - 1))
    h = row_start_states
    entering = []
    for c in range(ch.nchunks):
        entering.append(h)
        h = carry_weight[:, c, :, None, None] * h + increment[:, c]
    return torch.stack(entering, dim=1).to(state_dtype), h


def states_after(ch: ChunkedInputs, chunk_states: torch.Tensor, positions: Sequence[int]):
    """The state after p steps (pre-reset) for p in positions, (b, len(positions), H, P, N), from
    the stored chunk_states plus the partial chunk up to position p - 1, as a kernel would.
    Each position costs one chunk's contraction, Q*H*P*N."""
    stored = chunk_states.to(ch.x.dtype)
    p = torch.as_tensor(list(positions), dtype=torch.int64, device=ch.x.device)
    last = (p - 1).clamp(min=0)
    chunk, end = last // ch.chunk_size, last % ch.chunk_size
    carry_weight, increment = _state_increments(ch, chunk, end)
    states = carry_weight[..., None, None] * stored[:, chunk] + increment
    return torch.where((p == 0)[:, None, None, None], stored[:, :1], states)


def compute_out(ch: ChunkedInputs, chunk_states: torch.Tensor, inp: PreparedInputs,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Stage 3: out (b, L, H, P) from the stored chunk_states, rounded to out_dtype at the end."""
    b, c, Q, H, P = ch.x.shape
    G, N = ch.B.shape[3:]
    R = H // G
    S = ch.log2_decay_cumsum
    local = torch.arange(Q, device=S.device)
    # Position i sees j <= i of its own sequence. Mask the exponent, then exp2: masked entries
    # (positive differences, possibly huge) become exp2(-inf) = 0, never inf * 0.
    sees = (local[None, :] <= local[:, None]) & (local[None, :] >= ch.start_pos[..., None])
    exponent = torch.where(sees[:, None], S[..., :, None] - S[..., None, :], -math.inf)
    decay = ch.decay(exponent) * ch.dt[..., None, :]                       # (b, H, c, Q_i, Q_j)
    CB = torch.einsum("bcign,bcjgn->bcgij", ch.C, ch.B)
    scores = CB[:, :, :, None] * decay.view(b, G, R, c, Q, Q).permute(0, 3, 1, 2, 4, 5)
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", scores, ch.x.view(b, c, Q, G, R, P))
    carried = ch.decay(torch.where(ch.start_pos[:, None] < 0, S, -math.inf))  # (b, H, c, Q)
    stored = chunk_states.to(S.dtype).view(b, c, G, R, P, N)
    y = y + torch.einsum("bcign,bcgrpn->bcigrp", ch.C, stored) * \
        carried.view(b, G, R, c, Q).permute(0, 3, 4, 1, 2)[..., None]
    y = y.reshape(b, c * Q, H, P)
    if ch.start_states is not None:
        y = y + _start_state_out(ch, inp)
    return finish_output(inp, y[:, :inp.x.shape[1]]).to(out_dtype)


def _start_state_out(ch: ChunkedInputs, inp: PreparedInputs) -> torch.Tensor:
    """C_i . H0 . 2^(S_i - S_s + a_s) for positions i of sequences starting at s inside a chunk.

    Per-sequence start states (batch 1) only. A loop over those sequences: each brings its own
    (H, P, N) state, so gathering one per position would cost L*H*P*N memory.
    """
    _, c, Q, H, P = ch.x.shape
    G, N = ch.B.shape[3:]
    y = ch.x.new_zeros(c, Q, H, P)
    starts = inp.reset[0].clone()
    starts[0] = False
    for t in starts.nonzero().flatten().tolist():
        chunk, s = divmod(t, Q)
        rows = ch.start_pos[0, chunk] == s                                     # (Q,) its positions
        S = ch.log2_decay_cumsum[0, :, chunk]                                  # (H, Q)
        exponent = S[:, rows] - S[:, s:s + 1] + ch.log2_decay[0, :, chunk, s:s + 1]
        H0 = ch.start_states[int(ch.seq[0, chunk, s])].view(G, H // G, P, N)
        y_rows = torch.einsum("ign,grpn->igrp", ch.C[0, chunk, rows], H0).reshape(-1, H, P)
        y[chunk, rows] = y_rows * ch.decay(exponent).T[..., None]
    return y.view(1, c * Q, H, P)


def _check_dtype(name: str, dtype, allowed) -> None:
    if dtype not in allowed:
        raise SSDInputError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {dtype}")


def chunked_ssd(problem: SSDProblem, compute_dtype=torch.float64, state_dtype=torch.float32,
                out_dtype=None, chunk_size: Optional[int] = None,
                positions: Optional[Sequence[int]] = None, decay_nudge_ulps: int = 0,
                cumsum_rounded_once: bool = False) -> SSDResult:
    """The three stages on ``problem``'s device; every intermediate in ``stages``.

    compute_dtype float64 or float32: inputs are upcast exactly, all arithmetic is in it.
    state_dtype: how chunk_states are stored (the kernels' fp32 by default; stage 3 and
    varlen_states read the stored values). out_dtype: None rounds out to x's dtype, as the kernels
    store it. chunk_size: overrides problem.chunk_size. final_states, varlen_states and the states
    after ``positions`` steps come in the compute dtype. decay_nudge_ulps: every decay 2^e in
    (0, 1) moved that many ulps up or down, an evaluation whose exp2 rounds differently but is
    no less sound (the accuracy rule's baseline takes the worst of 0, +1 and -1).
    cumsum_rounded_once: the log2 decay cumsum accumulated in float64 and rounded once
    (``chunk_cumsum``).
    """
    _check_dtype("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    _check_dtype("state_dtype", state_dtype, STORAGE_DTYPES)
    out_dtype = problem.x.dtype if out_dtype is None else out_dtype
    _check_dtype("out_dtype", out_dtype, STORAGE_DTYPES)
    Q = problem.chunk_size if chunk_size is None else chunk_size
    if isinstance(Q, bool) or not isinstance(Q, int) or Q < 1:
        raise SSDInputError(f"chunk_size: expected a positive int, got {Q!r}")
    if positions is not None:
        positions = check_positions(problem, positions)
    if isinstance(decay_nudge_ulps, bool) or not isinstance(decay_nudge_ulps, int):
        raise SSDInputError(f"decay_nudge_ulps: expected an int, got {decay_nudge_ulps!r}")
    if not isinstance(cumsum_rounded_once, bool):
        raise SSDInputError(f"cumsum_rounded_once: expected a bool, got {cumsum_rounded_once!r}")

    # A process-wide TF32 switch would silently turn float32 compute into TF32 on the GPU.
    with _no_tf32():
        return _chunked_ssd(problem, compute_dtype, state_dtype, out_dtype, Q, positions,
                            decay_nudge_ulps, cumsum_rounded_once)


@contextlib.contextmanager
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _chunked_ssd(problem, compute_dtype, state_dtype, out_dtype, Q, positions,
                 decay_nudge_ulps, cumsum_rounded_once) -> SSDResult:
    inp = prepare(problem, dtype=compute_dtype)
    ch = chunk_cumsum(inp, Q, decay_nudge_ulps, cumsum_rounded_once)
    row_start_states = inp.x.new_zeros(problem.batch, problem.nheads, problem.headdim,
                                       problem.dstate)
    for row in range(problem.batch):
        start = inp.start_state(row, 0)
        if start is not None:
            row_start_states[row] = start
    chunk_states, final_states = fwd_pass_state(ch, row_start_states, state_dtype)
    out = compute_out(ch, chunk_states, inp, out_dtype)
    varlen_states = None
    if problem.cu_seqlens is not None:
        varlen_states = states_after(ch, chunk_states, problem.cu_seqlens[1:].tolist())[0]
    return SSDResult(
        out=out, final_states=final_states, varlen_states=varlen_states,
        states=None if positions is None else states_after(ch, chunk_states, positions),
        positions=positions,
        stages={"dt": ch.dt, "log2_decay_cumsum": ch.log2_decay_cumsum,
                "chunk_states": chunk_states})


def ssd_reference(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                  return_final_states=False, return_varlen_states=False, *,
                  compute_dtype=torch.float64, state_dtype=torch.float32):
    """Drop-in for ``mamba_chunk_scan_combined``: out in x's dtype [, final_states fp32]
    [, varlen_states fp32], computed by ``chunked_ssd`` in compute_dtype."""
    problem = validate(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                       initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                       dt_softplus=dt_softplus, dt_limit=dt_limit,
                       return_final_states=return_final_states,
                       return_varlen_states=return_varlen_states,
                       implementation="the chunked reference")
    result = chunked_ssd(problem, compute_dtype=compute_dtype, state_dtype=state_dtype)
    varlen = None if result.varlen_states is None else result.varlen_states.float()
    return pack_outputs(problem, result.out, result.final_states.float(), varlen)
