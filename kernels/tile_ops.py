"""What the three SSD kernels share: matmul precision modes, safe exponentials, softplus, and the
host-side bookkeeping of kernel variants (dtypes, 64-bit indexing, signatures as declared and as a
launch specializes them).

Precision modes (``ct.mma`` operands; accumulation is always float32):

    ieee    float32 operands on FMA units: float32 products, no tensor cores.
    3xtf32  split precision on tensor cores, 3 MMAs. Two float32 operands: a = hi + lo with
            hi = tf32(a), lo = tf32(a - hi) (round to nearest), a.b ~ hi.hi + hi.lo + lo.hi; the
            dropped lo.lo and the rounding of lo leave ~2^-22 relative per product. A 16-bit
            operand is exact in TF32: the other one is split in three (hi + mid + lo, 33 bits),
            so each product is exact to ~2^-33.
    tf32    operands rounded to TF32 (10-bit mantissa, ~2^-11 relative per operand).
    input   operands rounded to the 16-bit input dtype (bf16 / fp16), mamba_ssm's choice.
    2xbf16  for bf16 inputs: against a raw bf16 operand, the float32 one is cut into 2 bf16 terms
            (hi + lo, rounded to nearest: 2 x 8 bits, ~2^-18 relative per product) on bf16
            tensor cores, 2 MMAs. The operands keep bf16's bytes and layouts through shared
            memory, where TF32 ones cost the output kernel most of its time (ncu on the H200).
    3xbf16  the same in 3 bf16 terms (~2^-27 relative: float32-grade), 3 bf16 MMAs, which take
            the tensor cores half the time of 3xtf32's three TF32 ones. Two float32 operands are
            each cut in 3 bf16 terms a1 + a2 + a3 (|a2| <= 2^-9 |a|, |a3| <= 2^-18 |a|) and
            multiplied in the 6 MMAs whose products exceed ~2^-27 relative (a1b1, a1b2, a2b1,
            a1b3, a3b1, a2b2): ~2^-26 per product, below float32's own rounding (float32 x's
            default: "ieee" runs on the FMA units at ~1% of their peak).
            An fp16 operand goes the same way: its 11 bits are exact in two bf16 terms (the
            third is 0) and bf16 has float32's range, where fp16 terms would overflow past 65504.
            2xbf16 falls back to the 3xtf32 split where neither operand is raw bf16.
    2xfp16  for fp16 inputs: against a raw fp16 operand, the float32 one is scaled by a power of
            two per row (or column) of the product, putting its largest magnitude there in
            [2^14, 2^15), and cut into 2 fp16 terms: each element to ~2^-22 of its row's largest
            (fp16 subnormals lose relative bits only far below it), no overflow (unscaled fp16
            terms overflow past 65504). 2 fp16 MMAs, which keep 16-bit bytes and layouts as
            2xbf16's do, in a fresh accumulator scaled back exactly (powers of two).
    3xfp16  the same in 3 fp16 terms (~2^-33 of the row's largest: float32-grade).
            Both fall back to the 3xtf32 split where neither operand is raw fp16.

Where both operands are cut (two float32 ones in 3xtf32; two that are not raw bf16 in 3xbf16),
the product is summed in a fresh accumulator and added to the running one in float32
round-to-nearest. The tensor cores' own float32 sums are coarser than round-to-nearest additions
(how, NVIDIA does not document); chained through a running accumulator, their errors are
relative to its largest partial sums (the carried state's term in compute_out, a whole chunk in
chunk_state), not to each product. On the H200, at fp32-near-unit-decay-L4097-Q256, chained sums
put the output at 2.12 (3xtf32; reports/h200/gpu_report.md as of c091e22) and 1.52-2.01
(3xbf16; reports/h200/experiments/gpu_report_fp32_fp16_default_3xbf16_21b71eb.md) of the
float32 rule; fresh ones at 0.28 and 0.18, "ieee" at 0.22 (reports/h200/gpu_report.md, 2051bb9).
A CPU model whose tensor cores add each instruction's k-step exactly and truncate to float32
reproduces both verdicts (tests/test_precision_model.py); with float32 sums it had seen neither
failure.

A product of two raw 16-bit inputs of one dtype (C . B^T with bf16 B and C) is exact in every mode
and always runs in that dtype.

Subnormal operands, a known limit of the cuts: bf16 and TF32 share float32's exponent range, so a
term holds an operand's bits only down to its own subnormal spacing, 2^-133 (bf16) or 2^-136 (TF32).
A float32 operand below 2^-126 (a decay below 2^-126 within a chunk, times dt, x or B) keeps a few
leading bits. Where such a product meets a term of 1e6 (outputs near 1e-33), out erred by 2% of its
values, 25-390 times the float32 rule's allowance (large x, float32 x), and final_states by 110-970
times it (large B, float32 or bf16 x; with fp16 x and a term of 1e4, 10-85 times): on the H200 at
797e011 and 4eb89bd in 3xbf16 (float32's default), 3xtf32 and 2xbf16, and in the bf16 default's
final states ("ieee" passed, and fp16's own splits, which scale each row of the cut operand;
tests/test_properties.py, decays below the smallest normal, and tests/test_kernels_gpu.py for the
walk mark the misses). Cutting 2^16 above the operands' scale fixes them, and costs the top of
float32's range instead: on the H200 the terms after the first lifted where both operands are cut
(af31375: 0.95-1.03x the time, outputs bit-equal; reports/h200/experiments/
subnormal_lift_af31375.txt) returned inf for float32 x and B of 3e18 (final states ~4e36, out
~2e37, finite; out and final states in 3xbf16, float32's default, out in 3xtf32), and dt lifted
where chunk_cumsum stores it, with the walk's state carried lifted and chunk_state's increments
lifted (1439ebb: 0.993-1.011x, outputs bit-equal), did for bf16 x and B of 3e17 (final states
~4e34, out ~2e35): subnormal_lift_dt_source_1439ebb.txt.
Neither is kept: an inf or NaN where the rule owes a finite number is a worse miss than a few bits
of a state near 1e-33, and 379c48a's cuts return both of those calls within the rule
(tests/test_properties.py, final states near the top of float32's range). Multiplying the
operands below 2^-100 apart, lifted 2^64 against the other operand lowered 2^-64, fixed both
ends, but its code in these functions cost the default cut paths 1.19-2.02x on the H200, mostly
where it never ran (reports/h200/experiments/subnormal_guard_3974a92.txt, with the patch).
"""
from __future__ import annotations

import functools
import math
import types

import cuda.tile as ct
import torch
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

from kernels.device import sm_count

LOG2_E = math.log2(math.e)
# Every kernel treats softplus(v) as v above this (e^-20 ~ 2e-9 absolute), as the contract allows.
SOFTPLUS_IDENTITY_THRESHOLD = 20.0

PRECISIONS = ("ieee", "3xtf32", "tf32", "input", "2xbf16", "3xbf16", "2xfp16", "3xfp16")
MODE = {name: i for i, name in enumerate(PRECISIONS)}
(MODE_IEEE, MODE_3XTF32, MODE_TF32, MODE_INPUT, MODE_2XBF16, MODE_3XBF16, MODE_2XFP16,
 MODE_3XFP16) = (MODE[p] for p in PRECISIONS)
# The fp16 splits' scaling: float32's exponent bits, and the smallest power of two a row's
# largest magnitude is taken as (an all-zero row; 2^14 / 2^-110 stays finite).
FLOAT32_EXPONENT_BITS = 0x7F800000
SCALE_FLOOR = 2.0**-110

CT_DTYPE = {torch.float32: ct.float32, torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
            torch.int32: ct.int32, torch.int64: ct.int64}
# Arrays at or above this many addressable elements need 64-bit shape/stride/offset arithmetic.
INT32_LIMIT = 2**31


# ----------------------------------------------------------------------------- tile code

@ct.function
def exp2_nonpos(exponent):
    """2^min(exponent, 0): decays never exceed 1, and a masked (positive) difference never
    overflows into an inf that a 0 would later multiply into NaN. A NaN exponent (NaN dt) stays
    NaN: it must reach the outputs it touches."""
    return ct.exp2(ct.minimum(exponent, 0.0, propagate_nan=True))


@ct.function
def softplus(v):
    """log(1 + e^v) = max(v, 0) + log1p(t), t = e^-|v| in (0, 1]; the identity above
    SOFTPLUS_IDENTITY_THRESHOLD. log1p(t) = 2 atanh(s) with s = t / (2 + t) <= 1/3, summed as
    2 s (1 + s^2/3 + ... + s^14/15) (truncation < 1e-9 relative): a few ulp for every t, where
    log(1 + t) loses ~eps/t relatively (1e-4 at dt ~ 1e-3) and a fast log near 1 loses more."""
    t = ct.exp(-ct.abs(v), rounding_mode=ct.RoundingMode.FULL)
    s = t / (2.0 + t)
    s2 = s * s
    series = 1.0 / 15.0
    for odd in ct.static_iter((13.0, 11.0, 9.0, 7.0, 5.0, 3.0, 1.0)):
        series = series * s2 + 1.0 / odd
    smooth = ct.maximum(v, 0.0, propagate_nan=True) + 2.0 * s * series
    return ct.where(v > SOFTPLUS_IDENTITY_THRESHOLD, v, smooth)


@ct.function
def two_sum_add(hi1, lo1, hi2, lo2):
    """(hi1 + lo1) + (hi2 + lo2) as an unevaluated sum hi + lo: hi = fl(hi1 + hi2) and its exact
    rounding error (Knuth's TwoSum) joins the low parts: the backward walk's sum of chunk decays
    (kernels/state_scan.py)."""
    hi = hi1 + hi2
    back = hi - hi1
    error = (hi1 - (hi - back)) + (hi2 - back)
    return hi, (lo1 + lo2) + error


@ct.function
def load_log2_cumsum(log2_decay_cumsum, batch, head, chunk, block, SIZE: ct.Constant[int]):
    """(hi, lo), each (SIZE,): the compensated cumsum of positions block*SIZE.. of a chunk. One
    (2, SIZE) tile, one TMA copy: against a load per row, outputs bit for bit the same, the
    states stage 0.7-2.8% and compute_out 0.1-1.8% faster at the three anchors on the H200
    (experiments/ab_cumsum_3a20e7e.txt)."""
    both = ct.load(log2_decay_cumsum, (batch, head, chunk, 0, block),
                   shape=(1, 1, 1, 2, SIZE)).reshape((2, SIZE))
    hi = ct.extract(both, (0, 0), shape=(1, SIZE))
    lo = ct.extract(both, (1, 0), shape=(1, SIZE))
    return hi.reshape((SIZE,)), lo.reshape((SIZE,))


@ct.function
def log2_cumsum_at(log2_decay_cumsum, batch, head, chunk, position):
    """(hi, lo), 0-d: the compensated cumsum at one chunk-local position."""
    hi = ct.load(log2_decay_cumsum, (batch, head, chunk, 0, position), shape=(1, 1, 1, 1, 1))
    lo = ct.load(log2_decay_cumsum, (batch, head, chunk, 1, position), shape=(1, 1, 1, 1, 1))
    return hi.reshape(()), lo.reshape(())


@ct.function
def log2_decay_between(hi_to, lo_to, hi_from, lo_from):
    """S_to - S_from of the compensated cumsum: the high parts' difference is exact or rounded
    relative to itself (not to |S| ~ tens), so the decay between nearby positions keeps float32
    accuracy however far the chunk has decayed."""
    return (hi_to - hi_from) + (lo_to - lo_from)


@ct.function
def log2_decay_since(log2_decay_cumsum, dt, A, batch, head, chunk, start, hi_to, lo_to):
    """The log2 decay from just before chunk-local position ``start`` to the position whose
    cumsum is (hi_to, lo_to): (S_to - S_start) + dt_start * A * log2(e). The step at ``start`` is
    recomputed exactly as chunk_cumsum summed it, not taken as S_start - S_(start-1), which would
    add a rounding of that difference."""
    hi_start, lo_start = log2_cumsum_at(log2_decay_cumsum, batch, head, chunk, start)
    step = ct.load(dt, (batch, head, chunk, start), shape=(1, 1, 1, 1)).reshape(())
    a = ct.load(A, (head,), shape=())
    return log2_decay_between(hi_to, lo_to, hi_start, lo_start) + step * (a * LOG2_E)


@ct.function
def latency_hint(LATENCY: ct.Constant[int]):
    """ct.load's latency hint from a config's knob: 1 (low) to 10 (high) DRAM traffic, or None
    (the compiler infers it) for 0."""
    return LATENCY if LATENCY > 0 else None


@ct.function
def load_transposed(array, i0, rows, i2, cols, ROWS: ct.Constant[int], COLS: ct.Constant[int],
                    ORDERED: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """The (1, ROWS, 1, COLS) tile of a 4-d array at tile index (i0, rows, i2, cols), as a
    (COLS, ROWS) tile: read in transposed order by the load (ORDERED) or loaded and transposed.
    LATENCY: the load's DRAM latency hint, 1 (low) to 10 (high); 0 leaves it to the compiler."""
    if ORDERED:
        t = ct.load(array, (i0, cols, i2, rows), shape=(1, COLS, 1, ROWS), order=(0, 3, 2, 1),
                    padding_mode=ct.PaddingMode.ZERO,
                    latency=latency_hint(LATENCY)).reshape((COLS, ROWS))
    else:
        t = ct.load(array, (i0, rows, i2, cols), shape=(1, ROWS, 1, COLS),
                    padding_mode=ct.PaddingMode.ZERO,
                    latency=latency_hint(LATENCY)).reshape((ROWS, COLS)).transpose()
    return t


@ct.function
def is_16bit(t):
    """Whether t is bf16 or fp16 (then exact in TF32)."""
    return t.dtype == ct.bfloat16 or t.dtype == ct.float16


@ct.function
def silu_gated(y, z, out):
    """y z sigmoid(z), z float32, for the output array ``out``: z / (1 + e^-z), where e^-z = inf
    for very negative z gives z / inf = -0. Into a 16-bit out, approximate exp and division
    (~2^-21 relative, far below the output's rounding) spare the IEEE division's instructions:
    compute_out with z and D per channel at the first anchor 0.956 -> 0.814 ms; 5.7e-6 of the
    outputs changed, by at most 1.3e-3 of max|out| (experiments/ab_compute_out_gate_c8b44a4.txt).
    A float32 out keeps the exact form."""
    if is_16bit(out):
        return y * ct.truediv(z, 1.0 + ct.exp(-z, rounding_mode=ct.RoundingMode.APPROX),
                              rounding_mode=ct.RoundingMode.APPROX)
    return y * (z / (1.0 + ct.exp(-z)))


@ct.function
def _round(a, DTYPE: ct.Constant):
    """float32 ``a`` rounded to nearest in DTYPE (tfloat32, bfloat16 or float16)."""
    return a.astype(DTYPE, rounding_mode=ct.RoundingMode.RN)


@ct.function
def _tf32(a):
    return _round(a, ct.tfloat32)


@ct.function
def _oriented_mma(exact, term, acc, EXACT_LEFT: ct.Constant[bool]):
    if EXACT_LEFT:
        acc = ct.mma(exact, term, acc)
    else:
        acc = ct.mma(term, exact, acc)
    return acc


@ct.function
def _terms(a, DTYPE: ct.Constant):
    """(hi, mid, lo): float32 ``a`` cut in 3 terms of DTYPE (tfloat32, bfloat16 or float16),
    each rounded to nearest from what the earlier ones left: 11 more bits per TF32 or fp16 term
    (fp16's in its normal range), 8 per bf16 term."""
    hi = _round(a, DTYPE)
    rest = a - hi.astype(ct.float32)
    mid = _round(rest, DTYPE)
    return hi, mid, _round(rest - mid.astype(ct.float32), DTYPE)


@ct.function
def _exact_times_split(exact, split_me, acc, EXACT_LEFT: ct.Constant[bool], DTYPE: ct.Constant,
                       TERMS: ct.Constant[int]):
    """acc + exact @ split_me (or split_me @ exact): ``exact`` is exact in DTYPE (a 16-bit input),
    ``split_me`` float32 cut into TERMS (2 or 3) terms of DTYPE (``_terms``), hi + mid [+ lo]."""
    e = exact.astype(DTYPE)
    hi, mid, lo = _terms(split_me, DTYPE)
    # Small terms first: they are then added to a small accumulator, not lost in a large one.
    if TERMS == 3:
        acc = _oriented_mma(e, lo, acc, EXACT_LEFT)
    acc = _oriented_mma(e, mid, acc, EXACT_LEFT)
    return _oriented_mma(e, hi, acc, EXACT_LEFT)


@ct.function
def _exact_times_scaled_split(exact, split_me, acc, EXACT_LEFT: ct.Constant[bool],
                              TERMS: ct.Constant[int]):
    """acc + exact @ split_me (or split_me @ exact), ``exact`` raw fp16: ``split_me`` (float32)
    scaled by 2^14 / 2^floor(log2(largest |element|)) per column (row without EXACT_LEFT) of the
    product, cut into TERMS (2 or 3) fp16 terms (``_terms``), multiplied in a fresh accumulator
    and scaled back."""
    largest = ct.max(ct.abs(split_me), axis=0 if EXACT_LEFT else 1, keepdims=True)
    power = ct.bitcast(ct.bitcast(ct.maximum(largest, SCALE_FLOOR), ct.int32)
                       & FLOAT32_EXPONENT_BITS, ct.float32)
    e = exact.astype(ct.float16)
    hi, mid, lo = _terms(split_me * (2.0**14 / power), ct.float16)
    product = ct.zeros(acc.shape, dtype=ct.float32)
    if TERMS == 3:
        product = _oriented_mma(e, lo, product, EXACT_LEFT)
    product = _oriented_mma(e, mid, product, EXACT_LEFT)
    product = _oriented_mma(e, hi, product, EXACT_LEFT)
    return acc + product * (power * 2.0**-14)


@ct.function
def _split_times_split(a, b, acc):
    """acc + a @ b, neither operand raw bf16: both cut in 3 bf16 terms and the 6 products above
    ~2^-27 relative summed, smallest first (see _exact_times_split). An fp16 operand's third
    term is 0 (its 11 bits fit in two): the product with it is skipped."""
    a1, a2, a3 = _terms(a.astype(ct.float32), ct.bfloat16)
    b1, b2, b3 = _terms(b.astype(ct.float32), ct.bfloat16)
    if not is_16bit(a):
        acc = ct.mma(a3, b1, acc)
    if not is_16bit(b):
        acc = ct.mma(a1, b3, acc)
    acc = ct.mma(a2, b2, acc)
    acc = ct.mma(a2, b1, acc)
    acc = ct.mma(a1, b2, acc)
    return ct.mma(a1, b1, acc)


@ct.function
def precise_mma(a, b, acc, MODE: ct.Constant[int], LOW_DTYPE: ct.Constant):
    """acc + a @ b in float32 at the precision MODE names (module docstring). LOW_DTYPE is the
    16-bit dtype of MODE_INPUT (ignored by the other modes)."""
    if a.dtype == b.dtype and is_16bit(a):
        acc = ct.mma(a, b, acc)
    elif MODE == MODE_IEEE:
        acc = ct.mma(a.astype(ct.float32), b.astype(ct.float32), acc)
    elif MODE == MODE_TF32:
        acc = ct.mma(_tf32(a.astype(ct.float32)), _tf32(b.astype(ct.float32)), acc)
    elif MODE == MODE_INPUT:
        acc = ct.mma(a.astype(LOW_DTYPE), b.astype(LOW_DTYPE), acc)
    elif (MODE == MODE_2XBF16 or MODE == MODE_3XBF16) and a.dtype == ct.bfloat16:
        acc = _exact_times_split(a, b.astype(ct.float32), acc, True, ct.bfloat16,
                                 2 if MODE == MODE_2XBF16 else 3)
    elif (MODE == MODE_2XBF16 or MODE == MODE_3XBF16) and b.dtype == ct.bfloat16:
        acc = _exact_times_split(b, a.astype(ct.float32), acc, False, ct.bfloat16,
                                 2 if MODE == MODE_2XBF16 else 3)
    elif (MODE == MODE_2XFP16 or MODE == MODE_3XFP16) and a.dtype == ct.float16:
        acc = _exact_times_scaled_split(a, b.astype(ct.float32), acc, True,
                                        2 if MODE == MODE_2XFP16 else 3)
    elif (MODE == MODE_2XFP16 or MODE == MODE_3XFP16) and b.dtype == ct.float16:
        acc = _exact_times_scaled_split(b, a.astype(ct.float32), acc, False,
                                        2 if MODE == MODE_2XFP16 else 3)
    elif MODE == MODE_3XBF16:
        # Both operands cut: a fresh accumulator (module docstring).
        acc = acc + _split_times_split(a, b, ct.zeros(acc.shape, dtype=ct.float32))
    elif is_16bit(a):
        acc = _exact_times_split(a, b.astype(ct.float32), acc, True, ct.tfloat32, 3)
    elif is_16bit(b):
        acc = _exact_times_split(b, a.astype(ct.float32), acc, False, ct.tfloat32, 3)
    else:
        a_hi, a_lo, _ = _terms(a.astype(ct.float32), ct.tfloat32)
        b_hi, b_lo, _ = _terms(b.astype(ct.float32), ct.tfloat32)
        # Both operands cut: a fresh accumulator (module docstring).
        product = ct.mma(a_lo, b_hi, ct.zeros(acc.shape, dtype=ct.float32))
        product = ct.mma(a_hi, b_lo, product)
        acc = acc + ct.mma(a_hi, b_hi, product)
    return acc


# ----------------------------------------------------------------------------- host side

@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A 1-element zero of ``ndim`` dimensions on ``device`` that stands in for an absent array
    (its flag is off, so no kernel reads it): made once per device, dtype and rank, where a fresh
    one per call costs a kernel launch, and views of another array a few microseconds each, on
    the host's critical path."""
    return torch.zeros((1,) * ndim, device=device, dtype=dtype)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def span(t: torch.Tensor) -> int:
    """Elements between t's first and one past its last addressable element (strides included)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)


def needs_int64(*tensors) -> bool:
    return any(t is not None and span(t) >= INT32_LIMIT for t in tensors)


def index_variants(fn, wide_params: tuple[str, ...]) -> dict[bool, ct.kernel]:
    """{False: kernel, True: the same kernel with 64-bit indexing of ``wide_params``}.

    cuTile indexes an array in int32 unless its parameter is annotated ``ct.IndexedWithInt64``;
    offsets past 2^31 elements would wrap. Both variants come from one Python body, so they
    cannot drift apart.
    """
    variants = {}
    for wide in (False, True):
        body = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        body.__qualname__ = fn.__qualname__
        body.__doc__ = fn.__doc__
        body.__annotations__ = dict(fn.__annotations__)
        if wide:
            body.__annotations__.update({p: ct.IndexedWithInt64 for p in wide_params})
        variants[wide] = ct.kernel(body)
    return variants


@functools.lru_cache(maxsize=None)
def with_hints(kernel, occupancy, worker_warps):
    """``kernel`` with cuTile's occupancy hint (expected resident blocks per SM) and its
    num_worker_warps hint (warps in the CUDA-core warp groups of a warp-specialized kernel; 4 or
    8 with tileiras 13.4), None leaving either to the compiler. One object per combination, so
    each is compiled once per process."""
    hints = {name: value for name, value in (("occupancy", occupancy),
                                             ("num_worker_warps", worker_warps))
             if value is not None}
    return kernel.replace_hints(**hints) if hints else kernel


class KernelVariant:
    """What every kernel config shares: ``VARIANTS`` ({wide: kernel}, from ``index_variants``)
    picked by the config's ``wide`` field and compiled with its ``occupancy`` hint, and with its
    ``worker_warps`` hint where the config has one (the MMA kernels')."""

    worker_warps = None
    persistent = False      # the MMA kernels' knob: resident blocks walk the tiles

    @property
    def kernel(self):
        return with_hints(self.VARIANTS[self.wide], self.occupancy, self.worker_warps)

    def launch_blocks(self, ntiles: int, device: torch.device) -> int:
        """The grid: one block per tile, or with ``persistent`` the blocks the GPU holds at once
        (its SMs times the occupancy hint; never more than the tiles), each walking tiles
        ``ct.num_blocks(0)`` apart. Off a CUDA device (the host code on meta or CPU tensors in
        CI) one per tile too."""
        sms = sm_count(device)
        if not self.persistent or sms is None:
            return ntiles
        return min(ntiles, sms * (self.occupancy or 1))


def array_constraint(dtype: torch.dtype, ndim: int, wide: bool = False) -> ArrayConstraint:
    """What the JIT assumes of any contiguous torch tensor: unit last stride, 16-byte base (it
    also specializes on the divisibility of a call's strides and extents: ``launch_constraint``)."""
    return ArrayConstraint(CT_DTYPE[dtype], ndim, index_dtype=ct.int64 if wide else ct.int32,
                           stride_lower_bound_incl=0, alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (ndim - 1) + (1,), base_addr_divisible_by=16)


def launch_constraint(t: torch.Tensor, index_dtype) -> ArrayConstraint:
    """What cuTile's JIT specializes a kernel on for the tensor ``t`` of a call, base address
    aside (taken as 16-byte aligned, as torch allocates): unit strides and unit extents become
    constants, other strides are declared in 16-byte multiples and extents divisible by 16 where
    they are; a stride 0 over more than one element (D per head broadcast along headdim) makes
    the array alias itself. It reproduces the kernel names ncu recorded on the H200
    (tests/test_compile.py)."""
    per_16_bytes = 16 // t.element_size()
    unit_stride = tuple(1 if st == 1 else None for st in t.stride())
    return ArrayConstraint(
        CT_DTYPE[t.dtype], t.dim(), index_dtype=index_dtype,
        stride_lower_bound_incl=tuple(None if u else 0 for u in unit_stride), alias_groups=(),
        may_alias_internally=any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())),
        stride_constant=unit_stride,
        shape_constant=tuple(1 if n == 1 else None for n in t.shape),
        stride_divisible_by=tuple(1 if u or st % per_16_bytes else per_16_bytes
                                  for u, st in zip(unit_stride, t.stride())),
        shape_divisible_by=tuple(16 if n % 16 == 0 and n != 1 else 1 for n in t.shape),
        base_addr_divisible_by=16)


def scalar_constraint(dtype: torch.dtype) -> ScalarConstraint:
    return ScalarConstraint(CT_DTYPE[dtype])


def kernel_signature(parameters) -> KernelSignature:
    return KernelSignature(parameters, CallingConvention.cutile_python_v2())
