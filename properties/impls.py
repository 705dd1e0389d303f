"""Implementations under test behind one interface: ``get_impl(name)(problem) -> SSDResult``.

Names: ``cutile`` (the project's kernels, CUDA; ``cutile:MODE`` runs them in precision mode MODE,
e.g. ``cutile:tf32``, kernels/ssd.py), ``reference`` (the chunked reference computing in
float32: the baseline of the accuracy rule), ``reference-fp64`` (the same algorithm in float64),
``mamba_ssm`` (its Triton ``mamba_chunk_scan_combined``, CUDA, where importable) and
``package.module:function``: any function with the contract's signature (``kernels.contract``),
returning mamba_ssm's tuple (out [, final_states] [, varlen_states]) or an ``SSDResult`` (whose
``stages`` are then compared too). Such a function may declare what it cannot take with the
attributes ``supported_chunk_sizes`` (a sequence of ints) and ``unsupported_features`` (a dict
feature -> reason, features as in ``FEATURES``).

Every result is in the contract's dtypes: out in x's dtype, final and varlen states in float32,
stages in their shared layouts (``oracles.chunked_reference``); an implementation returning other
dtypes raises TypeError (the references are converted: they keep their compute dtype).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

from kernels.contract import SSDInputError, SSDProblem
from oracles.common import SSDResult

FEATURES = {
    "D": "a D skip connection",
    "z": "a z gate",
    "dt_bias": "a dt bias",
    "dt_softplus": "softplus on dt",
    "dt_limit": "a dt clamp",
    "initial_states": "initial states",
    "packed": "packed sequences (seq_idx or cu_seqlens resets)",
    "per_sequence_initial_states": "one initial state per cu_seqlens sequence",
    "varlen_states": "return_varlen_states",
    "low_precision_states": "initial states in bf16/fp16",
}
BUILTIN = ("cutile", "reference", "reference-fp64", "mamba_ssm")
# What an --impl option takes, for the commands' help.
IMPL_NAMES_HELP = ("cutile, cutile:<precision mode>, reference, reference-fp64, mamba_ssm or "
                   "package.module:function")


class ImplUnavailable(RuntimeError):
    """The implementation cannot run on this machine; the message says why."""


def problem_features(problem: SSDProblem) -> set[str]:
    """The optional features a problem uses, named as in ``FEATURES``."""
    used = {name for name, t in (("D", problem.D), ("z", problem.z), ("dt_bias", problem.dt_bias),
                                 ("initial_states", problem.initial_states)) if t is not None}
    if problem.dt_softplus:
        used.add("dt_softplus")
    if problem.has_dt_limit:
        used.add("dt_limit")
    if problem.seq_idx is not None or problem.cu_seqlens is not None:
        used.add("packed")
    if problem.per_sequence_initial_states:
        used.add("per_sequence_initial_states")
    if problem.return_varlen_states:
        used.add("varlen_states")
    if problem.initial_states is not None and problem.initial_states.dtype != torch.float32:
        used.add("low_precision_states")
    return used


@dataclass(frozen=True)
class Impl:
    """One implementation: call it on a problem; it says what it cannot take before you do.

    device: where its problems must live (None: wherever they are). chunk_sizes: the chunk sizes
    it accepts (None: any). unsupported: feature -> reason. exposes_stages: its results carry the
    intermediate stages. compute_dtype: the precision all its arithmetic is in, when known (then
    its accuracy can be checked against an a-priori rounding bound, without a baseline).
    """

    name: str
    description: str
    run_fn: Callable[[SSDProblem], SSDResult]
    device: Optional[str] = None
    chunk_sizes: Optional[tuple[int, ...]] = None
    unsupported: Mapping[str, str] = field(default_factory=dict)
    exposes_stages: bool = False
    compute_dtype: Optional[torch.dtype] = None
    # The reason this implementation refuses a problem beyond chunk sizes and features (None: it
    # takes it), e.g. a precision mode made for other x dtypes.
    refuses: Optional[Callable[[SSDProblem], Optional[str]]] = None

    def why_unsupported(self, problem: SSDProblem) -> Optional[str]:
        """None when the problem is within what this implementation takes, else the reason."""
        if self.chunk_sizes is not None and problem.chunk_size not in self.chunk_sizes:
            return f"{self.name} takes chunk sizes {self.chunk_sizes}, not {problem.chunk_size}"
        for feature in sorted(problem_features(problem)):
            if feature in self.unsupported:
                return f"{self.name} does not support {FEATURES[feature]}: {self.unsupported[feature]}"
        return None if self.refuses is None else self.refuses(problem)

    def __call__(self, problem: SSDProblem) -> SSDResult:
        if self.device is not None and problem.device.type != torch.device(self.device).type:
            problem = move_problem(problem, self.device)
        return self.run_fn(problem)


def move_problem(problem: SSDProblem, device) -> SSDProblem:
    """The same problem with every tensor on ``device``."""
    moved = {name: value.to(device) for name, value in problem.call_kwargs().items()
             if isinstance(value, torch.Tensor)}
    return problem.with_tensors(**moved)


def _contract_result(problem: SSDProblem, returned) -> SSDResult:
    """An SSDResult from what a contract-signature function returned with final (and varlen)
    states requested; an SSDResult passes through. Wrong dtypes are a contract violation."""
    if isinstance(returned, SSDResult):
        result = returned
    else:
        parts = returned if isinstance(returned, tuple) else (returned,)
        want = 2 + (problem.cu_seqlens is not None)
        if len(parts) != want:
            raise TypeError(f"expected (out, final_states{', varlen_states' if want == 3 else ''}) "
                            f"with return_final_states=True, got {len(parts)} value(s)")
        result = SSDResult(out=parts[0], final_states=parts[1],
                           varlen_states=parts[2] if want == 3 else None)
    if problem.cu_seqlens is not None and result.varlen_states is None:
        raise TypeError("varlen_states: expected a tensor (cu_seqlens is given), got None")
    expected = {"out": problem.x.dtype, "final_states": torch.float32,
                "varlen_states": torch.float32, "dt": torch.float32,
                "log2_decay_cumsum": torch.float32}
    got = {"out": result.out, "final_states": result.final_states,
           "varlen_states": result.varlen_states, **(result.stages or {})}
    for name, dtype in expected.items():
        if got.get(name) is not None and got[name].dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (kernels.contract and the shared "
                            f"stage layouts), got {got[name].dtype}")
    return result


def _reference_delivery(problem: SSDProblem, result: SSDResult) -> SSDResult:
    """The reference's results in the contract's dtypes (it keeps its compute dtype)."""
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    stages = {name: t.float() for name, t in result.stages.items()}
    return SSDResult(out=result.out.to(problem.x.dtype), final_states=f32(result.final_states),
                     varlen_states=f32(result.varlen_states), states=result.states,
                     positions=result.positions, stages=stages)


def _call_contract(fn: Callable, problem: SSDProblem, **overrides) -> SSDResult:
    kwargs = problem.call_kwargs()
    kwargs.update(return_final_states=True, return_varlen_states=problem.cu_seqlens is not None)
    kwargs.update(overrides)
    return _contract_result(problem, fn(**kwargs))


def reference(compute_dtype: torch.dtype, decay_nudge_ulps: int = 0,
              cumsum_rounded_once: bool = False) -> Callable[[SSDProblem], SSDResult]:
    """The chunked reference computing in ``compute_dtype`` (``reference``: float32), its decays
    nudged and its cumsum rounded as ``oracles.chunked_reference.chunked_ssd`` says."""
    # The float32 reference stores chunk states in float32, as the kernels do; the float64 one keeps
    # them in float64 (all its arithmetic is float64) and delivers them in the shared fp32 layout.
    def run(problem: SSDProblem) -> SSDResult:
        from oracles.chunked_reference import chunked_ssd  # noqa: PLC0415
        return _reference_delivery(problem, chunked_ssd(problem, compute_dtype=compute_dtype,
                                                        state_dtype=compute_dtype,
                                                        decay_nudge_ulps=decay_nudge_ulps,
                                                        cumsum_rounded_once=cumsum_rounded_once))
    return run


def _cutile(precision: Optional[str] = None) -> Impl:
    """The kernels, in the precision mode they pick (None) or in ``precision``."""
    if not torch.cuda.is_available():
        raise ImplUnavailable("cutile needs a CUDA device; none is visible to torch")
    import kernels  # noqa: PLC0415  (a GPU with a broken cuTile must fail loudly, not skip)
    forward = getattr(kernels, "ssd_forward", None)
    if forward is None:   # a machine that should run the kernels and cannot: a failure
        raise RuntimeError("cutile: kernels.ssd_forward does not exist")
    staged = getattr(kernels, "ssd_forward_stages", None)
    chunk_sizes = getattr(kernels, "SUPPORTED_CHUNK_SIZES", None)
    unsupported = dict(getattr(kernels, "UNSUPPORTED_FEATURES", {}))

    from kernels.ssd import PRECISIONS, resolve_precision  # noqa: PLC0415
    if precision is not None and precision not in (*PRECISIONS, "auto"):
        # Not refused problem by problem: a misspelt mode would skip every test.
        raise ValueError(f"cutile:<precision mode>: expected one of {PRECISIONS} or 'auto', "
                         f"got {precision!r}")
    modes = {} if precision is None else {"precision": precision}

    def refuses(problem: SSDProblem) -> Optional[str]:
        try:
            resolve_precision(precision, problem.x.dtype)
        except SSDInputError as exc:
            return str(exc)
        return None

    def run(problem: SSDProblem) -> SSDResult:
        if staged is not None:
            return _contract_result(problem, staged(problem, **modes))
        return _call_contract(forward, problem, **modes)

    name, call = "cutile", "kernels.ssd_forward"
    if precision is not None:
        name, call = f"{name}:{precision}", f"{call}, precision={precision!r}"
    return Impl(name, f"the cuTile kernels ({call})", run, device="cuda",
                chunk_sizes=None if chunk_sizes is None else tuple(chunk_sizes),
                unsupported=unsupported, exposes_stages=staged is not None,
                refuses=None if precision is None else refuses)


def _mamba_ssm() -> Impl:
    if not torch.cuda.is_available():
        raise ImplUnavailable("mamba_ssm's Triton kernels need a CUDA device; none is visible")
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: PLC0415
    except Exception as exc:  # ImportError, or Triton failing to initialise
        raise ImplUnavailable(f"mamba_ssm does not import here: {exc!r}") from exc

    def run(problem: SSDProblem) -> SSDResult:
        # mamba_ssm resets the state only where seq_idx changes; cu_seqlens serves it only for
        # varlen_states. Derive seq_idx from cu_seqlens when only the latter is given.
        seq_idx = problem.resolved_seq_idx()
        return _call_contract(mamba_chunk_scan_combined, problem,
                              seq_idx=None if seq_idx is None else seq_idx.to(torch.int32))

    return Impl("mamba_ssm", "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined", run,
                device="cuda",
                # The chunk sizes Mamba-2 models use; its kernels tile chunk_size in powers of two.
                chunk_sizes=(16, 32, 64, 128, 256),
                unsupported={"per_sequence_initial_states":
                             "initial_states is (batch, ...) only; it starts each batch row"})


def _user(spec: str) -> Impl:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"impl: expected a built-in name {BUILTIN} or 'package.module:function', "
                         f"got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"impl: cannot load {spec!r}: {exc}") from exc
    sizes: Optional[Sequence[int]] = getattr(fn, "supported_chunk_sizes", None)
    return Impl(spec, f"user function {spec}", lambda problem: _call_contract(fn, problem),
                chunk_sizes=None if sizes is None else tuple(sizes),
                unsupported=dict(getattr(fn, "unsupported_features", {})),
                exposes_stages=bool(getattr(fn, "exposes_stages", False)))


def get_impl(name: str) -> Impl:
    """The implementation called ``name``; ImplUnavailable when it cannot run on this machine."""
    if name == "cutile" or name.startswith("cutile:"):
        return _cutile(name.partition(":")[2] or None)
    if name == "mamba_ssm":
        return _mamba_ssm()
    if name in ("reference", "reference-fp64"):
        dtype = torch.float32 if name == "reference" else torch.float64
        return Impl(name, f"chunked reference, {str(dtype)[6:]} compute", reference(dtype),
                    exposes_stages=True, compute_dtype=dtype)
    return _user(name)


def available_impls() -> dict[str, str]:
    """Every built-in name with either "available" or the reason it cannot run here.

    A GPU machine where cutile fails to load reports the failure; it is not quietly left out.
    """
    status = {}
    for name in BUILTIN:
        try:
            get_impl(name)
            status[name] = "available"
        except ImplUnavailable as exc:
            status[name] = str(exc)
    return status
