"""The SSD forward problem contract: one validation used by every implementation and oracle.

Inputs follow mamba_ssm's ``mamba_chunk_scan_combined`` (same names, order, defaults, meaning):

    x (batch, seqlen, nheads, headdim)        dt (batch, seqlen, nheads)        A (nheads,)
    B, C (batch, seqlen, ngroups, dstate)     D (nheads,) or (nheads, headdim)  z like x
    dt_bias (nheads,)                         initial_states (batch, nheads, headdim, dstate), or
                                              (nseq, nheads, headdim, dstate) with cu_seqlens
    seq_idx (batch, seqlen) int               cu_seqlens (nseq + 1,) int, batch must be 1

Semantics (per batch row b, head h, group g = h // (nheads // ngroups)):

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)    bias, softplus and clamp are each optional
    h_t  = exp(dt_t * A_h) * h_{t-1} + dt_t * x_t (outer) B_t
    y_t  = h_t . C_t + D * x_t,   then y_t *= silu(z_t) when z is given

Packed sequences: the state is reset where seq_idx changes (also mid-chunk). cu_seqlens alone
implies the same resets (mamba_ssm resets only on seq_idx and reads cu_seqlens only for varlen
states; given both, they must agree, so mamba_ssm's calls mean the same here). A reset sequence starts
from zeros, except that initial_states of shape (batch, ...) start each batch row (mamba_ssm's
meaning) and initial_states of shape (nseq, ...) start each sequence of cu_seqlens.

Outputs: out (x's dtype); final_states (batch, nheads, headdim, dstate) fp32, the state after the
last position of each row; varlen_states (nseq, nheads, headdim, dstate) fp32, the state after the
last position of each sequence of cu_seqlens.

NaN/Inf policy: inputs are not scanned by default (a scan reads every input once more, which on a
GPU costs a full extra pass); a non-finite input then makes non-finite every output it reaches
(the masked in-chunk matmuls may also spread it to earlier positions of its chunk, as 0 * NaN is
NaN), never finite wrong numbers. ``check_finite=True`` scans them and raises ``SSDInputError`` naming the first
non-finite argument.

Decay: every exponent dt*A must be <= 0 (the kernels clamp exponents to <= 0 before exp2, so a
growing state would come out silently wrong). A > 0 is always refused (nheads values are read).
On the GPU reading them back stalls the host until all queued work is done, and the GPU then
idles while the kernels are launched; ``defer_value_checks=True`` (what ``ssd_forward`` uses)
queues their copy to pinned memory behind an event instead (with the verdict on seq_idx's and
cu_seqlens' values, ``ValueChecks``), and ``SSDProblem.confirm_values``
waits for that event only (not for the kernels launched since), takes the verdict on the host and
raises before any output is returned. Until then the kernels read seq_idx and cu_seqlens through
``PackedIndex``: stand-in offsets where the values fail, so that none indexes past a tensor.
Under CUDA graph capture (``torch.cuda.graph``) nothing can be read back: A's values are not read,
and chunk_cumsum makes the cumsum of a head with A > 0 NaN (kernels/chunk_cumsum.py), so every
output that head reaches is NaN, never finite wrong numbers. seq_idx, cu_seqlens and
``check_finite=True``, whose values are checked on the host, are refused there (``capturing``).
The step dt is >= 0 by construction with dt_softplus or a dt_limit; without either, a negative
dt + dt_bias is outside the contract and is refused only by the opt-in scan ``check_finite=True``
(it reads every dt).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PARAMETER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Below this, softplus(v) and v differ by less than 3e-9 absolute (e^-20 = 2.1e-9): the identity
# switch every implementation may use.
SOFTPLUS_IDENTITY_THRESHOLD = 20.0


class SSDInputError(ValueError):
    """A contract violation: the message names the argument, what was expected and what was given."""


def _fail(arg: str, expected: str, given) -> SSDInputError:
    return SSDInputError(f"{arg}: expected {expected}, got {given}")


def _dims(shape) -> str:
    """A shape in Python's tuple notation: (4,) for one dimension, (2, 3) for two."""
    return str(tuple(int(s) for s in shape))


def _shape(t: torch.Tensor) -> str:
    return "shape " + _dims(t.shape)


@dataclass(frozen=True)
class SSDProblem:
    """A validated SSD forward call. Tensors are the caller's, unconverted; sizes are derived."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    chunk_size: int
    D: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    initial_states: Optional[torch.Tensor] = None
    seq_idx: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    return_final_states: bool = False
    return_varlen_states: bool = False
    value_checks: Optional["ValueChecks"] = None
    # validate's call_signature of the call (None: it had none); never compared.
    signature: Optional[tuple] = field(default=None, compare=False, repr=False)

    def confirm_values(self) -> None:
        """Raise SSDInputError if a deferred check of A's or seq_idx's values failed (a no-op
        when none is pending)."""
        if self.value_checks is not None:
            self.value_checks.confirm()

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @property
    def seqlen(self) -> int:
        return self.x.shape[1]

    @property
    def nheads(self) -> int:
        return self.x.shape[2]

    @property
    def headdim(self) -> int:
        return self.x.shape[3]

    @property
    def ngroups(self) -> int:
        return self.B.shape[2]

    @property
    def dstate(self) -> int:
        return self.B.shape[3]

    @property
    def nchunks(self) -> int:
        return -(-self.seqlen // self.chunk_size)

    @property
    def nseq(self) -> Optional[int]:
        return None if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def has_dt_limit(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)

    @property
    def per_sequence_initial_states(self) -> bool:
        """True when initial_states holds one state per cu_seqlens sequence, not per batch row."""
        return (self.initial_states is not None and self.cu_seqlens is not None
                and self.initial_states.shape[0] == self.nseq and not (self.nseq == self.batch == 1))

    def resolved_seq_idx(self, dtype: torch.dtype = torch.int64) -> Optional[torch.Tensor]:
        """(batch, seqlen) sequence index of every position as ``dtype``, or None when nothing is
        packed."""
        if self.seq_idx is not None:
            return self.seq_idx.to(dtype)
        if self.cu_seqlens is None:
            return None
        positions = torch.arange(self.seqlen, device=self.cu_seqlens.device,
                                 dtype=self.cu_seqlens.dtype)
        return sequence_of(self.cu_seqlens, positions, dtype).view(1, self.seqlen)

    def with_tensors(self, **tensors) -> "SSDProblem":
        """The same call with some tensors replaced (e.g. moved or upcast); no re-validation, and
        no signature (it described the tensors replaced)."""
        return replace(self, signature=None, **tensors)

    def call_kwargs(self) -> dict:
        """Keyword arguments that reproduce this call on any implementation of the contract."""
        return dict(x=self.x, dt=self.dt, A=self.A, B=self.B, C=self.C, chunk_size=self.chunk_size,
                    D=self.D, z=self.z, dt_bias=self.dt_bias, initial_states=self.initial_states,
                    seq_idx=self.seq_idx, cu_seqlens=self.cu_seqlens, dt_softplus=self.dt_softplus,
                    dt_limit=self.dt_limit, return_final_states=self.return_final_states,
                    return_varlen_states=self.return_varlen_states)


def _check_tensor(name, t, shape, dtypes, device, dtype_words):
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) != tuple(shape):
        raise _fail(name, "shape " + _dims(shape), _shape(t))
    if t.dtype not in dtypes:
        raise _fail(name, f"dtype {dtype_words}", t.dtype)
    if t.device != device:
        raise _fail(name, f"a tensor on {device} (the device of x)", f"a tensor on {t.device}")


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and the current CUDA stream is capturing a graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class ValueChecks:
    """The checks that read values back from the GPU, copied to (pinned) host memory behind one
    event; the verdicts are taken on the host at ``confirm``. A's nheads values (A <= 0), and
    where seq_idx or cu_seqlens is given one boolean computed on the GPU (``PackedIndex``):
    whether their values pass the host's checks, which run on the host, for their message, only
    where it is False. No kernel of A's own: on the H200's host the comparison and reduction on
    the GPU cost 27 us a call, the copy of A's nheads values 7 us
    (reports/h200/experiments/host_parts_2302d94.txt); seq_idx's read back at once stalled the
    host until all queued work was done, so that a packed call's kernels waited on its host path
    (reports/h100/experiments/packed_walk_87b34e5.txt), as cu_seqlens' did until 2026-12-07.
    ``captured``: under CUDA graph capture, no verdict (module docstring, 'Decay'; seq_idx and
    cu_seqlens are refused there)."""

    def __init__(self, A: torch.Tensor, packed: Optional["PackedIndex"] = None,
                 captured: bool = False):
        self.values, self.packed, self.packed_ok, self.ready = A, packed, None, None
        if packed is not None:
            self.packed_ok = packed.verdict
        if captured:
            self.values = self.packed_ok = None
        elif A.is_cuda:
            self.values = _pinned_copy(A)
            if self.packed_ok is not None:
                self.packed_ok = _pinned_copy(self.packed_ok)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(A.device))

    def confirm(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        if self.packed_ok is not None and not bool(self.packed_ok):
            self.packed.raise_refusal()
        if self.values is None:
            return
        growing = self.values > 0
        if bool(growing.any()):
            head = int(growing.nonzero()[0, 0])
            raise _fail("A", "values <= 0 (exp(dt*A) is a decay)",
                        f"A[{head}] = {float(self.values[head])}")


@dataclass(frozen=True)
class PackedIndex:
    """seq_idx and cu_seqlens as the caller gave them, whose values ssd_forward checks after the
    kernels are queued (``validate``'s defer_value_checks), and what the kernels read instead:
    the same values where they pass, else offsets that do (0, 1, ..., nseq - 1, seqlen) and the
    sequence index they imply, so that no kernel indexes past a tensor with offsets the host has
    not read. ``verdict``: one boolean on their device, whether the values pass; queued, not read
    here."""

    seq_idx: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    seqlen: int
    verdict: torch.Tensor
    kernel_seq_idx: Optional[torch.Tensor]
    kernel_cu_seqlens: Optional[torch.Tensor]

    @staticmethod
    def queued(seq_idx: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
               seqlen: int) -> "PackedIndex":
        """The verdict and the kernels' tensors for a call whose other checks passed (shapes,
        dtypes and devices; with cu_seqlens, 2 to seqlen + 1 offsets), computed on their device
        without reading a value back."""
        if cu_seqlens is None:
            # Each value against the one before it, the first column against 0: non-decreasing
            # and non-negative in one comparison (four small kernels, the pad's two among them,
            # where two comparisons took five).
            verdict = (seq_idx >= torch.nn.functional.pad(seq_idx[:, :-1], (1, 0))).all()
            return PackedIndex(seq_idx, None, seqlen, verdict, seq_idx, None)
        cu = cu_seqlens
        verdict = (cu[0] == 0) & (cu[-1] == seqlen) & (cu[1:] > cu[:-1]).all()
        if seq_idx is not None:
            # Without seq_idx the kernels' index comes from the offsets they read
            # (kernels.ssd.kernel_seq_idx): no positions here.
            positions = torch.arange(seqlen, device=cu.device, dtype=cu.dtype)
            verdict = verdict & (seq_idx[0] == sequence_of(cu, positions)).all()
        # Valid offsets for any nseq <= seqlen, made on the call's stream (no host copy to order).
        stand_in = torch.arange(cu.numel(), device=cu.device, dtype=cu.dtype)
        stand_in[-1] = seqlen
        kernel_cu = torch.where(verdict, cu, stand_in)
        kernel_seq = None if seq_idx is None else sequence_of(
            kernel_cu, positions, seq_idx.dtype).view(1, seqlen)
        return PackedIndex(seq_idx, cu_seqlens, seqlen, verdict, kernel_seq, kernel_cu)

    def raise_refusal(self) -> None:
        """Raise what validate raises for these values (read back now: the verdict failed)."""
        _check_packed_values(self.seq_idx, self.cu_seqlens, self.seqlen)
        raise _fail("cu_seqlens" if self.cu_seqlens is not None else "seq_idx",
                    "values that the GPU's verdict and the host's checks judge alike",
                    "values the host's checks pass and the GPU's verdict refused (a bug in "
                    "kernels.contract.PackedIndex)")


def sequence_of(cu_seqlens: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The sequence of each position (of cu_seqlens' dtype) under offsets cu_seqlens, as
    ``dtype``: in [0, nseq] whatever the offsets (a search, never an index). int32 comes out of
    the search itself, no cast: on a GPU each cast is one more small kernel in the call's host
    path."""
    found = torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True,
                               out_int32=dtype == torch.int32)
    return found.to(dtype)


def _check_packed_values(seq_idx, cu_seqlens, seqlen: int) -> None:
    """validate's checks of cu_seqlens' offsets and seq_idx's values (and their agreement),
    read on the host; the tensors' shapes, dtypes and devices already checked."""
    if cu_seqlens is not None:
        cu = cu_seqlens.detach().cpu().tolist()
        if cu[0] != 0:
            raise _fail("cu_seqlens", "cu_seqlens[0] == 0", f"cu_seqlens[0] == {cu[0]}")
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise _fail("cu_seqlens", "strictly increasing offsets (no empty sequence)", cu)
        if cu[-1] != seqlen:
            raise _fail("cu_seqlens", f"cu_seqlens[-1] == seqlen == {seqlen}",
                        f"cu_seqlens[-1] == {cu[-1]}")
    if seq_idx is None:
        return
    if bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise _fail("seq_idx", "non-decreasing values along seqlen", "a decreasing step")
    if bool((seq_idx < 0).any()):
        raise _fail("seq_idx", "non-negative values", "a negative value")
    if cu_seqlens is not None:
        positions = torch.arange(seqlen, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
        if not torch.equal(seq_idx[0].to(torch.int64), sequence_of(cu_seqlens, positions)):
            raise _fail("seq_idx", "the sequence index implied by cu_seqlens", "a different index")


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to pinned host memory, queued on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


# Signatures of calls that passed validate's checks (call_signature). A call of the same
# signature passes them again: they read its arguments' types, shapes, dtypes and devices and its
# options, and values only of seq_idx, cu_seqlens and (check_finite) every input, which such calls
# are given no signature for, but where seq_idx's values are left to ValueChecks. A's values (and
# such seq_idx's) are read on every call.
_PASSED: set = set()
PASSED_MAX = 1024
# Options memoized by value: anything else (a tensor as a bound, say) leaves the call unsigned.
_PLAIN_OPTION_TYPES = (bool, int, float, str, type(None))


def call_signature(arrays: tuple, options: tuple) -> Optional[tuple]:
    """A call as validation and planning see it: each array argument's shape, strides, dtype and
    device (None where absent) and its options; None where an argument is neither a tensor nor
    None, or an option is not a plain value (or a tuple or list of them)."""
    described = []
    for t in arrays:
        if t is None:
            described.append(None)
        elif isinstance(t, torch.Tensor):
            described.append((tuple(t.shape), t.stride(), t.dtype, t.device))
        else:
            return None
    plain = []
    for option in options:
        if isinstance(option, (tuple, list)):
            if not all(type(v) in _PLAIN_OPTION_TYPES for v in option):
                return None
            plain.append((type(option), tuple(option)))
        elif type(option) in _PLAIN_OPTION_TYPES:
            plain.append((type(option), option))
        else:
            return None
    return tuple(described), tuple(plain)


def validate(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
             seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
             return_final_states=False, return_varlen_states=False, *,
             supported_chunk_sizes: Optional[Sequence[int]] = None,
             check_finite: bool = False, implementation: str = "this implementation",
             defer_value_checks: bool = False) -> SSDProblem:
    """Check every argument of an SSD forward call; raise SSDInputError or return the SSDProblem.
    defer_value_checks: leave the A <= 0 verdict, and seq_idx's and cu_seqlens' values, to
    ``SSDProblem.confirm_values`` (module docstring, 'Decay'); the problem then holds the
    tensors of ``PackedIndex`` the kernels read in place of seq_idx and cu_seqlens.
    A call whose ``call_signature`` passed before skips the checks that read no values."""
    captured = isinstance(x, torch.Tensor) and capturing(x)
    if captured:
        host_read = "during CUDA graph capture (the host checks its values, which a capturing " \
                    "stream cannot read back)"
        for name, given in (("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)):
            if given is not None:
                raise _fail(name, "None " + host_read, "a tensor")
        if check_finite:
            raise _fail("check_finite", "False " + host_read, "True")
    # seq_idx's and cu_seqlens' values read with A's (ValueChecks), after the kernels are queued;
    # offsets more than seqlen + 1 (never valid) are read at once, for validate's own message.
    packed = seq_idx is not None or cu_seqlens is not None
    defer_packed = defer_value_checks and packed and (cu_seqlens is None or (
        isinstance(x, torch.Tensor) and x.dim() == 4 and isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.dim() == 1 and 2 <= cu_seqlens.numel() <= x.shape[1] + 1))
    signature = None
    if (defer_packed or not packed) and not check_finite:
        signature = call_signature(
            (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens),
            (chunk_size, dt_limit, dt_softplus, return_final_states, return_varlen_states,
             None if supported_chunk_sizes is None else tuple(supported_chunk_sizes)))
    if signature is None or signature not in _PASSED:
        _check_call(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                    cu_seqlens, dt_softplus, dt_limit, return_varlen_states,
                    supported_chunk_sizes, check_finite, implementation, not defer_packed)
        if signature is not None:
            if len(_PASSED) >= PASSED_MAX:
                _PASSED.clear()
            _PASSED.add(signature)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    index = PackedIndex.queued(seq_idx, cu_seqlens, x.shape[1]) if defer_packed else None
    value_checks = ValueChecks(A, index, captured)
    if not defer_value_checks:
        value_checks.confirm()
        value_checks = None
    if index is not None:
        seq_idx, cu_seqlens = index.kernel_seq_idx, index.kernel_cu_seqlens

    return SSDProblem(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                      initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                      dt_softplus=bool(dt_softplus), dt_limit=(lo, hi),
                      return_final_states=bool(return_final_states),
                      return_varlen_states=bool(return_varlen_states), value_checks=value_checks,
                      signature=signature)


def _check_call(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                dt_softplus, dt_limit, return_varlen_states, supported_chunk_sizes, check_finite,
                implementation, packed_values=True) -> None:
    """validate's checks: raise SSDInputError naming the first argument outside the contract;
    seq_idx's and cu_seqlens' values too where ``packed_values`` (else ValueChecks reads them)."""
    act = "float32, float16 or bfloat16"
    if not isinstance(x, torch.Tensor):
        raise _fail("x", "a torch.Tensor", type(x).__name__)
    if x.dim() != 4:
        raise _fail("x", "4 dimensions (batch, seqlen, nheads, headdim)", _shape(x))
    batch, seqlen, nheads, headdim = x.shape
    if x.dtype not in ACTIVATION_DTYPES:
        raise _fail("x", f"dtype {act}", x.dtype)
    if seqlen == 0:
        raise _fail("x", "seqlen (dimension 1) >= 1", "seqlen 0")
    if min(batch, nheads, headdim) == 0:
        raise _fail("x", "batch, nheads and headdim >= 1", _shape(x))
    device = x.device
    if not isinstance(B, torch.Tensor):
        raise _fail("B", "a torch.Tensor", type(B).__name__)
    if B.dim() != 4 or B.shape[:2] != (batch, seqlen):
        raise _fail("B", f"shape ({batch}, {seqlen}, ngroups, dstate)", _shape(B))
    ngroups, dstate = B.shape[2], B.shape[3]
    if ngroups == 0 or dstate == 0:
        raise _fail("B", "ngroups and dstate >= 1", _shape(B))
    if nheads % ngroups:
        raise _fail("B", f"ngroups (dimension 2) dividing nheads={nheads}", f"ngroups={ngroups}")
    _check_tensor("B", B, (batch, seqlen, ngroups, dstate), ACTIVATION_DTYPES, device, act)
    _check_tensor("C", C, (batch, seqlen, ngroups, dstate), ACTIVATION_DTYPES, device, act)
    _check_tensor("dt", dt, (batch, seqlen, nheads), PARAMETER_DTYPES, device, act)
    _check_tensor("A", A, (nheads,), PARAMETER_DTYPES, device, act)
    if D is not None:
        if not isinstance(D, torch.Tensor) or D.dim() not in (1, 2):
            raise _fail("D", f"shape ({nheads},) or ({nheads}, {headdim})",
                        _shape(D) if isinstance(D, torch.Tensor) else type(D).__name__)
        _check_tensor("D", D, (nheads,) if D.dim() == 1 else (nheads, headdim), PARAMETER_DTYPES,
                      device, act)
    if z is not None:
        _check_tensor("z", z, tuple(x.shape), ACTIVATION_DTYPES, device, act)
    if dt_bias is not None:
        _check_tensor("dt_bias", dt_bias, (nheads,), PARAMETER_DTYPES, device, act)

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise _fail("chunk_size", "a positive int", repr(chunk_size))
    if supported_chunk_sizes is not None and chunk_size not in supported_chunk_sizes:
        raise _fail("chunk_size", f"one of {tuple(supported_chunk_sizes)} ({implementation})",
                    chunk_size)

    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise _fail("cu_seqlens", "a 1-D tensor (nseq + 1,) with nseq >= 1",
                        _shape(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
        _check_tensor("cu_seqlens", cu_seqlens, tuple(cu_seqlens.shape), INDEX_DTYPES, device,
                      "int32 or int64")
        if batch != 1:
            raise _fail("cu_seqlens", "batch 1 (sequences packed along seqlen)", f"batch {batch}")
    if seq_idx is not None:
        _check_tensor("seq_idx", seq_idx, (batch, seqlen), INDEX_DTYPES, device, "int32 or int64")
    if packed_values:
        _check_packed_values(seq_idx, cu_seqlens, seqlen)
    if return_varlen_states and cu_seqlens is None:
        raise _fail("cu_seqlens", "a tensor when return_varlen_states=True", None)

    if initial_states is not None:
        nseq = None if cu_seqlens is None else cu_seqlens.numel() - 1
        lead = {batch} | ({nseq} if nseq is not None else set())
        if not isinstance(initial_states, torch.Tensor) or initial_states.dim() != 4 or \
                initial_states.shape[0] not in lead:
            words = f"({batch}, {nheads}, {headdim}, {dstate})" + (
                "" if nseq is None else f" or, per sequence, ({nseq}, {nheads}, {headdim}, {dstate})")
            raise _fail("initial_states", f"shape {words}",
                        _shape(initial_states) if isinstance(initial_states, torch.Tensor)
                        else type(initial_states).__name__)
        _check_tensor("initial_states", initial_states,
                      (initial_states.shape[0], nheads, headdim, dstate), STATE_DTYPES, device,
                      "float32, bfloat16 or float16")

    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2:
        raise _fail("dt_limit", "a pair (lo, hi)", repr(dt_limit))
    try:
        lo, hi = float(dt_limit[0]), float(dt_limit[1])
    except (TypeError, ValueError):
        raise _fail("dt_limit", "a pair of numbers (lo, hi)", repr(dt_limit)) from None
    if math.isnan(lo) or math.isnan(hi) or lo < 0 or hi < lo:
        raise _fail("dt_limit", "0 <= lo <= hi (non-NaN)", repr(tuple(dt_limit)))

    if check_finite:
        for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                        ("dt_bias", dt_bias), ("initial_states", initial_states)):
            if t is not None and not bool(torch.isfinite(t).all()):
                raise _fail(name, "finite values (check_finite=True)", "NaN or Inf")
        if not dt_softplus and (lo, hi) == (0.0, math.inf):
            step = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
            if bool((step < 0).any()):
                raise _fail("dt", "dt + dt_bias >= 0 without dt_softplus or dt_limit "
                            "(check_finite=True)", f"a step of {float(step.min())}")


def pack_outputs(problem: SSDProblem, out, final_states=None, varlen_states=None):
    """mamba_ssm's return convention: out [, final_states] [, varlen_states]."""
    result = (out,)
    if problem.return_final_states:
        result += (final_states,)
    if problem.return_varlen_states:
        result += (varlen_states,)
    return result[0] if len(result) == 1 else result
