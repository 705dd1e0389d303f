"""CI without a GPU: every covering kernel variant, specialized as its launch specializes it,
compiles to sm_80/sm_90/sm_100 cubins, keeps its matmuls on tensor cores where its precision mode
promises them and moves its tiles by TMA (sm_90 remarks); those specializations are the H200's,
and the host code launches the signatures CI compiles.

The compiles (623 tileiras runs: each target's covering set, 213 distinct variants whose bytecode
is written once for the targets that compile them) happen once, two variants at a time, in a
module fixture; each (variant, target) is then its own test. On the 2-core CI machine the fixture
took 882 s (753cc8d, pytest --durations) when each run wrote its own bytecode; the whole CPU suite
in CI took 938 s at 196a186 and 1090 s at 2b90c46 against 1225 s at 8e696c1, the same day, and
486 s at 2a04e36.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from kernels import ssd
from kernels.tile_ops import CT_DTYPE
from kernels.variants import (COVERING_KEYS, MAX_BLOCK_SHARED_BYTES, MMA_KERNELS, TARGETS,
                              CompileResult, compile_all, compile_variant, covering_variants,
                              occupancy_shortfall, recorded_launches, target_capability, tile_ir,
                              violations)
from kernels.gpu_report import ANCHORS
from properties.problems import ProblemSpec, build_problem

VARIANTS = covering_variants()
# (variant, target): each target's own covering set (kernels.variants.covering_variants).
COMPILES = [(v, t) for t in TARGETS for v in covering_variants(target_capability(t))]


@pytest.fixture(scope="module")
def compiled():
    results = compile_all(TARGETS, jobs=2)
    return {(r.variant, r.target): r for r in results}


@pytest.mark.parametrize("variant, target", COMPILES, ids=[f"{v.name}-{t}" for v, t in COMPILES])
def test_variant_compiles(compiled, variant, target):
    result = compiled[(variant.name, target)]
    assert result.ok, f"{variant.config.describe()} on {target}:\n{result.error}"
    # Read from the cubin's kernel attributes (kernel_resources): a thread has 1..255 registers.
    assert 0 < result.registers <= 255, (variant.name, target, result.registers)
    # A block's shared memory (kernel_resources) within what one block may take on the target:
    # a bigger one would fail at launch. The MMA kernels stage their operands there.
    assert (variant.kernel not in MMA_KERNELS or result.shared_bytes > 0) and (
        result.shared_bytes <= MAX_BLOCK_SHARED_BYTES[target]), (
        variant.name, target, result.shared_bytes)
    problems = violations(variant, result)
    assert not problems, f"{variant.config.describe()} on {target}: {problems}"


# The variants an SM cannot hold as many of as their occupancy hint asks (shared memory and the
# 1 KB CUDA reserves a block, or a block's registers or threads: kernels.variants.
# occupancy_shortfall), with tileiras 13.4; they run fewer blocks an SM than the plan's tuning
# assumed. Registers hold them all on sm_80 and sm_90; on sm_100 float32's chunk_state in
# '3xbf16' asks two and takes 255 registers for each of 256 threads, a whole SM's 65,536, where
# sm_90 fits it in 128 (found when this check began to count registers). On sm_90, the H200's
# target: chunk_state at chunk 256 and the split walk's states-only walk out alone (the third
# anchor's), two asked, one held, at 115,928 to 115,960 bytes a block, where two need 115,712 or
# less. Their load-latency hints take them under it (chunk_state's latency 1 or 3, segment_states's
# b_latency 10) but gave no time back on the H100 at 96fe790 (0.987-1.046x;
# reports/h100/experiments/ab_cs_96fe790.json, ab_ss_96fe790.json), so they stay. So does the
# states-only walk forward at dstate 32 (64 heads over 65,536 tokens; 116,032 bytes on sm_90,
# 116,108 on sm_100): its hint, one block an SM held, took 0.935x and 0.916x (with final states)
# the time of the walk compiled without it on the H100 at d10aa84
# (reports/h100/experiments/ab_s1_n32_d10aa84.json). On sm_80 (164 KB of shared memory an SM)
# the split walk of out paired at dstate 128 holds one block (32 heads over 65,536 tokens: from
# initial states 141,568 bytes, with z 149,760), where sm_90's 228 KB hold two. A compile that
# adds or drops one fails the test: then update this list and say why.
KNOWN_OCCUPANCY_SHORTFALLS = {
    "sm_80": (
        "compute_out[anchor-b4-L8192-h32-g8-shared-scores-ordered]",
        "compute_out[anchor-b8-L4096-h64-out-transposed]",
        "compute_out[anchor-b8-L4096-h64-states-transposed-ordered]",
        "scan_out[b1-L65536-h32-q64-out-only-walk-segments-start]",
        "scan_out[b1-L65536-h32-q64-z-out-only-walk-segments]",
    ),
    "sm_90": (
        "chunk_state[anchor-b1-L65536-h64]",
        "chunk_state[anchor-b4-L8192-h32-g8]",
        "chunk_state[anchor-b8-L4096-h64-out-only]",
        "chunk_state[anchor-b8-L4096-h64-states-transposed-ordered]",
        "chunk_state[anchor-b8-L4096-h64]",
        "segment_states[b1-L65536-h32-g8-q64-z-out-only-walk-segments]",
        "segment_states[b1-L65536-h32-q64-out-only-walk-segments-start]",
        "segment_states[b1-L65536-h64-q64-n32-out-only-walk-segments]",
    ),
    "sm_100": (
        "chunk_state[fp16-anchor-b8-L4096-h64-2xfp16-out-only]",
        "chunk_state[fp16-anchor-b8-L4096-h64-2xfp16]",
        "chunk_state[fp32-anchor-b8-L4096-h64-3xbf16]",
        "compute_out[anchor-b2-L4096-h64-q64-out-only-fused-z-d-per-channel]",
        "compute_out[anchor-b4-L8192-h32-g8-q128-out-only-fused]",
        "compute_out[anchor-b4-L8192-h32-g8]",
        "compute_out[anchor-b8-L4096-h64-2xbf16]",
        "compute_out[anchor-b8-L4096-h64-out-only]",
        "compute_out[anchor-b8-L4096-h64-out-transposed]",
        "compute_out[anchor-b8-L4096-h64-z-d-per-channel-out-only]",
        "compute_out[int64-b1-L139264-h256]",
        "segment_states[b1-L65536-h64-q64-n32-out-only-walk-segments]",
    ),
}


def test_each_variant_gets_the_blocks_an_sm_it_asks_for_or_is_a_known_shortfall(compiled):
    short = {target: sorted(v.name for v, t in COMPILES if t == target
                            and occupancy_shortfall(v, compiled[(v.name, t)]))
             for target in TARGETS}
    assert short == {t: sorted(names) for t, names in KNOWN_OCCUPANCY_SHORTFALLS.items()}


def test_occupancy_shortfall_counts_the_reserved_kilobyte_of_each_block():
    """Two blocks an sm_90 SM (228 KB) hold at 115,712 bytes each, not at 115,713: each takes
    1 KB more; no hint, no shortfall; sm_80's SM holds 164 KB."""
    variant = next(v for v in VARIANTS if getattr(v.config, "occupancy", None) == 2)

    def result(target, shared_bytes):
        return CompileResult(variant.name, target, ok=True, seconds=0.0, shared_bytes=shared_bytes)
    assert occupancy_shortfall(variant, result("sm_90", 115_712)) == ""
    assert occupancy_shortfall(variant, result("sm_90", 115_713)).startswith(
        "occupancy 2 asked, 1 held: 115,713 bytes")
    assert occupancy_shortfall(variant, result("sm_80", 82_944)) == ""
    assert occupancy_shortfall(variant, result("sm_80", 82_945)) != ""
    unhinted = next(v for v in VARIANTS if getattr(v.config, "occupancy", 1) is None)
    assert occupancy_shortfall(unhinted, result("sm_90", 200_000)) == ""


def test_occupancy_shortfall_counts_a_blocks_registers_and_threads():
    """An SM's 65,536 registers hold two blocks of 256 threads at 128 registers a thread, not at
    129 (rounded up to 136 by the warp's unit of 256: 34,816 a block), and two of 128 threads at
    245 (248: 31,744); its 2,048 threads hold two blocks of 1,024, not three. A cubin that names
    no block size (threads 0) is judged by its shared memory alone."""
    paired = next(v for v in VARIANTS if getattr(v.config, "occupancy", None) == 2)
    three = next(v for v in VARIANTS if getattr(v.config, "occupancy", None) == 3)

    def result(registers, threads):
        return CompileResult(paired.name, "sm_90", ok=True, seconds=0.0, registers=registers,
                             shared_bytes=50_000, threads=threads)
    assert occupancy_shortfall(paired, result(128, 256)) == ""
    assert occupancy_shortfall(paired, result(129, 256)) == (
        "occupancy 2 asked, 1 held: 129 registers a thread, 34,816 a block of 256 threads, "
        "against the SM's 65,536")
    assert occupancy_shortfall(paired, result(245, 128)) == ""
    assert occupancy_shortfall(paired, result(255, 0)) == ""
    assert occupancy_shortfall(three, result(8, 1024)) == (
        "occupancy 3 asked, 2 held: 1,024 threads a block against the SM's 2,048")


# tileiras 13.4 crashes (SIGILL, no message) compiling scores kernels for sm_100 in '3xtf32'
# where C is 16-bit, B's dtype is not C's, and dstate pads to 256 but is no multiple of 8 (B's
# and C's rows not 16-byte aligned): probed at dstate 130, 131, 145, 149, 202 and 250, B float32
# or fp16 with C bf16 and B float32 with C fp16; not at dstate 160, 192, 200 or 256, at 17 to
# 131 padded to 128 or less, nor with C float32 or B's dtype C's. sm_80 and sm_90 compile all of
# them. Found compiling the plans tests/test_plans.py draws (MAMBA2_CUTILE_DRAWN_COMPILES;
# ``_known_sm100_crash`` there allows it). A toolchain that compiles one of these turns its xfail
# into a failure: then remove the test and the drawn test's allowance.
KNOWN_SM100_CRASHES = [
    ssd.ProblemKey(batch=1, seqlen=4096, nheads=128, headdim=53, dstate=202, ngroups=4,
                   chunk_size=64, x_dtype=torch.bfloat16, b_dtype=torch.float32,
                   c_dtype=torch.bfloat16, states_returned=False),
    ssd.ProblemKey(batch=2, seqlen=1793, nheads=238, headdim=128, dstate=149, ngroups=14,
                   chunk_size=64, x_dtype=torch.float32, b_dtype=torch.float16,
                   c_dtype=torch.bfloat16, states_returned=False)]


@pytest.mark.xfail(strict=True, reason="tileiras 13.4 crashes on it for sm_100")
@pytest.mark.parametrize("key", KNOWN_SM100_CRASHES, ids=["fp32B-bf16C-n202", "fp16B-bf16C-n149"])
def test_a_known_sm100_crash_of_tileiras_still_crashes(key):
    from kernels.variants import Variant, launch_signatures  # noqa: PLC0415
    plan = ssd.make_plan(key, None, "3xtf32", capability=100)
    (scores,) = [(name, cfg, sig) for name, cfg, sig in launch_signatures(key, plan)
                 if name == "chunk_scores"]
    result = compile_variant(Variant(*scores, ("known crash",), "3xtf32"), "sm_100")
    assert result.ok, result.error


def test_the_hinted_sweep_lists_the_hinted_configs_the_covering_set_lacks():
    """``python3 -m kernels.variants --hinted`` compiles ``hinted_beyond_covering``: configs with
    an occupancy hint of 2 or more that the dispatcher picks over HINT_SWEEP's calls, none of
    them a covering variant's, each named after its first call, and among them the two kinds
    session 79's sweep timed on the H100: fp16's paired walk from initial states with z at
    dstate 128 (blocks of 128 threads on sm_90) and '2xbf16''s with z and D."""
    from kernels.variants import VARIANT_SETS, hinted_beyond_covering
    hinted = hinted_beyond_covering(90)
    covered = {(v.kernel, v.config) for v in covering_variants(90)}
    assert len(hinted) > 100 and VARIANT_SETS["hinted"] is hinted_beyond_covering
    assert all(v.config.occupancy >= 2 and (v.kernel, v.config) not in covered
               and v.name.startswith(f"{v.kernel}[sweep-") for v in hinted)
    walks = [v.config for v in hinted if v.kernel == "scan_out"]
    assert any(c.x_dtype == torch.float16 and c.has_start and c.has_z and not c.has_d
               and c.n_pad == 128 for c in walks)
    assert any(c.precision == "2xbf16" and c.has_start and c.has_z and c.has_d for c in walks)


def test_covering_set_covers_every_value():
    """Every dtype, chunk size, headdim, dstate, precision and flag appears at least once."""
    keys = [(key, state_dtype, ssd.resolve_precision(precision, key.x_dtype))
            for _, key, state_dtype, precision, *_ in COVERING_KEYS]
    seen = lambda f: {f(k, s, p) for k, s, p in keys}  # noqa: E731
    dtypes = {torch.float32, torch.bfloat16, torch.float16}
    assert seen(lambda k, s, p: k.x_dtype) >= dtypes
    assert seen(lambda k, s, p: k.b_dtype) >= dtypes
    assert seen(lambda k, s, p: k.c_dtype) >= dtypes
    assert seen(lambda k, s, p: k.dt_dtype) >= dtypes
    assert seen(lambda k, s, p: s) >= dtypes
    assert seen(lambda k, s, p: k.start_dtype) >= {None, torch.float32, torch.bfloat16}
    assert seen(lambda k, s, p: k.seq_dtype) >= {None, torch.int32, torch.int64}
    assert seen(lambda k, s, p: k.chunk_size) >= set(ssd.SUPPORTED_CHUNK_SIZES)
    assert seen(lambda k, s, p: k.headdim) >= {32, 64, 128}
    assert seen(lambda k, s, p: k.dstate) >= {16, 32, 64, 128, 256}
    assert seen(lambda k, s, p: p) >= {"ieee", "3xtf32", "tf32", "input", "2xbf16", "3xbf16",
                                       "2xfp16", "3xfp16"}
    for flag in ("has_d", "has_bias", "softplus", "has_limit", "per_seq_start", "varlen"):
        assert seen(lambda k, s, p: getattr(k, flag)) == {False, True}, flag
    assert seen(lambda k, s, p: k.z_dtype is not None) == {False, True}
    assert seen(lambda k, s, p: k.needs_int64()) == {False, True}
    # Tuner knobs the dispatcher takes only from a table or a user's cache are compiled too.
    assert {v.config.transposed for v in covering_variants() if v.kernel == "compute_out"} == {
        False, True}
    assert {v.config.latency for v in covering_variants() if v.kernel == "compute_out"} == {0, 2}
    assert {v.config.out_transposed for v in covering_variants()
            if v.kernel == "scan_out"} == {False, True}
    assert {v.config.occupancy for v in covering_variants()
            if v.kernel == "compute_out"} >= {2, 3, 4}
    for kernel in ("compute_out", "chunk_state"):
        assert {v.config.worker_warps for v in covering_variants()
                if v.kernel == kernel} == {None, 8}, kernel
    # Pairwise where it matters most: each precision mode with float32 and with 16-bit x.
    pairs = seen(lambda k, s, p: (p, k.x_dtype == torch.float32))
    assert pairs >= {("ieee", True), ("ieee", False), ("3xtf32", True), ("3xtf32", False),
                     ("3xbf16", True), ("3xbf16", False),
                     ("tf32", True), ("tf32", False), ("input", False)}


def _constraint_matches(constraint, arg) -> bool:
    from cuda.tile.compilation import ArrayConstraint, ConstantConstraint, ScalarConstraint
    if isinstance(constraint, ArrayConstraint):
        return (isinstance(arg, torch.Tensor) and CT_DTYPE[arg.dtype] == constraint.dtype
                and arg.dim() == constraint.ndim)
    if isinstance(constraint, ScalarConstraint):
        kind = float if constraint.dtype == CT_DTYPE[torch.float32] else int
        return isinstance(arg, kind) and not isinstance(arg, bool)
    if isinstance(constraint, ConstantConstraint):
        return type(arg) is type(constraint.value) and arg == constraint.value
    return False


LAUNCH_SPECS = (
    ProblemSpec(batch=2, seqlen=300, nheads=8, headdim=64, dstate=32, ngroups=2, chunk_size=64,
                x_dtype="bf16", bc_dtype="bf16", D="head", z=True, dt_bias=True,
                dt_softplus=True, dt_limit=(1e-3, 0.1), initial_states=True, state_dtype="bf16"),
    ProblemSpec(batch=1, seqlen=1000, nheads=4, headdim=32, dstate=128, ngroups=1,
                chunk_size=256, cu_seqlens=(0, 100, 400, 1000), initial_states=True,
                per_sequence_initial_states=True, return_varlen_states=True, D="channel"),
    ProblemSpec(batch=1, seqlen=129, nheads=4, headdim=16, dstate=16, chunk_size=128,
                x_dtype="fp16", bc_dtype="bf16", param_dtype="bf16", cu_seqlens=(0, 64, 129),
                pass_seq_idx=False, return_varlen_states=True),
    # The walk of kernels/scan_out.py in two segments (257 chunks of 48 heads,
    # ssd.walk_segments): the end states of the first segment's four parts (ssd.segment_split),
    # then the walk from the segments' entering states.
    ProblemSpec(batch=1, seqlen=16400, nheads=48, headdim=64, dstate=128, chunk_size=64,
                x_dtype="bf16", bc_dtype="bf16", D="channel", initial_states=True),
)


def _grid(name: str, cfg, problem, plan) -> tuple:
    """The launch grid that covers every output tile of kernel ``name`` once (the walk's, of the
    plan's segments of each sequence; the segments' end states, of the parts of all but the
    last; their entering states, of each (row, head))."""
    b, L, H, P, N = problem.batch, problem.seqlen, problem.nheads, problem.headdim, problem.dstate
    nchunks = math.ceil(L / problem.chunk_size)
    nseq = 0 if problem.cu_seqlens is None else problem.nseq
    if name == "chunk_cumsum":
        return (nchunks, b * math.ceil(H / cfg.head_block))
    if name == "chunk_scores":
        return (b * nchunks * (cfg.chunk_size // cfg.row_block) * problem.ngroups,)
    if name == "compute_out":
        return (b * nchunks * (cfg.chunk_size // cfg.row_block) * H * math.ceil(P / cfg.p_block),)
    if name in ("scan_out", "segment_states"):
        walked = (plan.walk_segments if name == "scan_out"
                  else (plan.walk_segments - 1) * plan.segment_split)
        return (b * walked * H * math.ceil(P / cfg.p_block),)
    if name == "entering_states":
        return (b * H * math.ceil(P / cfg.p_block),)
    per_row = H * math.ceil(P / cfg.p_block) * math.ceil(N / cfg.n_block)
    if name == "varlen_states":     # chunk_state over the sequences' ends alone
        return (nseq * per_row,)
    return ((nchunks + nseq) * b * per_row,) if name == "chunk_state" else (b * per_row,)


def _assert_launches_match(launches, problem, plan) -> None:
    """The recorded (grid, kernel, args) of ``plan``'s launches on ``problem``: each kernel its
    config's, its arguments of the config's signature, its grid ``_grid``'s."""
    named = plan.named_configs()
    assert len(launches) == len(named)
    for (grid, kernel, args), (name, cfg) in zip(launches, named):
        assert kernel is cfg.kernel, cfg.describe()
        params = cfg.signature().parameters
        assert len(args) == len(params), cfg.describe()
        for i, (constraint, arg) in enumerate(zip(params, args)):
            assert _constraint_matches(constraint, arg), f"{cfg.describe()}: argument {i}: {arg!r}"
        assert grid == _grid(name, cfg, problem, plan), name


@pytest.mark.parametrize("spec", LAUNCH_SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("precision", [None, "ieee", "tf32"])
@pytest.mark.parametrize("shared_scores", [False, True])
def test_launches_match_compiled_signatures(monkeypatch, spec, precision, shared_scores):
    """The host code (run on CPU tensors with ct.launch intercepted) passes every kernel the
    dtypes, ranks, scalars and constants of the signature the dispatcher's config describes,
    over a grid that covers every output tile exactly once (with compute_out's scores computed
    inside it or shared from kernels/chunk_scores.py)."""
    make_plan = ssd.make_plan

    def plan_with_knob(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        return replace(plan, out=replace(plan.out, shared_scores=shared_scores,
                                         ordered_loads=shared_scores))

    monkeypatch.setattr(ssd, "make_plan", plan_with_knob)
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    problem = build_problem(spec)
    key = ssd.ProblemKey.from_problem(problem, varlen=problem.cu_seqlens is not None,
                                      wide=False)
    plan = ssd.make_plan(key, None, precision)
    with recorded_launches() as launches:
        ssd.run_stages(problem, precision=precision)
    _assert_launches_match(launches, problem, plan)


@pytest.mark.parametrize("nheads, seqlen", [(128, 1000), (48, 16400)])
def test_the_walk_launches_its_varlen_states_kernels_as_compiled(monkeypatch, nheads, seqlen):
    """Where the walk takes varlen states (``ssd.WALK_VARLEN_STATES``, a rule not yet
    dispatched), the host code passes the walk (unsplit at 128 heads, in segments at 48) and
    chunk_state over the sequences' ends the dtypes, ranks, scalars and constants their configs'
    signatures describe, over grids that cover every output tile once."""
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    spec = ProblemSpec(batch=1, seqlen=seqlen, nheads=nheads, headdim=64, dstate=128,
                       chunk_size=64, x_dtype="bf16", bc_dtype="bf16",
                       cu_seqlens=(0, 100, 640, 641, seqlen), return_varlen_states=True)
    problem = build_problem(spec)
    with ssd.dispatch_rules({("WALK_VARLEN_STATES", None): True}):
        plan = ssd.make_plan(ssd._key(problem, True, None))
        with recorded_launches() as launches:
            ssd.run_stages(problem)
    assert plan.named_configs()[-1] == ("varlen_states", plan.chunk_state)
    assert plan.scan_out.varlen and plan.scan_out.segmented == (nheads == 48)
    _assert_launches_match(launches, problem, plan)


def _h200_kernel_names() -> list[str]:
    """The chunk_state and compute_out kernel names ncu recorded on the H200 for the first anchor
    with D per head, out only (kernels.gpu_report.anchor_inputs; the report's header has the
    command)."""
    import gzip
    import re
    from pathlib import Path
    report = Path(__file__).parent.parent / "reports/h200/experiments/ncu_anchor0_f0f2406.txt.gz"
    with gzip.open(report, "rt") as f:
        return sorted(set(re.findall(r"((?:chunk_state|compute_out)_kernel_\S+) \(", f.read())))


def test_persistent_kernels_launch_the_blocks_the_gpu_holds(monkeypatch):
    """``persistent`` (compute_out's and chunk_state's knob): SMs x the occupancy hint blocks,
    never more than the tiles; one block per tile without it, or off a CUDA device (where the
    host code runs on meta or CPU tensors)."""
    from kernels import tile_ops
    from kernels.compute_out import ComputeOutConfig
    from kernels.fwd_pass_state import ChunkStateConfig
    cpu = torch.device("cpu")
    for cfg in (ComputeOutConfig(persistent=True, occupancy=3),
                ChunkStateConfig(persistent=True, occupancy=3)):
        monkeypatch.setattr(tile_ops, "sm_count", lambda device: None)
        assert cfg.launch_blocks(32768, cpu) == 32768
        monkeypatch.setattr(tile_ops, "sm_count", lambda device: 132)
        assert cfg.launch_blocks(32768, cpu) == 396
        assert cfg.launch_blocks(100, cpu) == 100
        assert replace(cfg, occupancy=None).launch_blocks(32768, cpu) == 132
        assert replace(cfg, persistent=False).launch_blocks(32768, cpu) == 32768


@pytest.mark.parametrize("batch, nheads, flat", [(8191, 64, False), (8192, 64, True),
                                                 (65535, 1, False), (65536, 1, True),
                                                 (70000, 8, True)])
def test_the_cumsum_grid_stays_within_cuda_limits_at_any_batch(batch, nheads, flat):
    """chunk_cumsum's grid is (chunks, rows x head blocks) up to CUDA's 65,535 on a second
    dimension, and flat past it (``needs_flat_grid``, which the plan follows), its block count
    the same; the meta tensors' launch recorded."""
    from kernels.chunk_cumsum import MAX_GRID_Y, chunk_cumsum, head_block_for, needs_flat_grid
    key = ssd.ProblemKey(batch=batch, seqlen=200, nheads=nheads, headdim=16, dstate=16, ngroups=1,
                         chunk_size=64, x_dtype=torch.bfloat16, b_dtype=torch.bfloat16,
                         c_dtype=torch.bfloat16)
    config = ssd.make_plan(key).cumsum
    assert needs_flat_grid(batch, nheads) == config.flat_grid == flat
    dt = torch.empty(batch, 200, nheads, device="meta")
    with recorded_launches() as launched:
        chunk_cumsum(dt, torch.empty(nheads, device="meta"), config)
    (grid, _, _), = launched
    head_blocks = -(-nheads // head_block_for(nheads))
    assert math.prod(grid) == 4 * batch * head_blocks
    assert len(grid) == (1 if flat else 2) and max(grid[1:], default=0) <= MAX_GRID_Y
    assert grid[0] <= 2 ** 31 - 1


def test_launch_signatures_are_the_ones_the_h200_compiled():
    """The arrays' constraints CI compiles with (``launch_signatures``: the host code on meta
    tensors, ``tile_ops.launch_constraint`` on each argument) are those of the cubins the JIT
    built on the H200 for the same call, read back from their kernel names."""
    from cuda.tile.compilation import ArrayConstraint, demangle_kernel_name
    from kernels.variants import _anchor, launch_signatures
    key = _anchor(8, 4096, 64, 1, has_d=True, states_returned=False)   # the recorded call's
    ours = {name: signature for name, _, signature in launch_signatures(key, ssd.make_plan(key))}
    names = _h200_kernel_names()
    assert len(names) == 2

    def arrays(parameters):
        return [p for p in parameters if isinstance(p, ArrayConstraint)]

    for recorded in names:
        # The arrays only: constants are tiles and knobs, which the table and the kernels'
        # parameters (compute_out's latency, added after the recording) move on from.
        function, signature = demangle_kernel_name(recorded)
        theirs = arrays(signature.parameters)
        mine = arrays(ours[function.removesuffix("_kernel")].parameters)
        assert len(theirs) >= 10 and len(mine) == len(theirs), function
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert a == b, f"{function} array argument {i}"


def test_tma_check_catches_what_contiguous_signatures_lose():
    """Compiled from what any contiguous tensor guarantees (a config's own ``signature()``) the
    first anchor's compute_out reads strided tiles without TMA, and the check says so; from the
    launch's signature every tile moves by TMA."""
    variant = next(v for v in VARIANTS
                   if v.kernel == "compute_out" and "anchor-b8-L4096-h64" in v.recipes)
    assert violations(variant, compile_variant(variant, "sm_90")) == []
    contiguous = replace(variant, signature=variant.config.signature())
    problems = violations(contiguous, compile_variant(contiguous, "sm_90"))
    assert problems and all("no TMA at" in p for p in problems), problems


def test_compiles_where_cuda_home_names_another_toolkit(monkeypatch, tmp_path):
    """The H200 host sets CUDA_HOME to its CUDA 13.0 toolkit; the pip tileiras reads the toolkit
    CUDA_HOME names and failed there, so the tuner's code digests came back unknown. We run it
    as cuTile's JIT does, without CUDA_HOME (here an empty toolkit stands in for the other one)."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    result = compile_variant(VARIANTS[0], "sm_90")
    assert result.ok, result.error


def test_anchor_shapes_pick_compiled_variants():
    """What the dispatcher picks for the anchor shapes the GPU report times (bf16, default
    chunk size, precision and state dtype) is among the variants CI compiles."""
    covered = {v.config for v in VARIANTS}
    bf16 = torch.bfloat16
    for batch, seqlen, nheads, headdim, dstate, ngroups in ANCHORS:
        key = ssd.ProblemKey(batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim,
                             dstate=dstate, ngroups=ngroups, chunk_size=ssd.DEFAULT_CHUNK_SIZE,
                             x_dtype=bf16, b_dtype=bf16, c_dtype=bf16)
        missing = set(ssd.make_plan(key).configs()) - covered
        assert not missing, [c.describe() for c in missing]


def _loops_carrying_tokens(ir: str) -> list[str]:
    """The loops of a Tile IR text that carry a memory token from one iteration to the next:
    cuTile orders the memory operations of successive iterations through it
    (cuda/tile/_passes/token_order.py)."""
    return [line for line in ir.splitlines()
            if re.search(r"\b(for|loop) ", line) and "iter_values" in line
            and "token" in line.split("->")[-1]]


def _step_loop_stores_off_the_entry_token(ir: str) -> list[str]:
    """The stores of a walk's step loop (not of a loop inside it) that wait on a token other than
    the one the kernel makes at its entry: stores ordered after earlier ones."""
    lines = ir.splitlines()
    entry = next(re.search(r"(%\w+) = make_token", line).group(1) for line in lines
                 if "make_token" in line)
    step = next(i for i, line in enumerate(lines) if re.search(r"\bfor ", line)
                and "iter_values" in line and "tile<" in line.split("->")[-1])
    indent = lambda line: len(line) - len(line.lstrip())  # noqa: E731
    found, inner = [], None
    for line in lines[step + 1:]:
        if indent(line) <= indent(lines[step]):
            break
        if inner is not None and indent(line) > inner:
            continue
        inner = indent(line) if re.search(r"\bfor ", line) else None
        if "store_view_tko" in line and not re.search(rf"token = {entry}\b", line):
            found.append(line.strip())
    return found


def test_the_walk_does_not_order_its_steps_out_stores():
    """One chunk a step, the walk's out stores are loop-parallel (kernels/scan_out.py: indexed by
    the loop's own index, without the chunk guard, whose branch cost one block an SM 14% at the
    second anchor): no loop of a 32-bit-indexed walk carries a memory token. (The int64 variants
    index by the loop index converted, and their step loop carries one.) Two chunks a step keep
    the guard, and there the step loop carries one too (so the check can fail). A walk that
    stores varlen states orders those stores (in a loop over the chunk's ends), its step loop
    carrying their token, while out's stores still wait on none but the kernel's first."""
    walks = [v for v in VARIANTS
             if v.kernel == "scan_out" and v.config.computes_out and not v.config.wide]
    assert len(walks) >= 20, len(walks)
    for variant in walks:
        assert variant.config.chunks_per_step == 1, variant.name
        ir = tile_ir(variant)
        if variant.config.varlen:
            assert len(_loops_carrying_tokens(ir)) == 2, variant.name
            assert not _step_loop_stores_off_the_entry_token(ir), variant.name
        else:
            assert not _loops_carrying_tokens(ir), variant.name
    two_chunks = replace(walks[0].config, chunks_per_step=2)
    assert _loops_carrying_tokens(tile_ir(replace(walks[0], config=two_chunks,
                                                  signature=two_chunks.signature())))
    varlen = next(v for v in walks if v.config.varlen)
    two_chunks = replace(varlen.config, chunks_per_step=2)
    assert _step_loop_stores_off_the_entry_token(tile_ir(replace(
        varlen, config=two_chunks, signature=two_chunks.signature())))


@pytest.mark.parametrize("recipe", ["anchor-b8-L4096-h64-q64-out-only-fused-start-d",
                                    "b1-L65536-h64-q64-d-out-only-walk-four-segments"])
def test_d_on_the_weights_diagonal_compiles_for_the_walks_with_d_per_head(recipe):
    """The A/B knob ``ScanOutConfig.d_term`` (kernels/scan_out.py, 'D's term') on the paired walks
    of out with D per head (the first anchor's from initial states, out transposed, and four
    segments at the third anchor's size), compiled for sm_90 as their launches specialize them:
    every MMA on tensor cores, every tile by TMA, two blocks' shared memory still within an SM,
    and the weights cut in two ("2xbf16", ``weights_precision``) in more MMAs than the walk's
    mode's. (What each costs in registers, spills and shared memory: the ab --compile records,
    kernels/scan_out.py 'D's term'.)"""
    from kernels.tile_ops import kernel_signature
    variant = next(v for v in VARIANTS if v.kernel == "scan_out" and v.recipes[0] == recipe)
    # The launches' signature, the constants at its end the knob's.
    arrays = list(variant.signature.parameters)[:-len(variant.config.constants())]
    mmas = {}
    for weights in ("", "2xbf16"):
        config = replace(variant.config, d_term="diagonal", weights_precision=weights)
        knob = replace(variant, config=config,
                       signature=kernel_signature(arrays + list(config.constants())))
        result = compile_variant(knob, "sm_90")
        assert result.ok, result.error
        assert not violations(knob, result), (weights, violations(knob, result))
        assert not occupancy_shortfall(knob, result), weights
        mmas[weights] = result.tensor_core_mmas
    assert mmas["2xbf16"] > mmas[""], mmas
