"""Hypothesis strategies that name the SSD problem's domain; every draw is a ``ProblemSpec`` recipe.

The domain's edges, each its own strategy: sequence lengths at chunk boundaries
(``chunk_boundary_lengths``), packed sequences starting mid-chunk, at a boundary and one off it
(``packed_sequences``), head-to-group mappings G = 1, G = H and 1 < G < H (``group_mappings``),
dtype mixes (``dtype_mixes``), the regimes of ``properties.regimes`` (including dt at the clamp's
bounds and outputs at a dtype's overflow and subnormal limits), and every optional feature
(``scenarios``). Sizes stay small: examples must be cheap on a CPU.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from hypothesis import strategies as st

from properties.impls import Impl
from properties.problems import ProblemSpec
from properties.regimes import REGIMES

# Chunk sizes a CPU can afford, odd ones included (the reference takes any); implementations
# that take fewer narrow this (the kernels: 64, 128, 256).
CPU_CHUNK_SIZES = (1, 2, 3, 4, 5, 8, 16, 32, 64)
HEADDIMS = (1, 2, 3, 4, 8, 16)
DSTATES = (1, 2, 3, 4, 8, 16)
# (x, bc, param, state): uniform dtypes, then the mixes models use: low-precision activations
# with float32 parameters and states, and float32 B/C with low-precision x.
DTYPE_MIXES = (
    ("fp32", "fp32", "fp32", "fp32"),
    ("bf16", "bf16", "fp32", "fp32"),
    ("fp16", "fp16", "fp32", "fp32"),
    ("bf16", "bf16", "bf16", "bf16"),
    ("fp16", "fp16", "fp16", "fp16"),
    ("bf16", "fp32", "fp32", "fp32"),
    ("fp16", "fp32", "fp32", "bf16"),
    ("fp32", "bf16", "bf16", "fp32"),
)


def chunk_boundary_lengths(chunk_size: int, max_chunks: int = 3) -> st.SearchStrategy[int]:
    """Lengths where chunking goes wrong: 1, Q-1, Q, Q+1 and kQ-1, kQ, kQ+1 up to max_chunks."""
    lengths = {1} | {k * chunk_size + d for k in range(1, max_chunks + 1) for d in (-1, 0, 1)}
    return st.sampled_from(sorted(n for n in lengths if n >= 1))


@st.composite
def packed_sequences(draw, seqlen: int, chunk_size: int, max_seqs: int = 4) -> tuple[int, ...]:
    """cu_seqlens (0, ..., seqlen) of 2..max_seqs sequences, starts drawn from the places resets
    break: mid-chunk, on a chunk boundary, one before or after it, one position after the last
    start (a sequence of length 1); the first start is mid-chunk whenever a chunk has room."""
    if seqlen < 2:
        raise ValueError(f"seqlen: expected >= 2 to pack two sequences, got {seqlen}")
    boundaries = {c * chunk_size + d for c in range(1, seqlen // chunk_size + 1) for d in (-1, 0, 1)}
    edges = sorted(p for p in boundaries if 0 < p < seqlen)
    mid_chunk = [p for p in range(1, seqlen) if p % chunk_size not in (0, 1, chunk_size - 1)]
    position = st.integers(1, seqlen - 1)
    first = draw(st.sampled_from(mid_chunk) if mid_chunk else position)
    starts = {first}
    for _ in range(draw(st.integers(0, min(max_seqs, seqlen) - 2))):
        previous = max(starts)
        options = [position] + ([st.sampled_from(edges)] if edges else [])
        if previous + 1 < seqlen:
            options.append(st.just(previous + 1))
        starts.add(draw(st.one_of(options)))
    return (0, *sorted(starts), seqlen)


@st.composite
def group_mappings(draw, max_heads: int = 8) -> tuple[int, int]:
    """(nheads, ngroups): every head sharing one group, one group per head, or several heads per
    group with several groups (1 < G < H), drawn evenly."""
    kind = draw(st.sampled_from(("one_group", "group_per_head", "shared_groups")))
    if kind == "shared_groups":
        nheads = draw(st.sampled_from([h for h in (4, 6, 8) if h <= max_heads]))
        return nheads, draw(st.sampled_from([g for g in range(2, nheads) if nheads % g == 0]))
    nheads = draw(st.integers(1, max_heads))
    return nheads, 1 if kind == "one_group" else nheads


def mixes_for(x_dtypes: Sequence[str] = (), among: Sequence[tuple] = DTYPE_MIXES) -> list[tuple]:
    """The mixes of ``among`` with x in ``x_dtypes`` (a regime's; empty: any). B and C in fp16
    cannot hold magnitudes below fp16's range, so a regime made for fp32/bf16 subnormal outputs
    never gets them."""
    mixes = [m for m in among if not x_dtypes or m[0] in x_dtypes]
    if x_dtypes and "fp16" not in x_dtypes:
        mixes = [m for m in mixes if "fp16" not in m]
    return mixes


@st.composite
def dtype_mixes(draw, x_dtypes: Sequence[str] = (), among: Sequence[tuple] = DTYPE_MIXES) -> dict:
    """x/bc/param/state dtypes from ``mixes_for(x_dtypes, among)``."""
    x, bc, param, state = draw(st.sampled_from(mixes_for(x_dtypes, among)))
    return dict(x_dtype=x, bc_dtype=bc, param_dtype=param, state_dtype=state)


def dt_limits() -> st.SearchStrategy[tuple[float, float]]:
    """(lo, hi) clamps inside or around the mamba2_init dt range, the degenerate lo == hi too."""
    return st.one_of(
        st.tuples(st.sampled_from((0.0, 1e-4, 1e-3, 5e-3)), st.sampled_from((0.01, 0.05, 0.1, 1.0))),
        st.sampled_from(((0.01, 0.01), (0.0, float("inf")))))


def _supported_chunk_sizes(impl: Optional[Impl]) -> tuple[int, ...]:
    if impl is None or impl.chunk_sizes is None:
        return CPU_CHUNK_SIZES
    return tuple(impl.chunk_sizes)


def _allowed(impl: Optional[Impl], feature: str) -> bool:
    return impl is None or feature not in impl.unsupported


@st.composite
def scenarios(draw, impl: Optional[Impl] = None, regimes: Optional[Sequence[str]] = None,
              max_chunks: int = 3, max_batch: int = 2, max_heads: int = 8,
              packed: Optional[bool] = None, initial_states: Optional[bool] = None,
              z: Optional[bool] = None, chunk_sizes: Optional[Sequence[int]] = None,
              mixes: Optional[Sequence[tuple]] = None) -> ProblemSpec:
    """A problem recipe: regime, shape, dtypes, features, seed, within what ``impl`` takes.

    ``packed``/``initial_states``/``z``: force a feature on (True) or off (False); None draws it.
    Lengths are chunk-boundary lengths half the time, any length up to max_chunks chunks otherwise.
    ``mixes``: the dtype mixes to draw from (default DTYPE_MIXES); regimes meant for none of them
    are left out.
    """
    mixes = tuple(mixes) if mixes is not None else DTYPE_MIXES
    names = [n for n in (regimes if regimes is not None else sorted(REGIMES))
             if mixes_for(REGIMES[n].x_dtypes, mixes)]
    if not names:
        raise ValueError(f"mixes: expected dtype mixes some of the regimes {regimes} are meant "
                         f"for, got {mixes}")
    regime = REGIMES[draw(st.sampled_from(names), label="regime")]
    Q = draw(st.sampled_from(tuple(chunk_sizes) if chunk_sizes else _supported_chunk_sizes(impl)))
    seqlen = draw(st.one_of(chunk_boundary_lengths(Q, max_chunks),
                            st.integers(1, max_chunks * Q)))
    nheads, ngroups = draw(group_mappings(max_heads))
    if packed is None:
        packed = _allowed(impl, "packed") and seqlen >= 2 and draw(st.booleans())
    elif packed:
        seqlen = max(seqlen, 2)     # two sequences at least
    want_init = draw(st.booleans()) if initial_states is None else initial_states
    spec = ProblemSpec(
        batch=1 if packed else draw(st.integers(1, max_batch)), seqlen=seqlen, nheads=nheads,
        headdim=draw(st.sampled_from(HEADDIMS)), dstate=draw(st.sampled_from(DSTATES)),
        ngroups=ngroups, chunk_size=Q, regime=regime.name, seed=draw(st.integers(0, 2**31 - 1)),
        **draw(dtype_mixes(regime.x_dtypes, mixes)),
        D=draw(st.sampled_from((None, "head", "channel"))) if _allowed(impl, "D") else None,
        z=(draw(st.booleans()) if z is None else z) and _allowed(impl, "z"),
        dt_bias=_allowed(impl, "dt_bias") and draw(st.booleans()),
        dt_softplus=_allowed(impl, "dt_softplus") and draw(st.booleans()),
        initial_states=want_init and _allowed(impl, "initial_states"),
    )
    if regime.dt_limit is not None:
        spec = replace(spec, dt_limit=regime.dt_limit)
    elif _allowed(impl, "dt_limit") and draw(st.booleans()):
        spec = replace(spec, dt_limit=draw(dt_limits()))
    if spec.state_dtype != "fp32" and not _allowed(impl, "low_precision_states"):
        spec = replace(spec, state_dtype="fp32")
    if packed:
        per_sequence = (spec.initial_states and _allowed(impl, "per_sequence_initial_states")
                        and draw(st.booleans()))
        spec = replace(spec, cu_seqlens=draw(packed_sequences(seqlen, Q)),
                       pass_seq_idx=draw(st.booleans()), per_sequence_initial_states=per_sequence,
                       return_varlen_states=_allowed(impl, "varlen_states") and draw(st.booleans()))
    return spec
