"""A problem recipe (shape, dtypes, features, regime, seed) and the tensors it names.

Tensors are drawn on the CPU from ``torch.Generator().manual_seed(seed)`` in float64, rounded to
their dtypes there, and only then moved to the device: a recipe means bit-identical inputs on every
machine, and the oracles upcast exactly those rounded values.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from kernels.contract import SSDProblem, validate
from properties.regimes import REGIMES, draw_A, draw_dt

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class ProblemSpec:
    """Everything that decides an SSD problem's inputs; JSON-serialisable for repro artifacts."""

    batch: int = 1
    seqlen: int = 128
    nheads: int = 4
    headdim: int = 16
    dstate: int = 16
    ngroups: int = 1
    chunk_size: int = 64
    regime: str = "mamba2_init"
    seed: int = 0
    x_dtype: str = "fp32"          # also z's dtype
    bc_dtype: str = "fp32"
    param_dtype: str = "fp32"      # dt, A, D, dt_bias
    state_dtype: str = "fp32"      # initial_states
    D: Optional[str] = None        # None, "head" (nheads,) or "channel" (nheads, headdim)
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    dt_limit: Optional[tuple[float, float]] = None
    initial_states: bool = False
    # Packed sequences: cu_seqlens offsets (batch must be 1); they also set seq_idx unless
    # ``pass_seq_idx`` is False (cu_seqlens alone then implies the resets).
    cu_seqlens: Optional[tuple[int, ...]] = None
    pass_seq_idx: bool = True
    per_sequence_initial_states: bool = False
    return_final_states: bool = True
    return_varlen_states: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ProblemSpec":
        d = dict(d)
        for key in ("dt_limit", "cu_seqlens"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    def describe(self) -> str:
        return (f"b{self.batch} L{self.seqlen} h{self.nheads} p{self.headdim} n{self.dstate} "
                f"g{self.ngroups} Q{self.chunk_size} {self.regime} x={self.x_dtype} "
                f"bc={self.bc_dtype} seed={self.seed}")


def _round(t64: torch.Tensor, name: str) -> torch.Tensor:
    return t64.to(DTYPES[name])


def build_problem(spec: ProblemSpec, device="cpu", draw_on_device: bool = False) -> SSDProblem:
    """The validated problem a recipe names, on ``device``.

    draw_on_device: draw with a generator on ``device`` instead of the CPU (benchmarks: a CPU
    draws 10^8 float64 normals in seconds). The tensors are then the same on every run on one kind
    of device, not the CPU draw's; everything else (order, scales, rounding) is unchanged.
    """
    regime = REGIMES[spec.regime]
    gen = torch.Generator(device=device if draw_on_device else "cpu").manual_seed(spec.seed)
    b, L, H, P, N, G = spec.batch, spec.seqlen, spec.nheads, spec.headdim, spec.dstate, spec.ngroups
    randn = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64,  # noqa: E731
                                       device=gen.device)
    # Draw every tensor, optional or not, in a fixed order: turning a feature on or off leaves the
    # other tensors of the same seed unchanged (metamorphic tests rely on that).
    x = randn(b, L, H, P) * regime.x_scale
    dt = draw_dt(regime, gen, (b, L, H))
    A = draw_A(regime, gen, H)
    B = randn(b, L, G, N) * regime.bc_scale
    C = randn(b, L, G, N) * regime.bc_scale
    D_head = randn(H)
    D_channel = randn(H, P)
    z = randn(b, L, H, P)
    dt_bias = randn(H) * 0.5
    nseq = 0 if spec.cu_seqlens is None else len(spec.cu_seqlens) - 1
    init = randn(max(b, nseq), H, P, N) * regime.state_scale

    # The regime draws the effective step (after bias and softplus); invert those so that
    # clamp(softplus(dt + dt_bias)) follows the regime whichever features are on.
    if spec.dt_softplus:
        dt = torch.where(dt > 20.0, dt, torch.log(torch.expm1(dt)))
    if spec.dt_bias:
        dt = dt - dt_bias
    pdt, xdt, bcdt, sdt = spec.param_dtype, spec.x_dtype, spec.bc_dtype, spec.state_dtype
    kwargs = dict(
        x=_round(x, xdt), dt=_round(dt, pdt), A=_round(A, pdt),
        B=_round(B, bcdt), C=_round(C, bcdt), chunk_size=spec.chunk_size,
        D=None if spec.D is None else _round(D_head if spec.D == "head" else D_channel, pdt),
        z=_round(z, xdt) if spec.z else None,
        dt_bias=_round(dt_bias, pdt) if spec.dt_bias else None,
        dt_softplus=spec.dt_softplus,
        dt_limit=spec.dt_limit if spec.dt_limit is not None else (0.0, math.inf),
        return_final_states=spec.return_final_states,
        return_varlen_states=spec.return_varlen_states,
    )
    if spec.initial_states:
        rows = nseq if spec.per_sequence_initial_states else b
        kwargs["initial_states"] = _round(init[:rows], sdt)
    if spec.cu_seqlens is not None:
        cu = torch.tensor(spec.cu_seqlens, dtype=torch.int32)
        kwargs["cu_seqlens"] = cu
        if spec.pass_seq_idx:
            lengths = (cu[1:] - cu[:-1]).to(torch.int64)
            kwargs["seq_idx"] = torch.repeat_interleave(
                torch.arange(nseq, dtype=torch.int32), lengths).view(1, L)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    return validate(**kwargs)


# A decay below float32's smallest normal applied to a large term (``subnormal_decay_problem``).
SUBNORMAL_SPAN = 64            # one aligned chunk at 64; inside one chunk at any larger size
SUBNORMAL_SPAN_LOG2_DECAY = -132.0
SUBNORMAL_SCALED_TERM = {"fp32": 1e6, "bf16": 1e6, "fp16": 1e4}   # fp16 stops at 65504
SUBNORMAL_CASES = ("carried_state", "large_x", "large_B")
# x and B of these sizes make final states of ~4e34 (bf16) and ~4e36 (float32) and out five times
# that at 64 steps of mamba2_init: finite in float32 and bf16 (3.4e38), past 2^112, where a sum
# kept 2^16 above scale overflows (kernels/tile_ops.py, 'Subnormal operands').
STATE_NEAR_TOP_SCALE = {"bf16": 3e17, "fp32": 3e18}


def near_top_problem(spec: ProblemSpec, device="cpu") -> SSDProblem:
    """``spec``'s problem with x and B scaled by STATE_NEAR_TOP_SCALE of its x dtype: states and
    out near the top of float32's range, still finite."""
    p = build_problem(spec, device)
    scale = STATE_NEAR_TOP_SCALE[spec.x_dtype]
    return p.with_tensors(**{name: (t.double() * scale).to(t.dtype)
                             for name, t in (("x", p.x), ("B", p.B))})


def subnormal_decay_problem(spec: ProblemSpec, case: str, device="cpu") -> SSDProblem:
    """``spec``'s problem (initial states iff ``case`` is 'carried_state') whose last
    SUBNORMAL_SPAN steps decay by 2^-132 (each step 2^-2.06, none before them), so a kernel's
    decay across the span is one exp2 below float32's smallest normal 2^-126, applied to a term of
    ~1e6 (1e4 with fp16 x): the initial state ('carried_state', x = 0), or the span's first input,
    the only nonzero x, with that x ('large_x') or that step's B ('large_B') scaled so. C is zero
    but at the last step, so out's only nonzero entries and the final states are ~1e-33
    (~1e-35), normal float32 numbers that a decay flushed to zero would return as 0 (fp16's out
    rounds them to 0 anyway)."""
    p = build_problem(replace(spec, initial_states=case == "carried_state"), device)
    span = slice(spec.seqlen - SUBNORMAL_SPAN, spec.seqlen)
    dt = torch.zeros_like(p.dt)
    dt[:, span] = -SUBNORMAL_SPAN_LOG2_DECAY / SUBNORMAL_SPAN * math.log(2.0)
    C = torch.zeros_like(p.C)
    C[:, -1] = p.C[:, -1]
    tensors = dict(dt=dt, A=-torch.ones_like(p.A), C=C)
    term = SUBNORMAL_SCALED_TERM[spec.x_dtype]
    if case == "carried_state":
        tensors.update(x=torch.zeros_like(p.x), initial_states=p.initial_states * term)
    else:
        x = torch.zeros_like(p.x)
        x[:, span.start] = p.x[:, span.start]
        B = p.B.clone()
        scaled = x if case == "large_x" else B
        scaled[:, span.start] = (scaled[:, span.start].float() * term).to(scaled.dtype)
        tensors.update(x=x, B=B)
    return p.with_tensors(**tensors)
