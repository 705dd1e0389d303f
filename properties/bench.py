"""``mamba2-cutile bench``: the cuTile SSD forward side by side with mamba_ssm and fla on one GPU.

Rows (each times one call, with the problem's tensors already on the GPU):

    ours            kernels.ssd_forward(x, dt, A, B, C, chunk_size=Q, D=, z=)   Q: --chunk-size,
                    else the one ssd_forward picks (kernels.ssd.default_chunk_size)
    ours_graph      ours' call captured in a CUDA graph (torch.cuda.graph) after a call outside
                    capture, timed as the graph's replay: the kernels without the host path
    ours.<stage>    one stage entry (kernels/chunk_cumsum.py, fwd_pass_state.py or state_scan.py,
                    compute_out.py) on the previous stages' outputs, in the variant ssd_forward
                    picks
    mamba_ssm       mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=256, D=, z=), its default
                    use
    mamba_ssm_graph mamba_ssm's call captured and replayed as ours_graph
    fla_kernel      fla.ops.simple_gla.chunk_simple_gla(q=C, k=B, v=x*dt, g=A*dt, scale=1.0) on
                    operands prepared beforehand (B and C expanded to heads, v in x's dtype, dt
                    after the call's bias, softplus and limit)
    fla_e2e         the same from the contract's inputs: dt's bias, softplus and limit, expansion,
                    x*dt, A*dt, the kernel, then the D skip and z gate (plain torch ops) when the
                    problem has them; what a caller pays to get ``out`` from fla

Timing, the same for every row and for the copy probe: the first call (compile, autotune) is not
timed; then warm-up calls; then N timed calls, each preceded by an L2 flush (a 256 MiB memset, more
than any current GPU's L2, so every call starts cold) and bracketed by CUDA events on the current
stream. A row reports the median (also min and p90). N is chosen per row so that its timed calls
take about the plan's target. A call's CPU launch cost is inside its events when the GPU outruns
the CPU (small shapes): that is what a caller without CUDA graphs pays; the ``_graph`` rows are
what a caller with them pays (their outputs, the captured call's after a replay, are checked as
the others').

Bytes (``io_bytes``): every input read once and the output written once, in their dtypes; the
least traffic any implementation can have. GB/s = io_bytes / time on every row, peers included.
The bound is io_bytes at the copy bandwidth measured in the same run (``COPY_PROBE_BYTES`` copied
device to device, timed as above, counted read + write) and at the nominal 4.3 TB/s of an H200.

FLOPs (``chunked_flops``): the matmul work of the chunked algorithm at the row's chunk size.

Errors: each row's ``out`` against the float64 chunked reference (oracles/chunked_reference.py,
float64 on the GPU, out not rounded) on the same inputs, as ``properties.metrics.error_metrics``.
Where batch x seqlen x heads exceeds ``ERROR_MAX_ROW_HEADS``, on a leading slice of batch rows
(then heads): the JSON records the slice and the table names it.

``--check BASELINE``: measures (or reads ``--results``), then fails, naming the shape, where ours'
kernel time (its stage rows summed) over the copy bound of the same run grew by more than
``--margin`` over the baseline's; never absolute times. Shapes whose kernels take under
``KERNEL_FLOOR_MS`` are reported, not judged; ours/mamba_ssm call ratios are printed beside (the
comment at ``KERNEL_FLOOR_MS`` says why the calls are not what is judged).

``--results`` given several times reads several runs as one (``merge_runs``): each shape's
record is the run's whose judged ratio is that shape's median, or with ``--latest`` the last run's
that measured it (a shape re-measured after a change replaces the baseline's record).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from oracles.common import step_sizes
from properties.metrics import error_metrics
from properties.problems import DTYPES, ProblemSpec, build_problem
from properties.provenance import (REPO_ROOT, atomic_write, collect, device_label, read_document,
                                   write_json)

SCHEMA = "mamba2-cutile bench 1"
NOMINAL_GBPS = 4300.0                # H200 HBM3e, the device README's figure
COPY_PROBE_BYTES = 1 << 30           # copied once per timed call: 2 GiB of traffic
MAMBA_CHUNK_SIZE = 256
FLA_CHUNK_SIZE = 64                  # chunk_simple_gla's default
# The float64 reference holds a few (rows, heads, seqlen, 64)-sized float64 tensors at its chunk
# size 64: about 1 GiB each at 2^21 row-heads.
ERROR_MAX_ROW_HEADS = 2 ** 21
REFERENCE_CHUNK_SIZE = 64

ANCHOR_DIMS = ((8, 4096, 64, 64, 128, 1), (4, 8192, 32, 64, 128, 8), (1, 65536, 64, 64, 128, 1))
SCALING_BATCHES = (1, 8)
SCALING_SEQLENS = tuple(2 ** k for k in range(9, 17))          # 512 .. 65536
QUICK_SCALING_SEQLENS = (512, 4096, 32768)
# At 2^17 tokens (H64 P64 N128) x and out are 1 GiB each in bf16; the largest row's temporaries
# (fla's expanded q and k, our fp32 chunk increments and states) add under 8 GiB and the float64
# reference slice about 5 GiB: each shape's peak (recorded) stays under ~20 GB.
SCALING_MAX_TOKENS = 2 ** 17
# One knob changed from the first anchor each.
VARIANTS = (("headdim", dict(headdim=128)), ("dstate", dict(dstate=64)),
            ("dstate", dict(dstate=256)), ("ngroups", dict(ngroups=8)),
            ("dtype", dict(x_dtype="fp16", bc_dtype="fp16")),
            ("dtype", dict(x_dtype="fp32", bc_dtype="fp32")),
            ("features", dict(z=True, D="channel")))

# The SSD layers of published Mamba-2 models, as their configs give them (headdim 64, dstate
# 128; nheads = 2 * d_model / 64), and two calls of each as the Mamba-2 layer makes them (D per
# head, dt_bias, softplus): a long prefill at batch 1, which returns the final states for the
# inference cache, and a training-sized batch, out alone.
MODEL_LAYERS = (("mamba2-130m", 24, 1), ("mamba2-370m", 32, 1), ("mamba2-780m", 48, 1),
                ("mamba2-1.3b", 64, 1), ("mamba2-2.7b", 80, 1), ("mamba-codestral-7b", 128, 8))
MODEL_CALLS = ((1, 16384, True), (8, 2048, False))     # batch, seqlen, final states
# The same layers as a serving engine's batched prefill calls them: one row of 16,384 tokens
# packed from 8 sequences by cu_seqlens (and seq_idx, which mamba_ssm resets on), cut off chunk
# boundaries, one of 100 tokens; every sequence's state returned (varlen states, for the cache),
# from zero or, continuing cached sequences, from per-sequence initial states (which mamba_ssm
# does not take: its row then records the refusal).
PACKED_OFFSETS = (0, 1000, 2900, 3000, 6500, 9000, 12345, 15000, 16384)

OURS = "ours"
STAGES = ("chunk_cumsum", "fwd_pass_state", "compute_out")
PEER_ROWS = ("mamba_ssm", "fla_kernel", "fla_e2e")
# Rows also timed as CUDA graph replays (``graph_replay``), under the row's name + GRAPH; a
# peer's replay is compared with ours'.
GRAPH = "_graph"
GRAPHED_PEERS = ("mamba_ssm",)
GRAPHED_ROWS = (OURS, *GRAPHED_PEERS)
PEER_GRAPH_ROWS = tuple(name + GRAPH for name in GRAPHED_PEERS)
ROW_DESCRIPTIONS = {
    OURS: "kernels.ssd_forward(x, dt, A, B, C, chunk_size, D=, z=)",
    **{f"{OURS}.{stage}": f"kernels/{stage}.py's entry on the previous stages' outputs"
       for stage in STAGES},
    "mamba_ssm": f"mamba_chunk_scan_combined(..., chunk_size={MAMBA_CHUNK_SIZE}, D=, z=), "
                 f"seq_idx where packed, cu_seqlens where varlen states are returned",
    **{name + GRAPH: f"{name}'s call captured in a CUDA graph after a call outside capture, "
                     f"timed as the graph's replay (no host work)" for name in GRAPHED_PEERS},
    OURS + GRAPH: "ours' call captured in a CUDA graph after a call outside capture, timed as the "
                  "graph's replay (no host work); a packed call, which refuses capture, as its "
                  "kernels' (kernels.ssd.launch_stages)",
    "fla_kernel": "chunk_simple_gla(q=C, k=B, v=x*dt, g=A*dt, scale=1.0) on prepared operands "
                  "(B, C expanded to heads; dt after its bias, softplus and limit)",
    "fla_e2e": "dt's bias, softplus and limit, expansion, x*dt, A*dt, chunk_simple_gla, then D "
               "skip and z gate in torch",
}
# --check judges ours' kernels: the sum of ours' stage rows (each stage's launches timed alone
# queue behind the L2 flush, so no host time is inside their events) over the copy bound measured
# in the same run. Not ours' call against a peer, as until 72c18fa: in three runs at one commit on
# the H200 (3fc8df0) ours/mamba_ssm at b8 L4096 took 0.51-0.65 (mamba_ssm's kernels autotune in
# each process) and the host-bound calls at b1 L512-4096 0.18-0.48 ms, while this ratio moved by
# 2% or less on every row whose kernels take KERNEL_FLOOR_MS or more, and by 17-38% below it,
# where the launches' host time shows: those rows are reported, not judged.
DEFAULT_MARGIN = 0.15
KERNEL_FLOOR_MS = 0.1


# ---------------------------------------------------------------- shapes and bookkeeping

@dataclass(frozen=True)
class BenchShape:
    """One benchmarked problem; ``tags`` say which sets (anchor, scaling, variant) it belongs to."""

    spec: ProblemSpec
    tags: tuple[str, ...]

    @property
    def label(self) -> str:
        return shape_label(self.spec)


def shape_label(spec: ProblemSpec) -> str:
    """'b8 L4096 H64 P64 N128 G1 bf16' (+z, +D/channel, +dt_bias, +softplus, +dt_limit,
    +final_states, +N seqs, +seq_starts, +varlen_states): the key of a shape in bench.json."""
    s = spec
    dtypes = s.x_dtype if s.x_dtype == s.bc_dtype else f"x={s.x_dtype} bc={s.bc_dtype}"
    packed = "" if s.cu_seqlens is None else (
        f" +{len(s.cu_seqlens) - 1} seqs" + (" +seq_starts" if s.per_sequence_initial_states
                                             else ""))
    extras = ((" +z" if s.z else "") + (f" +D/{s.D}" if s.D else "")
              + (" +dt_bias" if s.dt_bias else "") + (" +softplus" if s.dt_softplus else "")
              + (" +dt_limit" if s.dt_limit else "")
              + (" +final_states" if s.return_final_states else "") + packed
              + (" +varlen_states" if s.return_varlen_states else ""))
    return (f"b{s.batch} L{s.seqlen} H{s.nheads} P{s.headdim} N{s.dstate} G{s.ngroups} "
            f"{dtypes}{extras}")


def bench_spec(dims, chunk_size: int, **changes) -> ProblemSpec:
    """A benchmark recipe: dims (batch, seqlen, nheads, headdim, dstate, ngroups), bf16 x/B/C, fp32
    dt/A, no final states (mamba_ssm's default call), with ``changes`` applied."""
    batch, seqlen, nheads, headdim, dstate, ngroups = dims
    spec = ProblemSpec(batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim, dstate=dstate,
                       ngroups=ngroups, chunk_size=chunk_size, x_dtype="bf16", bc_dtype="bf16",
                       param_dtype="fp32", return_final_states=False)
    return dataclasses.replace(spec, **changes)


SHAPE_SETS = ("anchors", "scaling", "variants", "all", "models", "packed")
# Sets written to a folder of their own (``default_out_dir``), never over the shape sets' run.
OWN_FOLDER_SETS = ("models", "packed")


def bench_shapes(which: str, chunk_size: int, quick: bool = False) -> list[BenchShape]:
    """The shapes of ``which`` (SHAPE_SETS; all = anchors, scaling, variants in that order;
    models, the published models' layers, and packed, their packed prefills, apart),
    deduplicated."""
    if which not in SHAPE_SETS:
        raise ValueError(f"shapes: expected one of {', '.join(SHAPE_SETS)}, got {which!r}")
    found: dict[ProblemSpec, list[str]] = {}

    def add(spec: ProblemSpec, tag: str) -> None:
        found.setdefault(spec, [])
        if tag not in found[spec]:
            found[spec].append(tag)

    if which in ("anchors", "all"):
        for dims in ANCHOR_DIMS:
            add(bench_spec(dims, chunk_size), "anchor")
    if which in ("scaling", "all"):
        _, _, H, P, N, G = ANCHOR_DIMS[0]
        for batch in SCALING_BATCHES:
            for seqlen in QUICK_SCALING_SEQLENS if quick else SCALING_SEQLENS:
                if batch * seqlen <= SCALING_MAX_TOKENS:
                    add(bench_spec((batch, seqlen, H, P, N, G), chunk_size), "scaling")
    if which in ("variants", "all"):
        for knob, changes in VARIANTS:
            add(bench_spec(ANCHOR_DIMS[0], chunk_size, **changes), f"variant:{knob}")
    if which == "models":
        for model, nheads, ngroups in MODEL_LAYERS:
            for batch, seqlen, final_states in MODEL_CALLS:
                add(bench_spec((batch, seqlen, nheads, 64, 128, ngroups), chunk_size, D="head",
                               dt_bias=True, dt_softplus=True,
                               return_final_states=final_states), f"model:{model}")
    if which == "packed":
        for model, nheads, ngroups in MODEL_LAYERS:
            for continued in (False, True):
                add(bench_spec((1, PACKED_OFFSETS[-1], nheads, 64, 128, ngroups), chunk_size,
                               D="head", dt_bias=True, dt_softplus=True,
                               cu_seqlens=PACKED_OFFSETS, initial_states=continued,
                               per_sequence_initial_states=continued,
                               return_varlen_states=True), f"packed:{model}")
    return [BenchShape(spec, tuple(tags)) for spec, tags in found.items()]


def select_shapes(shapes: list[BenchShape], only: Optional[str]) -> list[BenchShape]:
    """The shapes whose label contains one of ``only``'s comma-separated texts (all when None),
    e.g. 'N256,fp32' from the variants; a text that matches no shape is an error."""
    if only is None:
        return shapes
    texts = [t.strip() for t in only.split(",") if t.strip()]
    unmatched = [t for t in texts if not any(t in s.label for s in shapes)]
    if not texts or unmatched:
        raise ValueError(f"only: expected comma-separated parts of these labels: "
                         f"{'; '.join(s.label for s in shapes)}; got {only!r}"
                         + (f" ({', '.join(map(repr, unmatched))} matches none)" if unmatched
                            else ""))
    return [s for s in shapes if any(t in s.label for t in texts)]


def _itemsize(dtype_name: str) -> int:
    return DTYPES[dtype_name].itemsize


def io_bytes(spec: ProblemSpec) -> int:
    """Bytes an SSD forward moves at least: every input read once, every output written once."""
    b, L, H, P, N, G = spec.batch, spec.seqlen, spec.nheads, spec.headdim, spec.dstate, spec.ngroups
    x, bc, par, st = (_itemsize(spec.x_dtype), _itemsize(spec.bc_dtype),
                      _itemsize(spec.param_dtype), _itemsize(spec.state_dtype))
    nseq = 0 if spec.cu_seqlens is None else len(spec.cu_seqlens) - 1
    total = b * L * H * P * x * (2 + spec.z)                     # x, out, z
    total += 2 * b * L * G * N * bc                              # B, C
    total += (b * L * H + H * (1 + spec.dt_bias)) * par          # dt, A, dt_bias
    if spec.D is not None:
        total += (H if spec.D == "head" else H * P) * par
    if spec.initial_states:
        total += (nseq if spec.per_sequence_initial_states else b) * H * P * N * st
    if spec.cu_seqlens is not None:                              # int32, as build_problem has them
        total += (nseq + 1) * 4 + (b * L * 4 if spec.pass_seq_idx else 0)
    total += 4 * H * P * N * (b * spec.return_final_states + nseq * spec.return_varlen_states)
    return total


def chunked_flops(batch: int, seqlen: int, nheads: int, headdim: int, dstate: int, ngroups: int,
                  chunk_size: int) -> int:
    """Multiply-adds x 2 of the chunked SSD algorithm's matmuls at chunk size Q (the last chunk may
    be shorter). Per batch row and chunk of q positions: C.B^T over causal pairs, once per group
    (N q(q+1)); the intra-chunk output over causal pairs, per head (P q(q+1)); the chunk's state
    increment and the inter-chunk output, per head (2 q P N each); the state passing, per head
    (2 P N). Elementwise work (cumsum, exp2, D, z) is left out as lower order."""
    H, P, N, G, Q = nheads, headdim, dstate, ngroups, chunk_size
    full, last = divmod(seqlen, Q)
    pairs = full * Q * (Q + 1) + last * (last + 1)              # sum over chunks of q(q+1)
    nchunks = full + (last > 0)
    per_row = (G * N + H * P) * pairs + 4 * H * P * N * seqlen + 2 * H * P * N * nchunks
    return batch * per_row


def error_slice(spec: ProblemSpec) -> tuple[int, int, int]:
    """(batch rows, heads, groups): the leading slice the float64 reference is computed on, the
    whole problem when batch x seqlen x heads <= ERROR_MAX_ROW_HEADS. Heads are cut at group
    boundaries (whole groups, or part of the first group), so the slice is itself a problem."""
    per_row = spec.seqlen * spec.nheads
    if spec.batch * per_row <= ERROR_MAX_ROW_HEADS:
        return spec.batch, spec.nheads, spec.ngroups
    if per_row <= ERROR_MAX_ROW_HEADS:
        return ERROR_MAX_ROW_HEADS // per_row, spec.nheads, spec.ngroups
    per_group = spec.nheads // spec.ngroups
    heads = max(1, ERROR_MAX_ROW_HEADS // spec.seqlen)
    if heads >= per_group:
        heads -= heads % per_group
        return 1, heads, heads // per_group
    return 1, heads, 1


def derive_row(ms: float, nbytes: int, flops: Optional[int], copy_gbps: float) -> dict:
    """Throughput figures of a row that took ``ms`` on a problem of ``nbytes`` (io_bytes)."""
    bound_ms = nbytes / (copy_gbps * 1e6)
    return dict(gbps=nbytes / ms / 1e6,
                tflops=None if flops is None else flops / ms / 1e9,
                copy_bound_fraction=bound_ms / ms,
                nominal_bound_fraction=nbytes / (NOMINAL_GBPS * 1e6) / ms)


def timing_summary(times_ms: list[float]) -> dict:
    ordered = sorted(times_ms)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return dict(ms=statistics.median(ordered), ms_min=ordered[0], ms_p90=p90, reps=len(ordered))


@dataclass(frozen=True)
class TimingPlan:
    """How many calls a row gets: about ``target_ms`` of timed calls after ``warmup_ms`` of
    warm-up, at least ``min_reps`` and at most ``max_reps`` timed calls."""

    target_ms: float
    min_reps: int
    max_reps: int
    warmup_ms: float

    def reps(self, estimate_ms: float) -> int:
        wanted = math.ceil(self.target_ms / max(estimate_ms, 1e-3))
        return max(self.min_reps, min(self.max_reps, wanted))

    def warmups(self, estimate_ms: float) -> int:
        return max(1, min(self.max_reps, math.ceil(self.warmup_ms / max(estimate_ms, 1e-3))))


FULL_TIMING = TimingPlan(target_ms=100.0, min_reps=10, max_reps=200, warmup_ms=25.0)
QUICK_TIMING = TimingPlan(target_ms=25.0, min_reps=5, max_reps=50, warmup_ms=10.0)
ESTIMATE_REPS = 3


# ---------------------------------------------------------------- timing on the GPU

# More than any current GPU's L2 (H200: 50 MB): zeroing it before a timed call evicts its inputs.
L2_FLUSH_BYTES = 256 << 20


@functools.lru_cache(maxsize=None)
def _flush_buffer(device: int) -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


def flush_l2() -> None:
    """Queue a write over more than the L2 of the current device, so that the next call starts
    cold, as a model layer does (its inputs were not the last thing the GPU touched). Every
    timed call of the project, the benchmark's and the tuner's (``kernels.gpu_check.time_ms``),
    follows one."""
    _flush_buffer(torch.cuda.current_device()).zero_()


class CudaTimer:
    """CUDA-event times of single calls, each after an L2 flush (the module docstring's method)."""

    def __init__(self, plan: TimingPlan):
        self.plan = plan

    def times(self, fn: Callable[[], Any], reps: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            flush_l2()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]

    def measure(self, fn: Callable[[], Any]) -> dict:
        """Timing summary of ``fn``, which has been called once already (compiled, autotuned)."""
        estimate = statistics.median(self.times(fn, ESTIMATE_REPS))
        self.times(fn, self.plan.warmups(estimate))
        return timing_summary(self.times(fn, self.plan.reps(estimate)))


def copy_probe(timer: CudaTimer, nbytes: int = COPY_PROBE_BYTES) -> dict:
    """Device-to-device copy bandwidth, timed like every row; bytes counted read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    timing = timer.measure(lambda: dst.copy_(src))
    moved = 2 * nbytes
    return dict(timing, bytes_moved=moved, gbps=moved / timing["ms"] / 1e6)


# ---------------------------------------------------------------- what is timed

@dataclass
class Contender:
    """One row: ``call`` is what is timed; ``output`` takes call's return to ``out`` (None: no
    output to check, e.g. a stage)."""

    name: str
    chunk_size: Optional[int]
    call: Callable[[], Any]
    output: Optional[Callable[[Any], torch.Tensor]]
    info: dict = dataclasses.field(default_factory=dict)
    # What ``graph_replay`` captures instead of this row, for a call that refuses capture.
    captured: Optional["Contender"] = None


def out_of(result) -> torch.Tensor:
    """``out`` of a contract call's return: the tensor, or the first of the tuple a call that
    returns final states gets."""
    return result[0] if isinstance(result, tuple) else result


class PeerUnavailable(RuntimeError):
    """A peer does not import here; the message says why."""


def load_mamba_ssm():
    """(mamba_chunk_scan_combined, description) or PeerUnavailable."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: PLC0415
    except Exception as exc:  # ImportError, or Triton failing to initialise
        raise PeerUnavailable(f"mamba_ssm does not import: {exc!r}") from exc
    import mamba_ssm  # noqa: PLC0415
    return mamba_chunk_scan_combined, f"mamba_ssm {_peer_version('mamba_ssm', mamba_ssm)}"


def load_fla():
    """(chunk_simple_gla, description) or PeerUnavailable."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: PLC0415
    except Exception as exc:
        raise PeerUnavailable(f"fla does not import: {exc!r}") from exc
    import fla  # noqa: PLC0415
    return chunk_simple_gla, f"fla {_peer_version('fla-core', fla)}"


def _peer_version(dist: str, module) -> str:
    import importlib.metadata  # noqa: PLC0415
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        # The GPU machine unpacks mamba_ssm's sources without metadata and empties its __init__.
        return (getattr(module, "__version__", None)
                or f"(no version metadata; {module.__path__[0]})")


def our_contenders(problem, chunk_size: Optional[int] = None) -> Iterator[Contender]:
    """ssd_forward at ``chunk_size`` (None: the one it picks for the call, as a call with its
    default settings), then each stage entry on the outputs of the stages before it."""
    from kernels import ssd  # noqa: PLC0415  (on a GPU machine a broken cuTile fails loudly here)
    from kernels.device import launch_stream  # noqa: PLC0415

    problem = dataclasses.replace(problem, chunk_size=chunk_size or ssd.default_chunk_size(problem))
    kwargs = problem.call_kwargs()
    precision = ssd.resolve_precision(None, problem.x.dtype)
    state_dtype = ssd.resolve_state_dtype(None, precision, problem.x.dtype)
    info = dict(precision=precision, state_dtype=str(state_dtype).replace("torch.", ""))
    # Planned at first use: ours' row records ssd_forward's own refusal where it cannot run.
    planned = functools.cache(lambda: ssd.stage_pipeline(problem))
    # A packed call refuses CUDA graph capture (the host reads seq_idx's and cu_seqlens' values):
    # its graph row replays the kernels the call launches (kernels.ssd.launch_stages).
    kernels_only = None if problem.seq_idx is None and problem.cu_seqlens is None else Contender(
        OURS, problem.chunk_size, lambda: ssd.launch_stages(planned()), lambda result: result.out,
        dict(info, graph="the call's kernels (kernels.ssd.launch_stages): a packed call "
                         "refuses capture"))
    yield Contender(OURS, problem.chunk_size, lambda: ssd.ssd_forward(**kwargs), out_of, info,
                    kernels_only)

    pipeline = planned()
    plan = pipeline.plan
    dt, log2_cumsum = pipeline.cumsum()
    chunk_states = pipeline.states(dt, log2_cumsum)[0]
    # Each stage as ssd.run_stages launches it, on the stream current when it is called.
    calls = {
        "chunk_cumsum": lambda: pipeline.cumsum(launch_stream(problem.x)),
        "fwd_pass_state": lambda: pipeline.states(dt, log2_cumsum, launch_stream(problem.x)),
        "compute_out": lambda: pipeline.out(dt, log2_cumsum, chunk_states,
                                            launch_stream(problem.x)),
    }
    states_kernels = [cfg for name, cfg in plan.named_configs()
                      if name in ("chunk_state", "state_passing", "state_scan")]
    variants = {"chunk_cumsum": plan.cumsum.describe(),
                "fwd_pass_state": "; ".join(cfg.describe() for cfg in states_kernels)
                or "none: scan_out keeps the states in registers",
                "compute_out": "; ".join(cfg.describe() for name, cfg in plan.named_configs()
                                         if name in ("chunk_scores", "compute_out",
                                                     "segment_states", "entering_states",
                                                     "scan_out"))}
    for stage in STAGES:
        # The last stage's output is the forward's: checked against the reference like ours, it
        # shows that the stages timed are the work ssd_forward does.
        output = (lambda out: out) if stage == "compute_out" else None
        yield Contender(f"{OURS}.{stage}", problem.chunk_size, calls[stage], output,
                        dict(variant=variants[stage]))


def graph_replay(contender: Contender) -> Contender:
    """``contender`` (or what it names as ``captured``) as a CUDA graph's replay: at its first
    call, one call outside capture (which compiles and autotunes), then the call captured
    (torch.cuda.graph); every call replays the graph and returns the captured call's result,
    refreshed by the replay."""
    name = contender.name
    contender = contender.captured or contender
    captured: dict = {}

    def replay():
        if not captured:
            contender.call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured["result"] = contender.call()
            captured["graph"] = graph
        captured["graph"].replay()
        return captured["result"]

    return Contender(name + GRAPH, contender.chunk_size, replay, contender.output, contender.info)


def mamba_contenders(problem, mamba_chunk_scan_combined) -> Iterator[Contender]:
    """Its call as ours is made, at its chunk size; cu_seqlens only where varlen states are asked
    for (it resets on seq_idx and reads cu_seqlens for those alone)."""
    kwargs = problem.call_kwargs()
    kwargs.update(chunk_size=MAMBA_CHUNK_SIZE)
    if not problem.return_varlen_states:
        kwargs.update(cu_seqlens=None)
    yield Contender("mamba_ssm", MAMBA_CHUNK_SIZE, lambda: mamba_chunk_scan_combined(**kwargs),
                    out_of)


def fla_operands(problem):
    """fla's inputs for the SSD (b, L, H, .): q = C and k = B expanded to heads, v = x * dt
    (computed in fp32, stored in x's dtype: fla's matmuls take v in the q/k dtype), g = A * dt
    fp32 (b, L, H), the log decay per step; dt after the call's bias, softplus and limit, which
    fla's kernel does not apply."""
    used = [name for name in ("initial_states", "seq_idx", "cu_seqlens")
            if getattr(problem, name) is not None]
    if used:
        raise ValueError(f"fla: expected a problem without {', '.join(used)} (its rows run "
                         f"chunk_simple_gla from zero states on unpacked rows), got one with them")
    per_group = problem.nheads // problem.ngroups
    dt = step_sizes(problem, torch.float32)
    q = problem.C.repeat_interleave(per_group, dim=2)
    k = problem.B.repeat_interleave(per_group, dim=2)
    v = (problem.x * dt[..., None]).to(problem.x.dtype)
    g = dt * problem.A.to(torch.float32)
    return q, k, v, g


def fla_epilogue(problem, o: torch.Tensor) -> torch.Tensor:
    """out from fla's o (in q's dtype): + D x, then * silu(z), in fp32, rounded to x's dtype."""
    if problem.D is None and problem.z is None:
        return o.to(problem.x.dtype)
    y = o.to(torch.float32)
    if problem.D is not None:
        D = problem.D.to(torch.float32).reshape(problem.nheads, -1)    # (H, 1) or (H, P)
        y = y + D * problem.x.to(torch.float32)
    if problem.z is not None:
        y = y * torch.nn.functional.silu(problem.z.to(torch.float32))
    return y.to(problem.x.dtype)


def fla_call(problem, chunk_simple_gla, q, k, v, g):
    """fla's kernel on its operands: (o, its final state where the problem returns final states,
    so that its row writes them too)."""
    returned = dict(output_final_state=True) if problem.return_final_states else {}
    return chunk_simple_gla(q, k, v, g=g, scale=1.0, **returned)


def _fla_kernel_contender(problem, chunk_simple_gla) -> Contender:
    # The operands live in the row's closure only: dropping the row frees them.
    q, k, v, g = fla_operands(problem)
    plain = problem.D is None and problem.z is None
    # Without D and z, fla's o is the problem's out; with them only the end-to-end row computes it.
    return Contender("fla_kernel", FLA_CHUNK_SIZE,
                     lambda: fla_call(problem, chunk_simple_gla, q, k, v, g),
                     (lambda result: result[0]) if plain else None,
                     {} if plain else dict(error_note="no D skip / z gate: out is fla_e2e's"))


def fla_contenders(problem, chunk_simple_gla) -> Iterator[Contender]:
    yield _fla_kernel_contender(problem, chunk_simple_gla)

    def end_to_end():
        q, k, v, g = fla_operands(problem)
        return fla_epilogue(problem, fla_call(problem, chunk_simple_gla, q, k, v, g)[0])

    yield Contender("fla_e2e", FLA_CHUNK_SIZE, end_to_end, lambda out: out)


# ---------------------------------------------------------------- one run

def sub_problem(problem, rows: int, heads: int, groups: int):
    """The leading (rows, heads, groups) slice of a problem: its initial states sliced alike (one
    per row; per sequence, every sequence's), its packing the rows'; with cu_seqlens (one row)
    every row."""
    p = problem
    if p.cu_seqlens is not None and rows != p.batch:
        raise ValueError(f"error slice: expected all {p.batch} rows of a problem with "
                         f"cu_seqlens, got {rows}")
    cut = lambda t, *index: None if t is None else t[index]  # noqa: E731
    starts = slice(None) if p.per_sequence_initial_states else slice(0, rows)
    return p.with_tensors(x=p.x[:rows, :, :heads], dt=p.dt[:rows, :, :heads], A=p.A[:heads],
                          B=p.B[:rows, :, :groups], C=p.C[:rows, :, :groups],
                          D=cut(p.D, slice(0, heads)), z=cut(p.z, slice(0, rows), slice(None),
                                                                slice(0, heads)),
                          dt_bias=cut(p.dt_bias, slice(0, heads)),
                          initial_states=cut(p.initial_states, starts, slice(0, heads)),
                          seq_idx=cut(p.seq_idx, slice(0, rows)))


def reference_out(problem, rows: int, heads: int, groups: int) -> torch.Tensor:
    """float64 out (rows, L, heads, P) of the chunked reference, computed in float64 on the GPU."""
    from oracles.chunked_reference import chunked_ssd  # noqa: PLC0415
    sub = sub_problem(problem, rows, heads, groups)
    return chunked_ssd(sub, compute_dtype=torch.float64, state_dtype=torch.float64,
                       out_dtype=torch.float64, chunk_size=REFERENCE_CHUNK_SIZE).out


@dataclass
class RunContext:
    timer: CudaTimer                  # anything with measure(fn) -> timing_summary(...)
    copy_gbps: float
    peers: dict                       # name -> (function, description) or PeerUnavailable
    device: str = "cuda"
    our_chunk_size: Optional[int] = None   # None: the one ssd_forward picks per call

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()


def _row(contender: Contender, ctx: RunContext, nbytes: int, spec: ProblemSpec, exact,
         cut: tuple[int, int]) -> dict:
    row: dict = dict(chunk_size=contender.chunk_size, **contender.info)
    started = time.perf_counter()
    result = contender.call()
    ctx.synchronize()
    row["first_call_s"] = round(time.perf_counter() - started, 3)
    if contender.output is not None:
        out = contender.output(result)[:cut[0], :, :cut[1]]
        row["error"] = error_metrics(out, exact, DTYPES[spec.x_dtype])
    del result
    row.update(ctx.timer.measure(contender.call))
    is_stage = contender.name.startswith(OURS + ".")
    flops = None if is_stage else chunked_flops(spec.batch, spec.seqlen, spec.nheads, spec.headdim,
                                                 spec.dstate, spec.ngroups, contender.chunk_size)
    if not is_stage:
        row.update(derive_row(row["ms"], nbytes, flops, ctx.copy_gbps), flops=flops)
    return row


ROW_GROUPS = (("ours", (OURS, *(f"{OURS}.{stage}" for stage in STAGES))),
              ("mamba_ssm", ("mamba_ssm",)), ("fla", ("fla_kernel", "fla_e2e")))


def _group_builder(group: str, ctx: RunContext):
    """problem -> Iterator[Contender] for a row group, or the reason a peer cannot run here."""
    if group == "ours":
        return lambda problem: our_contenders(problem, ctx.our_chunk_size)
    loaded = ctx.peers[group]
    if isinstance(loaded, Exception):
        return str(loaded)
    build = mamba_contenders if group == "mamba_ssm" else fla_contenders
    return lambda problem: build(problem, loaded[0])


def bench_shape(shape: BenchShape, ctx: RunContext) -> dict:
    spec = shape.spec
    if ctx.on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    problem = build_problem(spec, ctx.device, draw_on_device=True)
    rows_, heads, groups = error_slice(spec)
    exact = reference_out(problem, rows_, heads, groups)
    nbytes = io_bytes(spec)
    record = dict(label=shape.label, tags=list(shape.tags), spec=dataclasses.asdict(spec),
                  io_bytes=nbytes, copy_bound_ms=nbytes / (ctx.copy_gbps * 1e6),
                  nominal_bound_ms=nbytes / (NOMINAL_GBPS * 1e6),
                  error_slice=dict(batch=rows_, heads=heads,
                                   whole=(rows_, heads) == (spec.batch, spec.nheads)),
                  rows={}, unavailable={})
    rows = record["rows"]
    for group, names in ROW_GROUPS:
        build = _group_builder(group, ctx)
        if isinstance(build, str):
            record["unavailable"].update({name: build for name in names})
            continue
        contenders = build(problem)
        while True:
            try:
                contender = next(contenders)
            except StopIteration:
                break
            except Exception as exc:  # preparing a row failed (ours: a broken cuTile)
                for name in names:
                    rows.setdefault(name, dict(failed=f"{type(exc).__name__}: {exc}"))
                break
            timed = [contender]
            if contender.name in GRAPHED_ROWS:
                if ctx.on_gpu:
                    timed.append(graph_replay(contender))
                else:
                    record["unavailable"][contender.name + GRAPH] = "CUDA graphs need a GPU"
            for row in timed:
                try:
                    rows[row.name] = _row(row, ctx, nbytes, spec, exact, (rows_, heads))
                except Exception as exc:
                    rows[row.name] = dict(chunk_size=row.chunk_size,
                                          failed=f"{type(exc).__name__}: {exc}")
            del contender, timed, row   # frees a row's operands (and graph) before the next row
        del contenders
    record["speedup"] = speedups(record)
    record["peak_memory_bytes"] = torch.cuda.max_memory_allocated() if ctx.on_gpu else None
    record["wall_s"] = round(time.perf_counter() - started, 2)
    return record


def speedups(record: dict) -> dict:
    """peer time / our time for every peer row measured beside ours (> 1: ours is faster), and
    a peer's graph replay over ours' under the peer's graph row name."""
    rows = record["rows"]
    pairs = ([(name, OURS) for name in PEER_ROWS]
             + [(name, OURS + GRAPH) for name in PEER_GRAPH_ROWS])
    return {peer: rows[peer]["ms"] / rows[ours]["ms"] for peer, ours in pairs
            if rows.get(peer, {}).get("ms") is not None
            and rows.get(ours, {}).get("ms") is not None}


def run(shapes: list[BenchShape], plan: TimingPlan, budget_s: Optional[float] = None,
        log=print, checkpoint=None, our_chunk_size: Optional[int] = None) -> dict:
    """Measure every shape; the bench.json document (``checkpoint(doc)`` after each shape).
    our_chunk_size: ours at that chunk size, None: at the one ssd_forward picks per call."""
    started = time.perf_counter()
    peers = {}
    for name, load in (("mamba_ssm", load_mamba_ssm), ("fla", load_fla)):
        try:
            peers[name] = load()
        except PeerUnavailable as exc:
            peers[name] = exc
    timer = CudaTimer(plan)
    probe = copy_probe(timer)
    log(f"copy probe: {probe['gbps']:.0f} GB/s ({probe['bytes_moved'] / 2**30:.0f} GiB moved, "
        f"median of {probe['reps']})")
    ctx = RunContext(timer=timer, copy_gbps=probe["gbps"], peers=peers,
                     our_chunk_size=our_chunk_size)
    doc = dict(schema=SCHEMA, provenance=collect(),
               timing=dict(method="CUDA events around each call after warm-up, median; L2 flushed "
                                  "(256 MiB memset) before every timed call; first call untimed",
                           l2_flush_bytes=L2_FLUSH_BYTES, **dataclasses.asdict(plan)),
               definitions=dict(io_bytes=io_bytes.__doc__,
                                flops=" ".join(chunked_flops.__doc__.split()),
                                error=f"properties.metrics.error_metrics vs the float64 chunked "
                                      f"reference (chunk {REFERENCE_CHUNK_SIZE}) on error_slice",
                                speedup="peer ms / ours ms (a peer's graph row over ours_graph)",
                                rows=ROW_DESCRIPTIONS),
               copy_probe=probe, nominal_gbps=NOMINAL_GBPS, our_chunk_size=our_chunk_size,
               peers={name: v[1] if isinstance(v, tuple) else str(v)
                      for name, v in peers.items()},
               shapes=[], not_run=[], failed_shapes=[])
    measure_shapes(shapes, ctx, doc, budget_s, log, checkpoint)
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    return doc


def measure_shapes(shapes: list[BenchShape], ctx: RunContext, doc: dict,
                   budget_s: Optional[float] = None, log=print, checkpoint=None) -> None:
    """Measure each shape into ``doc``; ``checkpoint(doc)`` after each, so an interrupted run
    keeps what it measured. A shape that fails as a whole (say, out of memory building its
    inputs) is recorded in ``failed_shapes`` and the run goes on."""
    started = time.perf_counter()
    for shape in shapes:
        if budget_s is not None and time.perf_counter() - started > budget_s:
            doc["not_run"].append(shape.label)
            continue
        try:
            record = bench_shape(shape, ctx)
        except Exception as exc:  # noqa: BLE001 -- one shape must not lose the others
            doc["failed_shapes"].append(dict(label=shape.label, error=f"{type(exc).__name__}: {exc}"))
            log(f"{shape.label}: FAILED {type(exc).__name__}: {exc}")
            if ctx.on_gpu:
                torch.cuda.empty_cache()
        else:
            doc["shapes"].append(record)
            ours = record["rows"].get(OURS, {})
            log(f"{shape.label}: ours {ours.get('ms', float('nan')):.3f} ms "
                f"{' '.join(f'{k} x{v:.2f}' for k, v in record['speedup'].items())} "
                f"({record['wall_s']:.1f} s)")
        if checkpoint is not None:
            checkpoint(doc)
    if doc["not_run"]:
        log(f"time budget of {budget_s:.0f} s spent: not run: {', '.join(doc['not_run'])}")


def our_failures(doc: dict) -> list[str]:
    """'shape: row: why' for every row of ours that failed (peers failing are only reported)."""
    failed = [f"{f['label']}: all rows: {f['error']}" for f in doc.get("failed_shapes", [])]
    for record in doc["shapes"]:
        for name, row in record["rows"].items():
            if name.startswith(OURS) and "failed" in row:
                failed.append(f"{record['label']}: {name}: {row['failed']}")
    return failed


# ---------------------------------------------------------------- output

COLUMNS = ("row", "Q", "ms", "GB/s", "TFLOP/s", "copy-bound", f"{NOMINAL_GBPS / 1000:.1f}TB/s",
           "t/t_ours", "max|err|", "norm rel")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_row(name: str, row: dict, ours_ms: Optional[float]) -> list[str]:
    if "failed" in row:
        return [name, _num(row.get("chunk_size"), "d"), f"FAILED: {row['failed']}"]
    error = row.get("error") or {}
    ratio = None if ours_ms is None or name in (OURS, OURS + GRAPH) else row["ms"] / ours_ms
    return [name, _num(row.get("chunk_size"), "d"), _num(row["ms"], ".3f"),
            _num(row.get("gbps"), ".0f"), _num(row.get("tflops"), ".1f"),
            _num(row.get("copy_bound_fraction"), ".0%"),
            _num(row.get("nominal_bound_fraction"), ".0%"), _num(ratio, ".2f"),
            _num(error.get("max_abs"), ".2e"), _num(error.get("normwise_rel"), ".2e")]


def _kernel_names(variant: str) -> str:
    """A stage row's ``variant`` (its kernels' describe(), '; '-joined) as the kernels' names."""
    if variant.startswith("none: "):
        return f"none ({variant[len('none: '):]})"
    return " + ".join(part.split()[0] for part in variant.split("; "))


def _cache_words(doc: dict) -> str:
    """What ours' first calls compiled, by the run's cuTile disk cache (its provenance)."""
    prov = doc.get("provenance", {})
    if "cutile_disk_cache" not in prov:
        return "ours' compiles, cuTile's disk cache not recorded"
    if prov["cutile_disk_cache"] is None:
        return "ours' compiles included: cuTile's disk cache off"
    return f"ours' compiles but of kernels in cuTile's disk cache, {prov['cutile_disk_cache']}"


def format_table(doc: dict) -> str:
    """The terminal table: one block per shape, a row per implementation or stage."""
    probe = doc["copy_probe"]
    lines = [f"copy probe {probe['gbps']:.0f} GB/s; nominal {doc['nominal_gbps']:.0f} GB/s; "
             f"{doc['timing']['method']}",
             "t/t_ours: a peer's time over ours (> 1: ours is faster; a graph row's over "
             "ours_graph); a stage's share of ours. Errors vs float64."]
    if "runs" in doc:
        lines.append(f"{len(doc['runs'])} runs: each shape from the run of its median kernel "
                     f"time over the copy bound (run numbers from 0, as in the JSON's 'runs')")
    for record in doc["shapes"]:
        cut = record["error_slice"]
        where = "" if cut["whole"] else f"; errors on batch[:{cut['batch']}] heads[:{cut['heads']}]"
        if "from_run" in record:
            where += f"; run {record['from_run']}"
        lines.append("")
        lines.append(f"{record['label']}  ({record['io_bytes'] / 1e6:.0f} MB in+out, copy bound "
                     f"{record['copy_bound_ms']:.3f} ms{where})")
        # A graph row's t/t_ours is over ours' graph row, any other's over ours' call.
        ours_ms = {suffix: record["rows"].get(OURS + suffix, {}).get("ms")
                   for suffix in ("", GRAPH)}
        table = [list(COLUMNS)]
        table += [format_row(name, row, ours_ms[GRAPH if name.endswith(GRAPH) else ""])
                  for name, row in record["rows"].items()]
        widths = [max(len(r[i]) for r in table if i < len(r) and len(r) == len(COLUMNS))
                  for i in range(len(COLUMNS))]
        for r in table:
            if len(r) == len(COLUMNS):
                lines.append("  " + "  ".join(c.rjust(w) if i else c.ljust(w)
                                              for i, (c, w) in enumerate(zip(r, widths))))
            else:
                lines.append("  " + r[0].ljust(widths[0]) + "  " + "  ".join(r[1:]))
        # Which kernels each stage row times: where the walk fuses stages 2 and 3, the states'
        # row launches none and compute_out's times the walk.
        kernels = [f"{name[len(OURS) + 1:]}: {_kernel_names(row['variant'])}"
                   for name, row in record["rows"].items()
                   if name.startswith(OURS + ".") and "variant" in row]
        if kernels:
            lines += textwrap.wrap("stages' kernels: " + "; ".join(kernels), 100,
                                   initial_indent="  ", subsequent_indent="    ")
        first = [f"{name} {row['first_call_s']:.2f}" for name, row in record["rows"].items()
                 if "first_call_s" in row and not name.startswith(OURS + ".")
                 and not name.endswith(GRAPH)]
        if first:
            lines += textwrap.wrap(f"first call, s ({_cache_words(doc)}): "
                                   + ", ".join(first), 100, initial_indent="  ",
                                   subsequent_indent="    ")
        for name, why in record.get("unavailable", {}).items():
            lines.append(f"  {name}: not run ({why})")
    lines += ["", SUMMARY_TITLE] + _summary(doc)
    if doc.get("not_run"):
        lines.append("")
        lines.append("not run (time budget): " + ", ".join(doc["not_run"]))
    for failed in doc.get("failed_shapes", []):
        lines.append(f"FAILED {failed['label']}: {failed['error']}")
    return "\n".join(lines)


SUMMARY_TITLE = "summary (x: peer time / ours; x mamba_ssm_graph: its replay / ours_graph's)"


def _summary(doc: dict) -> list[str]:
    compared = (*PEER_ROWS, *PEER_GRAPH_ROWS)
    table = [["shape", "ours ms", "GB/s", "copy-bound", *(f"x {name}" for name in compared),
              "norm rel"]]
    for record in doc["shapes"]:
        ours = record["rows"].get(OURS, {})
        if "ms" not in ours:
            table.append([record["label"], "FAILED"] + [""] * (len(table[0]) - 2))
            continue
        table.append([record["label"], f"{ours['ms']:.3f}", f"{ours['gbps']:.0f}",
                      f"{ours['copy_bound_fraction']:.0%}",
                      *(_num(record["speedup"].get(name), ".2f") for name in compared),
                      _num((ours.get("error") or {}).get("normwise_rel"), ".2e")])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                              for i, (c, w) in enumerate(zip(row, widths)))).rstrip()
            for row in table]


PLOTTED = (("ours", "tab:green", "-"), ("mamba_ssm", "tab:blue", "-"),
           ("fla_e2e", "tab:orange", "-"), ("fla_kernel", "tab:orange", ":"))


def plot_scaling(doc: dict, path: Path) -> bool:
    """Time and GB/s against seqlen for the scaling shapes (PNG); False when there are none."""
    shapes = [s for s in doc["shapes"] if "scaling" in s["tags"]]
    if not shapes:
        return False
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_ms, ax_bw) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, color, style in PLOTTED:
        for batch, marker in zip(sorted({s["spec"]["batch"] for s in shapes}), "os^D"):
            points = sorted(((s["spec"]["seqlen"], s["rows"][name]) for s in shapes
                             if s["spec"]["batch"] == batch and s["rows"].get(name, {}).get("ms")),
                            key=lambda point: point[0])
            if not points:
                continue
            seqlens = [p[0] for p in points]
            label = f"{name} b{batch}"
            ax_ms.plot(seqlens, [p[1]["ms"] for p in points], style, color=color, marker=marker,
                       label=label)
            ax_bw.plot(seqlens, [p[1]["gbps"] for p in points], style, color=color, marker=marker)
    ax_bw.axhline(doc["copy_probe"]["gbps"], color="gray", linestyle="--",
                  label=f"copy probe {doc['copy_probe']['gbps']:.0f} GB/s")
    ax_bw.axhline(doc["nominal_gbps"], color="black", linestyle=":",
                  label=f"nominal {doc['nominal_gbps']:.0f} GB/s")
    spec = shapes[0]["spec"]
    dims = (f"H{spec['nheads']} P{spec['headdim']} N{spec['dstate']} G{spec['ngroups']} "
            f"{spec['x_dtype']}")
    for ax, ylabel in ((ax_ms, "ms (median, L2 flushed)"), (ax_bw, "GB/s (inputs + output once)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.set_yscale("log")
    ax_ms.legend(fontsize=7)
    ax_bw.legend(fontsize=7)
    fig.suptitle(f"SSD forward scaling, {dims}, {doc['provenance'].get('device', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


STAGE_COLORS = {"chunk_cumsum": "tab:olive", "fwd_pass_state": "tab:green",
                "compute_out": "darkgreen"}


def plot_shapes(doc: dict, path: Path) -> bool:
    """Per measured shape, horizontal bars of ms: ours split into its stages (each timed alone,
    so their sum may differ from the whole call, drawn as a black outline), each peer, and a tick
    at the copy bound (PNG); False when ours ran on no shape."""
    shapes = [s for s in doc["shapes"] if s["rows"].get(OURS, {}).get("ms")]
    if not shapes:
        return False
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [OURS] + [n for n in PEER_ROWS if any(s["rows"].get(n, {}).get("ms") for s in shapes)]
    peer_style = {"mamba_ssm": dict(color="tab:blue"),
                  "fla_kernel": dict(color="moccasin", edgecolor="tab:orange", hatch="//"),
                  "fla_e2e": dict(color="tab:orange")}
    height = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.45 * len(names) * len(shapes)))
    for i, shape in enumerate(shapes):
        for k, name in enumerate(names):
            row = shape["rows"].get(name, {})
            y = i + k * height
            if name == OURS:
                left = 0.0
                for stage in STAGES:
                    ms = shape["rows"].get(f"{OURS}.{stage}", {}).get("ms")
                    if ms:
                        ax.barh(y, ms, height, left=left, color=STAGE_COLORS[stage],
                                label=f"ours: {stage}" if i == 0 else None)
                        left += ms
                ax.barh(y, row["ms"], height, fill=False, edgecolor="black",
                        label="ours: whole call" if i == 0 else None)
            elif row.get("ms"):
                ax.barh(y, row["ms"], height, label=name if i == 0 else None, **peer_style[name])
        ax.plot([shape["copy_bound_ms"]] * 2, [i - height / 2, i + (len(names) - 0.5) * height],
                color="gray", linestyle="--", label="copy bound" if i == 0 else None)
    ax.set_yticks([i + (len(names) - 1) * height / 2 for i in range(len(shapes))])
    ax.set_yticklabels([s["label"] for s in shapes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median, L2 flushed)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    prov = doc["provenance"]
    ax.set_title(f"SSD forward per shape, {prov.get('device', '?')}, "
                 f"commit {str(prov.get('git_commit', '?'))[:7]}, {prov.get('date', '?')[:10]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def write_outputs(doc: dict, out_dir: Path) -> list[Path]:
    written = [write_json(out_dir / "bench.json", doc),
               atomic_write(out_dir / "bench.txt", format_table(doc) + "\n")]
    for plot, name in ((plot_shapes, "bench_shapes.png"), (plot_scaling, "bench_scaling.png")):
        if plot(doc, out_dir / name):
            written.append(out_dir / name)
    return written


# ---------------------------------------------------------------- --check

def kernel_ms(record: dict) -> Optional[float]:
    """ours' kernel time: its stage rows summed (None unless every one of STAGES has a time)."""
    times = [record["rows"].get(f"{OURS}.{stage}", {}).get("ms") for stage in STAGES]
    return None if None in times else sum(times)


def judged_ratio(record: dict) -> Optional[float]:
    """What --check compares: ours' kernel time over the record's copy bound (same run)."""
    ms = kernel_ms(record)
    return None if ms is None else ms / record["copy_bound_ms"]


def merge_runs(docs: list[dict], latest: bool = False) -> dict:
    """One document from several runs: for each shape (in first-run order), the record of the
    run whose judged ratio (``judged_ratio``) is that shape's median (the upper of the two
    middle ones for an even count), or with ``latest`` of the last run that measured it,
    marked ``from_run``. The runs must agree on how ours picked its chunk size. Provenance is
    the first run's; ``runs`` lists every run's provenance and copy probe."""
    if len(docs) == 1:
        return docs[0]
    picks = {doc.get("our_chunk_size") for doc in docs}
    if len(picks) > 1:
        raise SystemExit(f"bench: --results: the runs differ in --chunk-size "
                         f"({', '.join(map(str, picks))}): their ratios are not one "
                         f"configuration's")
    records: dict[str, list] = {}
    for index, doc in enumerate(docs):
        for record in doc["shapes"]:
            records.setdefault(record["label"], []).append((index, record))
    shapes = []
    for label, found in records.items():
        if latest:
            index, record = found[-1]
        else:
            timed = sorted(((i, r) for i, r in found if judged_ratio(r) is not None),
                           key=lambda item: judged_ratio(item[1]))
            index, record = timed[len(timed) // 2] if timed else found[0]
        shapes.append(dict(record, from_run=index))
    measured = set(records)
    merged = dict(docs[0], shapes=shapes,
                  not_run=sorted({label for doc in docs for label in doc.get("not_run", [])}
                                 - measured),
                  runs=[dict(provenance=doc.get("provenance"), copy_probe=doc.get("copy_probe"),
                             shapes=len(doc["shapes"])) for doc in docs])
    merged.pop("wall_s", None)
    return merged


def chunk_size_given(doc: dict) -> bool:
    """Whether ours ran at a --chunk-size given to the bench, rather than at the one ssd_forward
    picks per call (``our_chunk_size``; a run from before that field had one given when its
    command line names --chunk-size)."""
    if "our_chunk_size" in doc:
        return doc["our_chunk_size"] is not None
    return "--chunk-size" in doc.get("provenance", {}).get("command", "")


def check_regressions(current: dict, baseline: dict, margin: float = DEFAULT_MARGIN):
    """(failures, lines): a failure names a shape whose ours' kernel time over the copy bound
    (``judged_ratio``) exceeds the baseline's by more than ``margin``, or where ours did not run;
    lines report every shape, with ours/mamba_ssm call ratios for the reader (not judged). A
    shape whose kernels took under KERNEL_FLOOR_MS in either run is reported, not judged."""
    measured = {record["label"]: record for record in current["shapes"]}
    failures, lines = [], []
    compared = 0
    for base in baseline["shapes"]:
        label = base["label"]
        then = judged_ratio(base)
        if label not in measured or then is None:
            why = "not measured in this run" if label not in measured else \
                "no kernel time of ours in the baseline"
            lines.append(f"{label}: not compared ({why})")
            continue
        record = measured[label]
        now = judged_ratio(record)
        if now is None:
            why = next((f"{name}: {row['failed']}" for name, row in record["rows"].items()
                        if name.startswith(OURS) and "failed" in row), "no row")
            failures.append(f"{label}: ours did not run ({why})")
            continue
        base_q = base["rows"][OURS].get("chunk_size")
        now_q = record["rows"][OURS].get("chunk_size")
        # A chunk size given to either run makes another chunk another configuration; where
        # both took ssd_forward's pick, a new pick is part of what its default speed measures.
        if base_q != now_q and (chunk_size_given(current) or chunk_size_given(baseline)):
            failures.append(f"{label}: our chunk size {now_q} differs from the baseline's "
                            f"{base_q}: the ratios are not comparable")
            continue
        notes = f" (ssd_forward's chunk {base_q} -> {now_q})" if base_q != now_q else ""
        peer = [r[OURS]["ms"] / r[PEER_ROWS[0]]["ms"] for r in (record["rows"], base["rows"])
                if r.get(OURS, {}).get("ms") and r.get(PEER_ROWS[0], {}).get("ms")]
        if len(peer) == 2:
            notes += (f"; ours/{PEER_ROWS[0]} calls {peer[0]:.2f}, baseline {peer[1]:.2f} "
                      f"(not judged)")
        kernels = (kernel_ms(record), kernel_ms(base))
        if min(kernels) < KERNEL_FLOOR_MS:
            lines.append(f"{label}: not judged: ours' kernels took {kernels[0]:.3f} ms "
                         f"(baseline {kernels[1]:.3f}), under {KERNEL_FLOOR_MS} ms, where their "
                         f"launches' host time shows{notes}")
            continue
        compared += 1
        limit = then * (1 + margin)
        line = (f"{label}: ours' kernels {kernels[0]:.3f} ms / copy bound "
                f"{record['copy_bound_ms']:.3f} ms = {now:.2f}, baseline {then:.2f}, limit "
                f"{limit:.2f} (+{margin:.0%})")
        lines.append(line + notes + ("  REGRESSED" if now > limit else "  ok"))
        if now > limit:
            failures.append(line)
    if compared == 0 and not failures:
        failures.append("no shape of the baseline was compared: nothing was checked (measure the "
                        "baseline's --shapes)")
    return failures, lines


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", choices=SHAPE_SETS, default="anchors",
                        help="anchors: the three anchor shapes; scaling: seqlen 512..65536 at "
                             "batch 1 and 8; variants: the first anchor with one knob changed "
                             "(headdim, dstate, ngroups, dtype, z and D); all: the three; "
                             "models: the SSD layers of published Mamba-2 models (130m to 2.7b, "
                             "Codestral 7B) as the layer calls them (D per head, dt_bias, "
                             "softplus): a 1 x 16384 prefill returning final states, 8 x 2048 "
                             "out alone; packed: those layers' batched prefill, 16384 tokens "
                             "of 8 sequences by cu_seqlens returning their states, from zero "
                             "and from per-sequence initial states")
    parser.add_argument("--only", default=None, metavar="TEXT[,TEXT]",
                        help="of those shapes, only the ones whose label contains one of these "
                             "texts (e.g. 'N256,G8,fp32' of the variants)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer timed calls per row and three scaling seqlens (a smoke run)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="our chunk size (default: the one ssd_forward picks per call, "
                             "kernels.ssd.default_chunk_size)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for bench.json, bench.txt, bench_shapes.png and "
                             "bench_scaling.png (default "
                             "reports/<device>/, reports/<device>/<set>/ for --shapes models "
                             "and packed; "
                             "with --check nothing is written unless given)")
    parser.add_argument("--check", type=Path, default=None, metavar="BASELINE",
                        help="a committed bench.json: fail, naming the shape, where ours/peer time "
                             "ratio is worse than the baseline's by more than --margin")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="allowed growth of the time ratio over the baseline's (default 0.15)")
    parser.add_argument("--results", type=Path, action="append", default=None,
                        help="read this bench.json instead of measuring: print its table (with "
                             "--out, also write its table and plot there); with --check, compare "
                             "it. Repeated: the runs as one, each shape's record the run's with "
                             "the median judged ratio, ours' kernels over the copy bound (a baseline "
                             "from several runs)")
    parser.add_argument("--latest", action="store_true",
                        help="with --results repeated: each shape's record from the last run "
                             "that measured it, not the median (a shape re-measured after a "
                             "change replaces the baseline's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new shape after this many seconds (the rest is listed as "
                             "not run)")


def _load(path: Path, what: str) -> dict:
    try:
        return read_document(path, SCHEMA)
    except ValueError as exc:
        raise SystemExit(f"bench: the {what}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    if args.latest and len(args.results or ()) < 2:
        print(f"bench: --latest: expected --results given two or more times, got "
              f"{len(args.results or ())}", file=sys.stderr)
        return 2
    try:
        baseline = None if args.check is None else _load(args.check, "baseline")
        if args.results is not None:
            doc = merge_runs([_load(path, "results") for path in args.results], args.latest)
            if args.out is not None:
                for path in write_outputs(doc, Path(args.out)):
                    print(f"wrote {path}", file=sys.stderr)
        else:
            doc = _measure(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    print(format_table(doc))
    status = 0
    failed = our_failures(doc)
    if failed:
        print("\nours failed on:\n  " + "\n  ".join(failed), file=sys.stderr)
        status = 1
    if baseline is not None:
        failures, lines = check_regressions(doc, baseline, args.margin)
        print(f"\ncheck against {args.check}:\n  " + "\n  ".join(lines))
        if failures:
            print("\nbench --check FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
            status = 1
        else:
            print("bench --check passed")
    return status


def default_out_dir(shapes: str) -> Path:
    """reports/<device>/, and for the models' layers and their packed prefills a folder of their
    own there (OWN_FOLDER_SETS): a run of them never replaces the shape sets' bench.json."""
    return REPO_ROOT / "reports" / device_label() / (shapes if shapes in OWN_FOLDER_SETS else "")


def _measure(args: argparse.Namespace) -> dict:
    if args.chunk_size is None:
        import kernels  # noqa: PLC0415
        chunk_size = kernels.DEFAULT_CHUNK_SIZE
    else:
        chunk_size = args.chunk_size
    try:
        shapes = select_shapes(bench_shapes(args.shapes, chunk_size, quick=args.quick), args.only)
    except ValueError as exc:
        raise SystemExit(f"bench: --{exc}") from None
    if not torch.cuda.is_available():
        raise SystemExit("bench: needs a CUDA device and none is visible to torch (use --results "
                         "FILE to print or --check an existing bench.json)")
    out_dir = args.out
    if out_dir is None and args.check is None:
        out_dir = default_out_dir(args.shapes)
    if out_dir is not None and args.check is not None and \
            (Path(out_dir) / "bench.json").resolve() == Path(args.check).resolve():
        raise SystemExit(f"bench: --out would overwrite the baseline {args.check}; write the new "
                         f"run elsewhere")
    checkpoint = None if out_dir is None else \
        (lambda partial: write_json(Path(out_dir) / "bench.json", partial))
    doc = run(shapes, QUICK_TIMING if args.quick else FULL_TIMING, budget_s=args.budget_s,
              log=lambda line: print(line, file=sys.stderr, flush=True), checkpoint=checkpoint,
              our_chunk_size=args.chunk_size)
    if out_dir is not None:
        for path in write_outputs(doc, Path(out_dir)):
            print(f"wrote {path}", file=sys.stderr)
    return doc
