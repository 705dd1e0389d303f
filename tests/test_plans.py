"""Every plan the dispatcher can make, on the CPU: drawn calls of any size, dtype mix, feature set,
precision mode and GPU (SM count, compute capability), planned by ``kernels.ssd.make_plan`` and
run through the host code on meta tensors with the launches recorded
(``kernels.variants.launch_signatures``, as CI's compiles do). The plan launches the kernels it
names, in order, on grids CUDA can launch, and ``ssd_forward``'s chunk-size pick agrees with the
plan made at the size it picks. The covering variants (tests/test_compile.py) pin what the anchors
and the recipes launch; this is the rest of the space, where a user's call lands.

Opt-in, ``MAMBA2_CUTILE_DRAWN_COMPILES=N``: the plans of the first N drawn calls (the same on every
run) compiled for each target, every kernel within the target's shared memory (N = 100: 748 s
for the three targets with -n 2 on 2 cores)."""
from __future__ import annotations

import dataclasses
import inspect
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from kernels import ssd, variants
from kernels.contract import SSDInputError
from kernels.variants import _anchor, launch_problem, launch_signatures

# CUDA's grid limits: x up to 2^31 - 1 blocks, y and z up to 65,535.
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _modes(x_dtype: torch.dtype) -> list[str | None]:
    """The precision modes ``ssd.resolve_precision`` accepts with ``x_dtype`` ('auto' is None)."""
    accepted = [None]
    for mode in ssd.PRECISIONS:
        try:
            ssd.resolve_precision(mode, x_dtype)
        except SSDInputError:
            continue
        accepted.append(mode)
    return accepted


MODES = {x: _modes(x) for x in DTYPES}
# GPUs by (SMs, compute capability): A100, H100 PCIe, H200 (the reference), B200.
GPUS = ((108, 80), (114, 90), (132, 90), (148, 100))


# The most elements of x a drawn call has: 32 GiB in bf16, a quarter of an H200 (past 2^31, so
# the 64-bit-indexed variants are drawn too).
MAX_X_ELEMENTS = 2 ** 34


@st.composite
def calls(draw) -> ssd.ProblemKey:
    """A call's key: sizes from one token to x of MAX_X_ELEMENTS, every feature flag, packed
    sequences (cu_seqlens packs them into batch 1), whether states are returned and whether every
    stage is (``ssd_forward_stages``). Half the
    draws are calls as a Mamba-2 layer makes them (x, B and C in one 16-bit dtype, float32 dt, no
    packing, no initial states), where most of the dispatch's rules apply."""
    layer = draw(st.booleans())
    nheads = draw(st.sampled_from((1, 3, 8, 24, 32, 48, 64, 80, 128, 256)) | st.integers(1, 512))
    ngroups = draw(st.sampled_from([g for g in range(1, nheads + 1) if nheads % g == 0]))
    if layer:
        x_dtype = b_dtype = c_dtype = draw(st.sampled_from(DTYPES[:2]))
        dt_dtype, packed, start_dtype = torch.float32, None, None
    else:
        x_dtype, b_dtype, c_dtype, dt_dtype = (draw(st.sampled_from(DTYPES)) for _ in range(4))
        packed = draw(st.sampled_from((None, torch.int32, torch.int64)))
        start_dtype = draw(st.sampled_from((None, *DTYPES)))
    cu_seqlens = packed is not None and draw(st.booleans())
    varlen = cu_seqlens and draw(st.booleans())
    headdim = draw(st.sampled_from((64, 128)) | st.integers(1, ssd.MAX_HEADDIM))
    seqlen = draw(st.sampled_from((1, 64, 1000, 4096, 65536)) | st.integers(1, 2 ** 19))
    seqlen = min(seqlen, MAX_X_ELEMENTS // (nheads * headdim))
    # 70,000 rows of short sequences: past 65,535 on a grid's second dimension.
    batch = 1 if cu_seqlens else draw(st.sampled_from((1, 2, 8, 70000)) | st.integers(1, 70000))
    batch = max(1, min(batch, MAX_X_ELEMENTS // (seqlen * nheads * headdim)))
    return ssd.ProblemKey(
        batch=batch, seqlen=seqlen, nheads=nheads, ngroups=ngroups, headdim=headdim,
        dstate=draw(st.sampled_from((64, 128, 256)) | st.integers(1, ssd.MAX_DSTATE)),
        chunk_size=draw(st.sampled_from(ssd.SUPPORTED_CHUNK_SIZES)),
        x_dtype=x_dtype, b_dtype=b_dtype, c_dtype=c_dtype, dt_dtype=dt_dtype,
        z_dtype=draw(st.sampled_from((None, x_dtype) if layer else (None, *DTYPES))),
        start_dtype=start_dtype, seq_dtype=packed, cu_dtype=packed if cu_seqlens else None,
        nseq=(nseq := draw(st.integers(1, min(seqlen, 64))) if cu_seqlens else 0),
        has_d=(has_d := draw(st.booleans())), d_per_channel=has_d and draw(st.booleans()),
        has_bias=draw(st.booleans()), softplus=draw(st.booleans()), has_limit=draw(st.booleans()),
        # One sequence's initial state is its row's (SSDProblem.per_sequence_initial_states).
        per_seq_start=nseq > 1 and start_dtype is not None and draw(st.booleans()),
        varlen=varlen, states_returned=varlen or draw(st.booleans()),
        chunk_states_returned=not layer and draw(st.booleans()))


@st.composite
def planned_calls(draw) -> tuple[ssd.ProblemKey, str | None]:
    """A call (``calls``) and a precision mode its x dtype takes (None: 'auto')."""
    key = draw(calls())
    return key, draw(st.sampled_from(MODES[key.x_dtype]))


def _layer(batch: int, seqlen: int, nheads: int, **changes) -> ssd.ProblemKey:
    """A Mamba-2 layer's call at chunk 64: bf16, headdim 64, dstate 128, D per head, out alone."""
    return dataclasses.replace(_anchor(batch, seqlen, nheads, 1, has_d=True),
                               **{"chunk_size": 64, "states_returned": False, **changes})


# Each rule's side, run in every profile besides the draws: the walk paired (the first anchor's
# size), split into segments (the third's: four paired out alone, two alone with final states),
# the fused state scan (80 pairs over 64 chunks: Mamba-2 2.7B at batch 1), four segments paired
# past one round (its prefill out alone) or alone (with final states), two paired (96 pairs),
# four paired (40 pairs) and eight (20 pairs), no fused kernel at chunk 64 (20 pairs over 256
# chunks with final states: four segments alone, no room to double), chunk_cumsum's flat grid.
EXAMPLES = (_layer(8, 4096, 64), _layer(1, 65536, 64), _layer(1, 65536, 64, states_returned=True),
            _layer(1, 4096, 80), _layer(1, 65536, 80), _layer(1, 65536, 80, states_returned=True),
            _layer(1, 65536, 96), _layer(1, 65536, 40), _layer(1, 65536, 20),
            _layer(1, 16384, 20, states_returned=True), _layer(70000, 64, 8))


# Packed prefills returning varlen states (bench --shapes packed's first layer, and Codestral's
# 128 heads), planned where the walk takes them (``_rules``): split in four, and unsplit.
VARLEN_EXAMPLES = tuple(_layer(1, 16384, nheads, ngroups=ngroups, seq_dtype=torch.int32,
                               cu_dtype=torch.int32, nseq=8, varlen=True, states_returned=True)
                        for nheads, ngroups in ((24, 1), (128, 8)))


def on_examples(**others):
    """``example`` for each of EXAMPLES in the default precision, ``others`` the test's other
    arguments (and each of VARLEN_EXAMPLES under the walk's varlen rule, where the test draws
    it)."""
    def decorate(test):
        for key in EXAMPLES:
            test = example(call=(key, None), **others)(test)
        if "walk_varlen_states" in others:
            for key in VARLEN_EXAMPLES:
                test = example(call=(key, None), **{**others, "walk_varlen_states": True})(test)
        return test
    return decorate


def _rules(walk_varlen_states: bool) -> dict:
    """The dispatch rules a drawn call is planned under: with ``walk_varlen_states`` the walk
    takes varlen states (``ssd.WALK_VARLEN_STATES``, a rule written but not yet dispatched)."""
    return {("WALK_VARLEN_STATES", None): True} if walk_varlen_states else {}


@given(call=planned_calls(), state_dtype=st.sampled_from((None, *ssd.STATE_DTYPES)),
       gpu=st.sampled_from(GPUS), walk_varlen_states=st.booleans())
@on_examples(state_dtype=None, gpu=(132, 90), walk_varlen_states=False)
def test_every_plan_launches_its_kernels_on_grids_cuda_can_launch(call, state_dtype, gpu,
                                                                  walk_varlen_states):
    key, precision = call
    sms, capability = gpu
    with ssd.dispatch_rules(_rules(walk_varlen_states)):
        plan = ssd.make_plan(key, state_dtype, precision, sms, capability)
    # The launches are the plan's kernels, in its order, each with the signature of its config
    # (launch_signatures asserts both).
    assert [name for name, _, _ in launch_signatures(key, plan)] == [
        name for name, _ in plan.named_configs()]
    for grid, _, _ in variants.plan_launches(key, plan):
        grid = tuple(grid)
        assert 1 <= len(grid) <= 3, grid
        assert all(1 <= n <= limit for n, limit in zip(grid, GRID_LIMITS)), (grid, plan)


@given(call=planned_calls(), walk_varlen_states=st.booleans())
@on_examples(walk_varlen_states=False)
def test_the_chunk_size_pick_agrees_with_the_plan_it_picks(call, walk_varlen_states):
    # ssd_forward(chunk_size=None) picks the chunk by default_chunk_size and then plans at it:
    # 64 where a fused kernel (the state scan or the walk) takes the call, which the plan at 64
    # must then hold; 256 where none would. (ssd_forward_stages plans at the problem's own size.)
    key, precision = call
    key = dataclasses.replace(key, chunk_states_returned=False)
    problem = dataclasses.replace(launch_problem(key), return_final_states=key.states_returned)
    with ssd.dispatch_rules(_rules(walk_varlen_states)):
        picked = ssd.default_chunk_size(problem, precision)
        at_64 = ssd.make_plan(dataclasses.replace(key, chunk_size=ssd.STATE_SCAN_CHUNK_SIZE),
                              None, precision)
    fused = at_64.state_scan is not None or at_64.scan_out is not None
    assert picked == (ssd.STATE_SCAN_CHUNK_SIZE if fused else ssd.DEFAULT_CHUNK_SIZE)


DRAWN_COMPILES_ENV = "MAMBA2_CUTILE_DRAWN_COMPILES"


def drawn_calls(n: int) -> list[tuple[ssd.ProblemKey, str | None]]:
    """The first ``n`` calls ``planned_calls`` draws, derandomized: the same list on every run."""
    found = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate],
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(call=planned_calls())
    def collect(call):
        found.append(call)

    collect()
    return found


def _known_sm100_crash(name, config, target, result) -> bool:
    """tileiras 13.4's crash (SIGILL) on sm_100 scores kernels in '3xtf32' with a 16-bit C and
    a B of another dtype (tests/test_compile.py pins two: KNOWN_SM100_CRASHES, and says at which
    dstates it was seen)."""
    return (target == "sm_100" and name == "chunk_scores" and config.precision == "3xtf32"
            and config.c_dtype != torch.float32 and config.b_dtype != config.c_dtype
            and result.error.startswith("tileiras exited with -4"))


@pytest.mark.skipif(not os.environ.get(DRAWN_COMPILES_ENV),
                    reason=f"opt-in: {DRAWN_COMPILES_ENV}=N compiles the plans of N drawn calls")
@pytest.mark.parametrize("target", variants.TARGETS)
def test_the_plans_of_drawn_calls_compile_within_the_target(target):
    compiled, failed, known = {}, [], []
    for key, precision in drawn_calls(int(os.environ[DRAWN_COMPILES_ENV])):
        plan = ssd.make_plan(key, None, precision, capability=variants.target_capability(target))
        for name, config, signature in launch_signatures(key, plan):
            ident = (config, repr(signature.parameters))
            if ident in compiled:
                continue
            variant = variants.Variant(name, config, signature, ("drawn",),
                                       getattr(config, "precision", ""))
            result = compiled[ident] = variants.compile_variant(variant, target)
            if _known_sm100_crash(name, config, target, result):
                known.append(f"{name} of {key!r} in {precision}")
            elif not result.ok or result.shared_bytes > variants.MAX_BLOCK_SHARED_BYTES[target]:
                failed.append(f"{name} ({result.shared_bytes} bytes of shared memory) of "
                              f"{key!r} in {precision or 'auto'}: {config.describe()}\n"
                              f"{result.error[-2000:]}")
    if known:
        warnings.warn(f"tileiras's known sm_100 crash on {len(known)} scores kernels: "
                      + "; ".join(known))
    if failed:
        pytest.fail("\n\n".join(failed), pytrace=False)


@pytest.mark.parametrize("d", ["head", "channel"])
def test_d_on_the_weights_diagonal_takes_d_per_head_only(d):
    """``ScanOutConfig.d_term`` (an A/B knob, kernels/scan_out.py 'D's term'): the walk launched
    with D on its weights' diagonal where D is per head (a stride-0 view along headdim), refused
    with the argument named where D is per channel, whose values the diagonal would drop; an
    unknown term or weights' mode refused when the config is made."""
    from kernels.scan_out import ScanOutConfig, scan_out_kernel
    from kernels.tile_ops import MODE
    from properties import ab
    key = ab.case_key(ab.parse_case(f"8,4096,64,64,128,1 D={d}", 64).spec)
    plan = ssd.make_plan(key)
    knob = dataclasses.replace(plan, scan_out=dataclasses.replace(plan.scan_out,
                                                                  d_term="diagonal"))
    if d == "channel":
        with pytest.raises(ValueError, match="d_term 'diagonal'.*stride 0 along headdim"):
            variants.plan_launches(key, knob)
    else:
        names = list(inspect.signature(scan_out_kernel).parameters)
        walk = [dict(zip(names, args, strict=True))
                for _, kernel, args in variants.plan_launches(key, knob)
                if kernel is knob.scan_out.kernel]
        assert len(walk) == 1
        assert (walk[0]["D_ON_DIAGONAL"], walk[0]["WEIGHTS_MODE"]) == (True, MODE["input"])
        split = dataclasses.replace(knob.scan_out, weights_precision="2xbf16")
        constants = dict(zip(names[-len(split.constants()):], split.constants(), strict=True))
        assert (constants["D_ON_DIAGONAL"], constants["WEIGHTS_MODE"]) == (True, MODE["2xbf16"])
    with pytest.raises(ValueError, match="d_term: expected one of"):
        ScanOutConfig(d_term="diagonally")
    with pytest.raises(ValueError, match="weights_precision: expected '' or one of.*'2xbf61'"):
        ScanOutConfig(weights_precision="2xbf61")
