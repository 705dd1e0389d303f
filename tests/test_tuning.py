"""The tuned-configuration table (kernels/tuned.json, written by ``python3 -m kernels.tune`` from an
H200 run) and how the dispatcher uses it. CPU only: the table changes tiles and occupancy hints,
never what is computed; CI compiles the variants it picks (tests/test_compile.py), the GPU grid
checks their numbers."""
from __future__ import annotations

import functools
import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kernels import ssd, tune
from kernels.tile_ops import next_pow2

bf16 = torch.bfloat16
DEFAULT = ssd.resolve_precision(None, bf16)


def anchor_shape(batch: int) -> dict:
    """A tune.json record's shape: the first anchor at another batch."""
    return dict(batch=batch, seqlen=4096, nheads=64, headdim=64, dstate=128, ngroups=1,
                dtype="bfloat16")


def anchor_key(**kw) -> ssd.ProblemKey:
    return ssd.ProblemKey(batch=8, seqlen=4096, nheads=64, headdim=64, dstate=128, ngroups=1,
                          chunk_size=256, x_dtype=bf16, b_dtype=bf16, c_dtype=bf16, **kw)


def test_every_entry_fits_the_kernels_it_configures():
    entries = ssd.TUNED
    assert entries, "kernels/tuned.json is missing or empty"
    for entry in entries.values():
        key = entry["key"]
        assert set(key) == {"headdim", "dstate", "chunk_size", "x_dtype", "precision",
                            "shared_scores"}
        assert key["headdim"] == next_pow2(key["headdim"]) and key["dstate"] == next_pow2(key["dstate"])
        searched = [stage for stage in tune.CANDIDATES if stage in entry]
        # The stages of one of the two plans: chunk_state and the state passing, or the fused
        # scan (ssd.fuses_state_scan), either with compute_out.
        assert "compute_out" in searched and ("state_scan" in searched or {
            "chunk_state", "state_passing"} <= set(searched)), searched
        for stage in searched:
            tiles = entry[stage]
            # Knobs the tuner gained after an entry was written hold their config default there.
            defaults = {"compute_out": dict(transposed=False, ordered_loads=False, latency=0,
                                            worker_warps=None, persistent=False),
                        "chunk_state": dict(transposed=False, ordered_loads=False, latency=0,
                                            worker_warps=None, persistent=False),
                        }.get(stage, {})
            assert {**defaults, **tiles} in tune.CANDIDATES[stage], f"{stage}: {tiles}"
            assert key["chunk_size"] % tiles.get("row_block", 1) == 0
            assert tiles.get("p_block", 0) <= key["headdim"] and tiles.get("n_block", 0) <= key["dstate"]
        first = entry["measured"][0]
        if first.get("probed"):       # a probed mode: compute_out timed at the searched tiles
            assert first["compute_out_ms"] > 0
        elif not first.get("dispatcher_kept"):
            assert first["tuned_ms"] < first["default_ms"]


@pytest.mark.parametrize("index", range(len(ssd.TUNED)))
def test_the_dispatcher_takes_the_table_entry_of_its_key(index):
    entry = list(ssd.TUNED.values())[index]
    key = entry["key"]
    dtype = getattr(torch, key["x_dtype"])
    # 64 heads in 1 group share their scores, 64 groups of 1 do not.
    # An out-alone call of 512 (row, head) pairs takes the fused scan where its key's entry has
    # one (at its tiles: enough blocks that none shrink), else the two state kernels.
    problem = replace(anchor_key(), headdim=key["headdim"], dstate=key["dstate"],
                      chunk_size=key["chunk_size"], x_dtype=dtype, b_dtype=dtype, c_dtype=dtype,
                      ngroups=1 if key["shared_scores"] else 64,
                      states_returned="state_scan" not in entry)
    plan = ssd.make_plan(problem, precision=key["precision"])
    assert plan.out.shared_scores == key["shared_scores"]
    for stage, field in tune.FIELD.items():
        if stage not in entry:
            continue
        config = getattr(plan, field)
        for name, value in entry[stage].items():
            if stage == "state_passing" and name != "occupancy":
                # the tiles are where the shrinking for blocks in flight starts
                assert getattr(config, name) <= value
            else:
                assert getattr(config, name) == value, (stage, name)


def test_scores_are_shared_from_eight_heads_per_group():
    assert ssd.make_plan(anchor_key()).out.shared_scores
    assert ssd.make_plan(replace(anchor_key(), nheads=32, ngroups=4)).out.shared_scores
    assert not ssd.make_plan(replace(anchor_key(), nheads=32, ngroups=8)).out.shared_scores
    assert (ssd.tuning_key(anchor_key(), DEFAULT)
            != ssd.tuning_key(replace(anchor_key(), ngroups=16), DEFAULT))


def _meta_problem(key: ssd.ProblemKey, **changes):
    from kernels.variants import launch_problem
    return replace(launch_problem(key), **dict(dict(return_final_states=False), **changes))


@pytest.mark.parametrize("batch, nheads, ngroups, n_block, seqlen",
                         [(4, 64, 1, 128, 4096), (4, 32, 8, 128, 4096), (2, 64, 1, 128, 4096),
                          (1, 64, 1, 64, 1024)])
def test_many_row_heads_out_alone_take_the_fused_state_scan_at_chunk_64(batch, nheads, ngroups,
                                                                        n_block, seqlen):
    """chunk_size=None picks chunk 64 and the fused scan, two chunks a step, where 64 (row, head)
    pairs or more walk their chunks: 64 x 128 tiles, the state columns halved where fewer than 128
    blocks would walk (``ssd.state_scan_tiles``). compute_out's tiles come from the key's
    chunk-64 table entry, else chunk 256's. From SCAN_OUT_MIN_ROW_HEADS pairs (at dstate up to
    128) the walk of kernels/scan_out.py runs instead of both (the tests below); with fewer
    pairs, only where the fused scan does not take the call."""
    key = replace(anchor_key(), batch=batch, nheads=nheads, ngroups=ngroups, seqlen=seqlen)
    assert ssd.default_chunk_size(_meta_problem(key)) == ssd.STATE_SCAN_CHUNK_SIZE == 64
    fused = replace(key, chunk_size=64, states_returned=False)
    plan = ssd.make_plan(fused)
    walks = batch * nheads >= ssd.SCAN_OUT_MIN_ROW_HEADS
    names = [name for name, _ in plan.named_configs()]
    assert (names[1] == "state_scan", "scan_out" in names) == (not walks, walks)
    assert (plan.state_scan.p_block, plan.state_scan.n_block) == (64, n_block)
    assert (plan.state_scan.chunk_size, plan.state_scan.chunks_per_step) == (64, 2)
    assert plan.state_scan.state_dtype == plan.out.state_dtype == bf16
    entry = ssd.TUNED.get(json.dumps(ssd.tuning_key(fused, DEFAULT), sort_keys=True)) or \
        ssd.TUNED[json.dumps(ssd.tuning_key(replace(fused, chunk_size=256), DEFAULT),
                             sort_keys=True)]
    assert {k: getattr(plan.out, k) for k in entry["compute_out"]} == entry["compute_out"]


def test_from_128_row_heads_the_scan_and_compute_out_run_as_one_walk():
    """At the first anchor's 512 (row, head) pairs, chunk 64: kernels/scan_out.py after the
    shared scores, no states stored, its blocks two to an SM; and so from 128 pairs, one to an
    SM there (with x's latency hint, ``ssd.walk_x_latency``); its own scores at dstate 64; at
    dstate 256 one block an SM (``ssd.WALK_MAX_DSTATE``), in fp16 with 8 worker warps
    (``ssd.WALK_WORKER_WARPS``); not at 64 pairs too short to split (the test below), at chunk
    128, or with both z and D where its blocks run one to an SM."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    plan = ssd.make_plan(fused)
    assert [name for name, _ in plan.named_configs()] == ["chunk_cumsum", "chunk_scores",
                                                           "scan_out"]
    assert (plan.scan_out.chunk_size, plan.scan_out.p_block, plan.scan_out.n_pad) == (64, 64, 128)
    assert plan.scan_out.occupancy == 2
    assert ssd.make_plan(replace(fused, batch=2)).scan_out == replace(
        plan.scan_out, occupancy=None, x_latency=ssd.WALK_X_LATENCY, out_transposed=False)
    small_state = ssd.make_plan(replace(fused, dstate=64))
    assert [name for name, _ in small_state.named_configs()] == ["chunk_cumsum", "scan_out"]
    assert ssd.make_plan(replace(fused, has_d=True)).scan_out.has_d
    assert ssd.make_plan(replace(fused, z_dtype=bf16)).scan_out.has_z
    both = ssd.make_plan(replace(fused, has_d=True, z_dtype=bf16)).scan_out
    assert (both.has_d, both.has_z, both.occupancy) == (True, True, 2)
    large_state = ssd.make_plan(replace(fused, dstate=256)).scan_out
    assert (large_state.n_pad, large_state.occupancy, large_state.shared_scores,
            large_state.worker_warps) == (256, None, True, None)
    assert ssd.make_plan(replace(fused, dstate=256, states_returned=True)).scan_out is not None
    fp16 = dict(x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    assert ssd.make_plan(replace(fused, **fp16)).scan_out.worker_warps is None
    for final in (False, True):
        fp16_large = ssd.make_plan(replace(fused, dstate=256, states_returned=final,
                                           **fp16)).scan_out
        assert (fp16_large.precision, fp16_large.n_pad, fp16_large.occupancy,
                fp16_large.worker_warps) == ("2xfp16", 256, None, 8)
    for change in (dict(batch=1, seqlen=1024), dict(chunk_size=128),
                   dict(batch=2, has_d=True, z_dtype=bf16),
                   dict(dstate=256, has_d=True, z_dtype=bf16)):
        assert ssd.make_plan(replace(fused, **change)).scan_out is None, change


def test_below_128_row_heads_a_bf16_walk_splits_long_sequences_into_segments():
    """The third anchor's 64 pairs (1024 chunks at chunk 64) with final states: two segments, 128
    blocks, one round on 132 SMs, one block an SM; first the states-only walk of the first segment
    in four parts (256 blocks, one round two to an SM; no out, no scores, from zero), then the walk
    of both from float32 entering states; so out alone without D. Out alone with D and without z,
    from 48 to 82 pairs, four segments paired (``ssd.walks_four_segments``; past one paired round
    from 67), their first three whole. 32 pairs split in eight (four fill one round alone; from
    four, twice as many run paired), their first seven segments whole; at dstate 256, where the walk
    does not pair, four segments, and the parts fill one block an SM. 67 to 127 pairs, whose two
    segments do not fit one round alone, two segments paired, but four from 67 to 82 (2 to 2.5
    rounds alone; not with both z and D, which the walk takes paired only), with final states alone;
    34 to 47, whose two segments alone the walk does not take (pairs times segments under
    WALK_MIN_SPLIT_ROW_HEADS), four paired; 17 to 23 eight, 9 to 11 sixteen. No split below
    WALK_SPLIT_MIN_CHUNKS chunks, no walk where pairs times segments stay under
    WALK_MIN_SPLIT_ROW_HEADS (segments shorter than WALK_SEGMENT_MIN_CHUNKS cap them), nor for fp16
    x below SCAN_OUT_MIN_ROW_HEADS."""
    key = replace(anchor_key(), batch=1, seqlen=65536, chunk_size=64)
    assert ssd.default_chunk_size(_meta_problem(replace(key, chunk_size=256),
                                                return_final_states=True)) == 64
    plan = ssd.make_plan(key)
    assert plan.walk_segments == ssd.walk_segments(key, ssd.REFERENCE_SM_COUNT) == 2
    assert plan.segment_split == ssd.segment_split(key, 2, ssd.REFERENCE_SM_COUNT) == 4
    assert [name for name, _ in plan.named_configs()] == [
        "chunk_cumsum", "segment_states", "entering_states", "chunk_scores", "scan_out"]
    ends, walk = plan.segment_states, plan.scan_out
    assert (ends.computes_out, ends.segmented, ends.has_start, ends.shared_scores,
            ends.occupancy) == (False, True, False, False, 2)
    assert (walk.computes_out, walk.segmented, walk.has_start, walk.start_dtype,
            walk.occupancy, walk.state_precision) == (True, True, True, torch.float32, None,
                                                      "3xbf16")
    assert (plan.entering_states.has_start, plan.entering_states.p_block) == (False, 32)
    from_bf16 = ssd.make_plan(replace(key, start_dtype=bf16))
    assert from_bf16.scan_out.start_dtype == torch.float32
    assert (from_bf16.entering_states.has_start,
            from_bf16.entering_states.start_dtype) == (True, bf16)
    out_alone = replace(key, states_returned=False)
    assert ssd.default_chunk_size(_meta_problem(replace(out_alone, chunk_size=256))) == 64
    split_out_alone = ssd.make_plan(out_alone)                          # not the fused scan
    assert (split_out_alone.walk_segments, split_out_alone.segment_split,
            split_out_alone.scan_out.occupancy) == (2, 4, None)
    assert [name for name, _ in split_out_alone.named_configs()] == [
        "chunk_cumsum", "segment_states", "entering_states", "chunk_scores", "scan_out"]
    quarter = ssd.make_plan(replace(out_alone, nheads=32))
    assert (quarter.walk_segments, quarter.segment_split) == (8, 1)     # 224 blocks of parts
    assert quarter.scan_out.occupancy == quarter.segment_states.occupancy == 2
    assert ssd.walk_segments(replace(out_alone, nheads=32, dstate=256), 132) == 4   # no pairs
    assert ssd.walk_segments(replace(out_alone, nheads=32, seqlen=32768 - 64), 132) == 4
    assert ssd.segment_split(replace(key, nheads=48), 2, 132) == 4       # 192 blocks
    assert ssd.segment_split(replace(key, nheads=48, dstate=256), 2, 132) == 2  # one an SM
    assert ssd.segment_split(replace(key, nheads=16), 8, 132) == 2       # 224 blocks
    assert ssd.segment_split(key, 2, 64) == 2
    assert ssd.segment_split(replace(key, nheads=16), 1, 132) == 1
    assert ssd.walk_segments(replace(key, nheads=16), 132) == 16         # 8 alone, paired
    assert ssd.walk_segments(replace(key, nheads=16), 264) == 16         # 16 alone
    assert ssd.walk_segments(replace(key, nheads=12), 132) == 16         # 96 pairs of 8
    assert ssd.walk_segments(replace(key, nheads=2), 132) == ssd.WALK_MAX_SEGMENTS == 16
    assert ssd.walk_segments(replace(key, batch=2), 132) == 1            # 128 pairs
    for nheads, segments in ((83, 2), (96, 2), (127, 2), (34, 4), (40, 4), (47, 4),
                             (17, 8), (20, 8), (23, 8), (9, 16), (11, 16)):
        paired = ssd.make_plan(replace(key, nheads=nheads))    # twice those of one round alone
        assert (paired.walk_segments, paired.scan_out.occupancy) == (segments, 2), nheads
        assert ssd.default_chunk_size(_meta_problem(replace(key, nheads=nheads, chunk_size=256),
                                                    return_final_states=True)) == 64
    for nheads in (67, 80, 82):           # with final states four alone, 2 to 2.5 rounds
        alone = ssd.make_plan(replace(key, nheads=nheads))
        assert (alone.walk_segments, alone.segment_split, alone.scan_out.occupancy,
                alone.scan_out.state_precision) == (4, 1, None, "3xbf16"), nheads
    with_d = replace(out_alone, has_d=True)
    for nheads in (48, 66, 67, 80, 82):   # out alone with D four paired, up to 1.25 rounds
        paired = ssd.make_plan(replace(with_d, nheads=nheads))
        assert (paired.walk_segments, paired.segment_split, paired.scan_out.occupancy,
                paired.scan_out.state_precision) == (4, 1, 2, "input"), nheads
    for change in (dict(states_returned=False, nheads=83), dict(nheads=80, has_d=True,
                                                                 z_dtype=bf16),
                   dict(states_returned=False, nheads=80),
                   dict(states_returned=False, nheads=80, z_dtype=bf16)):
        paired = ssd.make_plan(replace(key, **change))
        assert (paired.walk_segments, paired.scan_out.occupancy) == (2, 2), change
    for change in (dict(), dict(z_dtype=bf16), dict(has_d=True, dstate=256)):
        assert ssd.walk_segments(replace(out_alone, nheads=64, **change), 132) == 2, change
    assert ssd.make_plan(replace(key, nheads=80, z_dtype=bf16)).walk_segments == 4
    assert ssd.make_plan(replace(key, nheads=72, seqlen=16384)).walk_segments == 4  # 4 x 64
    assert ssd.walk_segments(replace(key, nheads=80), 120) == 2    # 2.7 rounds alone
    assert ssd.WALK_SPLIT_MIN_CHUNKS == 4 * ssd.WALK_SEGMENT_MIN_CHUNKS
    for nheads in (48, 66):                                  # two alone, one round, 96+ blocks
        assert ssd.walk_segments(replace(key, nheads=nheads), 132) == 2
        assert ssd.make_plan(replace(key, nheads=nheads)).scan_out.occupancy is None
    assert ssd.walk_segments(replace(key, nheads=5), 132) == 16          # 80 blocks, no more
    assert ssd.make_plan(replace(key, nheads=5)).scan_out is None
    assert ssd.walk_segments(replace(key, nheads=20, seqlen=16384), 132) == 4   # 256 chunks
    assert ssd.make_plan(replace(key, nheads=20, seqlen=16384)).scan_out is None
    assert ssd.walk_segments(replace(key, nheads=80, dstate=256), 132) == 1  # no pairs
    assert ssd.make_plan(replace(key, nheads=80, dstate=256)).scan_out is None
    assert ssd.walk_segments(replace(key, nheads=40, headdim=128), 132) == 1  # 80 blocks, 40 pairs
    shortest = replace(key, seqlen=16384)                                # 256 chunks
    assert ssd.walk_segments(shortest, 132) == 2
    assert ssd.walk_segments(replace(shortest, seqlen=16384 - 64), 132) == 1
    assert ssd.make_plan(replace(shortest, seqlen=16384 - 64)).scan_out is None
    short_out_alone = ssd.make_plan(replace(out_alone, seqlen=8192))     # the fused scan's
    assert [name for name, _ in short_out_alone.named_configs()] == [
        "chunk_cumsum", "state_scan", "chunk_scores", "compute_out"]
    assert ssd.make_plan(replace(key, nheads=8)).walk_segments == 16     # 1024 chunks
    assert ssd.make_plan(replace(key, nheads=8, seqlen=32768)).scan_out is None  # 64 blocks
    fp16 = replace(key, x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    assert ssd.make_plan(fp16).scan_out is None
    assert ssd.default_chunk_size(_meta_problem(replace(fp16, chunk_size=256),
                                                return_final_states=True)) == 256


def test_calls_returning_final_states_walk_with_float32_grade_increments():
    """From 128 (row, head) pairs a bf16 call that returns final states runs at chunk 64 as the
    walk, its state update in '3xbf16' (``ssd.state_precision``'s mode for returned states), its
    out in 'input'; not where every stage is handed back (``ssd_forward_stages``: the chunk
    states too), nor yet with varlen states (``ssd.WALK_VARLEN_STATES``): under that rule the
    walk of one row of 128 heads stores the state entering each end's chunk and chunk_state adds
    the ends' increments in '3xbf16', float32 ones."""
    key = anchor_key()
    assert ssd.default_chunk_size(_meta_problem(key, return_final_states=True)) == 64
    returned = replace(key, chunk_size=64, states_returned=True)
    walk = ssd.make_plan(returned).scan_out
    assert (walk.precision, walk.state_precision, walk.occupancy) == ("input", "3xbf16", 2)
    assert ssd.make_plan(replace(returned, states_returned=False)).scan_out.state_precision == \
        "input"
    stages = ssd.make_plan(replace(returned, chunk_states_returned=True))
    assert stages.scan_out is None and "chunk_state" in dict(stages.named_configs())
    row = replace(returned, batch=1, nheads=128, varlen=True, seq_dtype=torch.int32,
                  cu_dtype=torch.int32, nseq=2)
    assert ssd.make_plan(row).scan_out is None
    with ssd.dispatch_rules({("WALK_VARLEN_STATES", None): True}):
        varlen = ssd.make_plan(row)
    assert (varlen.scan_out.varlen, varlen.scan_out.state_precision) == (True, "3xbf16")
    ends = varlen.chunk_state
    assert (ends.adds_entering, ends.varlen, ends.has_seq, ends.precision,
            ends.increment_dtype) == (True, True, False, "3xbf16", torch.float32)
    assert varlen.named_configs()[-1] == ("varlen_states", ends)


def test_packed_sequences_walk_and_scan_as_unpacked_calls_do():
    """Packed sequences (seq_idx, or cu_seqlens without per-sequence starts or varlen states)
    run as the same call unpacked does: the walk unsplit from 128 (row, head) pairs and below
    split into segments, and the fused state scan with compute_out (64 to 127 pairs too short to
    split), in the same kernels: only chunk_cumsum differs, putting the resets in the cumsum
    from seq_idx in its dtype (kernels/chunk_cumsum.py), and compute_out reads no seq_idx. With
    per-sequence starts or varlen states chunk 256's kernels mask by seq_idx (the test below);
    where the walk takes varlen states (``ssd.WALK_VARLEN_STATES``, a rule not yet dispatched)
    it stores them too (one launch more: chunk_state over the ends), and the fused scan's calls
    keep chunk 256's kernels."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    long_row = replace(fused, batch=1, seqlen=65536)
    assert ssd.make_plan(long_row).walk_segments > 1
    for seq_dtype in (torch.int32, torch.int64):
        for change in ({}, dict(batch=2), dict(states_returned=True, start_dtype=torch.float32),
                       dict(batch=1, seqlen=65536), dict(batch=1, seqlen=65536, dstate=64),
                       dict(batch=1, seqlen=65536, nheads=32, states_returned=True,
                            start_dtype=torch.bfloat16),
                       dict(batch=1), dict(batch=1, seqlen=8192)):
            plain = ssd.make_plan(replace(fused, **change))
            packed = ssd.make_plan(replace(fused, seq_dtype=seq_dtype, **change))
            assert plain.cumsum.seq_dtype is None and not plain.out.has_seq
            scans = change.get("batch") == 1 and change.get("seqlen", 4096) <= 8192
            names = dict(plain.named_configs())
            assert ("scan_out" not in names, "state_scan" in names) == (scans, scans)
            assert packed.named_configs() == replace(
                plain, cumsum=replace(plain.cumsum, seq_dtype=seq_dtype)).named_configs()
            assert (packed.walk_segments, packed.segment_split) == (
                plain.walk_segments, plain.segment_split)
    one_row = dict(batch=1, nheads=128, seq_dtype=torch.int32, cu_dtype=torch.int32, nseq=3)
    assert ssd.make_plan(replace(fused, **one_row)).cumsum.seq_dtype == torch.int32
    walked = (replace(fused, **one_row), replace(long_row, **{**one_row, "nheads": 64}))
    scanned = replace(fused, **{**one_row, "nheads": 64})
    for row in (*walked, scanned):
        for change in (dict(per_seq_start=True, start_dtype=torch.float32), dict(varlen=True)):
            plan = ssd.make_plan(replace(row, **change))
            assert plan.scan_out is plan.state_scan is None, change
            assert plan.cumsum.seq_dtype is None and plan.out.has_seq, change
        plain = ssd.make_plan(replace(row, states_returned=True))
        with ssd.dispatch_rules({("WALK_VARLEN_STATES", None): True}):
            plan = ssd.make_plan(replace(row, varlen=True))
        if row is scanned:
            assert plan.scan_out is plan.state_scan is None
            assert plan.cumsum.seq_dtype is None and plan.out.has_seq
        else:
            kernels, plain_kernels = dict(plan.named_configs()), dict(plain.named_configs())
            assert list(kernels) == [*plain_kernels, "varlen_states"]
            assert kernels["scan_out"] == replace(plain.scan_out, varlen=True)
            assert all(kernels[name] == config for name, config in plain_kernels.items()
                       if name != "scan_out")


def test_the_walk_updates_its_state_early_where_the_h200_ran_it_faster():
    """bf16 walks of out split into segments or returning final states update the state right
    after the entering state's term and load x last (``ssd.walk_updates_early``); out alone
    unsplit, with z and D unsplit, and in fp16 or float32 they keep the update at the step's
    end; the states-only walk of a split call never takes it (it computes no out)."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    final = replace(fused, states_returned=True)
    assert not ssd.make_plan(fused).scan_out.update_early
    assert ssd.make_plan(final).scan_out.update_early
    assert ssd.make_plan(replace(final, batch=2, nheads=64, ngroups=8)).scan_out.update_early
    assert not ssd.make_plan(replace(final, has_d=True, z_dtype=bf16)).scan_out.update_early
    assert ssd.make_plan(replace(final, has_d=True)).scan_out.update_early
    split = ssd.make_plan(replace(fused, batch=1, seqlen=65536, nheads=32))
    assert split.walk_segments > 1
    assert split.scan_out.update_early and not split.segment_states.update_early
    assert ssd.make_plan(replace(fused, batch=1, seqlen=65536, nheads=32, has_d=True,
                                 z_dtype=bf16)).scan_out.update_early
    for dtype in (torch.float16, torch.float32):
        other = replace(final, dstate=32, x_dtype=dtype, b_dtype=dtype, c_dtype=dtype)
        assert not ssd.make_plan(other).scan_out.update_early


def test_the_split_walk_paired_with_z_and_without_d_updates_its_state_last():
    """Split bf16 walks two blocks an SM at padded dstate 128 with z and without D update the
    state at the step's end, where the H100 ran them faster (``ssd.walk_updates_early``), from
    initial states or not, returning final states or not, and so take no x latency hint, and
    compute out transposed where they compute their own scores (``ssd.walk_out_transposed``);
    with D too, one block an SM or at dstate 64 they update early."""
    split = replace(anchor_key(), chunk_size=64, states_returned=False, batch=1, seqlen=65536,
                    nheads=32, z_dtype=bf16)
    for key in (split, replace(split, states_returned=True),
                replace(split, start_dtype=torch.float32),
                replace(split, seqlen=16384, nheads=96, ngroups=32), replace(split, dstate=100)):
        plan = ssd.make_plan(key)
        walk = plan.scan_out
        assert plan.walk_segments > 1 and walk.occupancy == 2
        assert not walk.update_early and walk.x_latency == 0
        assert walk.out_transposed == (key.ngroups == 32) == (not walk.shared_scores)
    for key in (replace(split, has_d=True), replace(split, has_d=True, d_per_channel=True),
                replace(split, z_dtype=None), replace(split, dstate=64),
                replace(split, nheads=64)):
        plan = ssd.make_plan(key)
        assert plan.walk_segments > 1 and plan.scan_out.update_early
    assert ssd.make_plan(replace(split, nheads=64)).scan_out.occupancy is None
    assert ssd.make_plan(replace(split, dstate=64)).scan_out.occupancy == 2


def test_the_unsplit_paired_walk_with_z_returning_final_states_updates_its_state_last():
    """Unsplit bf16 walks two blocks an SM at padded dstate 128 with z and without D that return
    final states update the state at the step's end, where the H100 ran them faster
    (``ssd.walk_updates_early``), without x's hint, out transposed where they read the shared
    scores (8 heads a group or more) and in out's orientation where they compute their own
    (``ssd.walk_out_transposed``); from initial states, at one head a group, one block an SM or
    at dstate 64 they update early. With D too they update late (as before), out transposed
    reading the shared scores from no initial states; out alone with z stays in out's
    orientation."""
    final = replace(anchor_key(), chunk_size=64, states_returned=True, z_dtype=bf16)
    for key in (final, replace(final, ngroups=8), replace(final, ngroups=16),
                replace(final, ngroups=32), replace(final, dstate=100)):
        plan = ssd.make_plan(key)
        walk = plan.scan_out
        assert plan.walk_segments == 1 and walk.occupancy == 2
        assert not walk.update_early and walk.x_latency == 0
        assert walk.out_transposed == walk.shared_scores == (key.ngroups <= 8)
    for key in (replace(final, start_dtype=torch.float32), replace(final, ngroups=64),
                replace(final, batch=2, seqlen=8192), replace(final, dstate=64)):
        plan = ssd.make_plan(key)
        assert plan.walk_segments == 1 and plan.scan_out.update_early
        assert not plan.scan_out.out_transposed
    assert ssd.make_plan(replace(final, batch=2, seqlen=8192)).scan_out.occupancy is None
    assert ssd.make_plan(replace(final, dstate=64)).scan_out.occupancy == 2
    with_d = replace(final, has_d=True)
    for key in (with_d, replace(with_d, d_per_channel=True), replace(with_d, ngroups=8),
                replace(with_d, start_dtype=torch.float32), replace(with_d, ngroups=16),
                replace(final, states_returned=False)):
        walk = ssd.make_plan(key).scan_out
        assert walk.occupancy == 2 and not walk.update_early
        assert walk.out_transposed == (key.states_returned and key.start_dtype is None
                                       and walk.shared_scores)
        assert walk.shared_scores == (key.ngroups <= 8)


def test_the_walk_hints_xs_load_latency_where_the_h200_ran_it_faster():
    """bf16 walks of out at dstate 128 that run one block an SM, or update early paired without
    D, take x's load latency hint WALK_X_LATENCY (``ssd.walk_x_latency``); paired out alone,
    paired with D (unsplit with final states, split), other dstates, fp16 and the states-only
    walk of a split call leave it to the compiler (0)."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    hinted = ssd.WALK_X_LATENCY
    assert hinted > 0
    assert ssd.make_plan(fused).scan_out.x_latency == 0
    assert ssd.make_plan(replace(fused, states_returned=True)).scan_out.x_latency == hinted
    for key in (replace(fused, states_returned=True, has_d=True),
                replace(fused, states_returned=True, has_d=True, d_per_channel=True),
                replace(fused, batch=1, seqlen=65536, nheads=96, states_returned=True,
                        has_d=True),
                replace(fused, batch=1, seqlen=65536, has_d=True)):
        walk = ssd.make_plan(key).scan_out
        assert (walk.occupancy, walk.update_early, walk.x_latency) == (2, True, 0), key
    alone = replace(fused, batch=4, seqlen=8192, nheads=32, ngroups=8)
    assert ssd.make_plan(alone).scan_out.occupancy is None
    assert ssd.make_plan(alone).scan_out.x_latency == hinted
    assert ssd.make_plan(replace(alone, has_d=True)).scan_out.x_latency == hinted
    for dstate in (64, 256):
        assert ssd.make_plan(replace(alone, dstate=dstate)).scan_out.x_latency == 0
    fp16 = dict(x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    assert ssd.make_plan(replace(alone, **fp16)).scan_out.x_latency == 0
    split = ssd.make_plan(replace(fused, batch=1, seqlen=65536, nheads=32))
    assert (split.scan_out.x_latency, split.segment_states.x_latency) == (hinted, 0)


def test_the_split_walk_one_block_an_sm_hints_bs_load_latency_where_the_h200_ran_it_faster():
    """bf16 walks of out split into segments one block an SM at dstate 128 and 256 take B's load
    latency hint WALK_B_LATENCY (``ssd.walk_b_latency``), out alone or with final states, and so
    does out alone's walk in four segments paired (``ssd.walks_four_paired``); other split walks
    paired, split at dstate 64, unsplit, and the states-only walk leave it to the compiler
    (0)."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    hinted = ssd.WALK_B_LATENCY
    assert hinted > 0
    third = replace(fused, batch=1, seqlen=65536)
    for key in (third, replace(third, states_returned=True), replace(third, dstate=256)):
        plan = ssd.make_plan(key)
        assert (plan.scan_out.segmented, plan.scan_out.occupancy) == (True, None)
        assert (plan.scan_out.b_latency, plan.segment_states.b_latency) == (hinted, 0)
    four = ssd.make_plan(replace(third, has_d=True)).scan_out           # four paired, with D
    assert (four.segmented, four.occupancy, four.b_latency) == (True, 2, hinted)
    paired = ssd.make_plan(replace(third, seqlen=131072, nheads=32)).scan_out
    assert (paired.segmented, paired.occupancy, paired.b_latency) == (True, 2, 0)
    small = ssd.make_plan(replace(third, dstate=64)).scan_out
    assert (small.segmented, small.occupancy, small.b_latency) == (True, None, 0)
    alone = ssd.make_plan(replace(fused, batch=4, seqlen=8192, nheads=32, ngroups=8)).scan_out
    assert (alone.segmented, alone.occupancy, alone.b_latency) == (False, None, 0)
    assert ssd.make_plan(fused).scan_out.b_latency == 0


def test_the_paired_walk_out_alone_computes_out_transposed_where_the_h200_ran_it_faster():
    """bf16 walks of out two blocks an SM that update the state last compute out transposed
    (``ssd.walk_out_transposed``) reading the shared scores with D or without, or computing their
    own at dstate 128 with z or without; with final states (the early update), z and the shared
    scores, D and their own, their own at dstate 64, one block an SM, split, fp16 at dstate 64
    and the states-only walk keep out's orientation."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    plan = ssd.make_plan(fused)
    assert (plan.scan_out.occupancy, plan.scan_out.shared_scores) == (2, True)
    assert plan.scan_out.out_transposed
    four_a_group = replace(fused, ngroups=16)
    for changes, transposed in (({}, True), (dict(z_dtype=bf16), True),
                                (dict(has_d=True), False)):
        walk = ssd.make_plan(replace(four_a_group, **changes)).scan_out
        assert (walk.occupancy, walk.shared_scores, walk.out_transposed) == (2, False,
                                                                            transposed), changes
    assert ssd.make_plan(replace(fused, batch=8, seqlen=1024, nheads=64,
                                 ngroups=8)).scan_out.out_transposed
    assert ssd.make_plan(replace(fused, has_d=True)).scan_out.out_transposed
    for other in (dict(states_returned=True), dict(z_dtype=bf16),
                  dict(has_d=True, z_dtype=bf16),
                  dict(dstate=64), dict(batch=4, seqlen=8192, nheads=32, ngroups=8),
                  dict(dstate=64, x_dtype=torch.float16, b_dtype=torch.float16,
                       c_dtype=torch.float16)):
        walk = ssd.make_plan(replace(fused, **other)).scan_out
        assert walk is not None and not walk.out_transposed, other
    split = ssd.make_plan(replace(fused, batch=1, seqlen=131072, nheads=32))
    assert split.walk_segments > 1 and split.scan_out.occupancy == 2
    assert not split.scan_out.out_transposed and not split.segment_states.out_transposed


def test_the_walk_computes_its_own_scores_where_few_blocks_read_each_groups_tile():
    """Above dstate 64 the walk of out reads the shared scores unless at most
    WALK_OWN_SCORES_MAX_READERS of its blocks (heads per group x P blocks) read each group's
    tile (``ssd.walk_shares_scores``): out alone at dstate 128, unsplit, two blocks an SM (out
    transposed without D) or one without D and z, in bf16 and fp16."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    eight = replace(fused, ngroups=8)
    for changes, transposed in (({}, True), (dict(z_dtype=bf16), True),
                                (dict(has_d=True), False), (dict(has_d=True, z_dtype=bf16), False)):
        walk = ssd.make_plan(replace(eight, **changes)).scan_out
        assert (walk.occupancy, walk.shared_scores, walk.out_transposed) == (2, False,
                                                                            transposed), changes
    alone = replace(eight, batch=2, seqlen=16384)
    fp16 = dict(x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    for changes in ({}, fp16):
        walk = ssd.make_plan(replace(alone, **changes)).scan_out
        assert (walk.occupancy, walk.shared_scores, walk.out_transposed) == (None, False, False)
    for shared in (fused, replace(eight, ngroups=4), replace(eight, headdim=128),
                   replace(alone, has_d=True), replace(alone, z_dtype=bf16),
                   replace(eight, batch=1, seqlen=65536), replace(eight, dstate=256),
                   replace(eight, states_returned=True)):
        assert ssd.make_plan(shared).scan_out.shared_scores, shared


def test_fp16_walks_with_final_states_one_block_an_sm_hint_bs_load_latency_at_dstate_128():
    """fp16's walk ('2xfp16') returning final states (its update '3xfp16'), one block an SM at
    dstate 128, takes B's load latency hint WALK_B_LATENCY_FP16_STATES (``ssd.walk_b_latency``);
    out alone, dstate 256, and paired at dstate 64 and 128 (also updating in '3xfp16') leave it to
    the compiler (0), where the H200 ran it no faster."""
    fp16 = replace(anchor_key(), chunk_size=64, x_dtype=torch.float16, b_dtype=torch.float16,
                   c_dtype=torch.float16, states_returned=True)
    hinted = ssd.WALK_B_LATENCY_FP16_STATES
    assert hinted > 0
    two_rows = replace(fp16, batch=2)
    for key in (two_rows, replace(fp16, batch=4, seqlen=8192, nheads=32, ngroups=8)):
        walk = ssd.make_plan(key).scan_out
        assert (walk.precision, walk.state_precision, walk.occupancy) == ("2xfp16", "3xfp16", None)
        assert walk.b_latency == hinted
    for key, occupancy in ((replace(two_rows, states_returned=False), None),
                           (replace(two_rows, dstate=256), None), (replace(fp16, dstate=64), 2),
                           (fp16, 2)):
        walk = ssd.make_plan(key).scan_out
        assert (walk.occupancy, walk.b_latency) == (occupancy, 0)
    assert ssd.make_plan(replace(fp16, dstate=64)).scan_out.state_precision == "3xfp16"


def test_the_split_walks_states_only_walk_runs_backward_from_dstate_128_where_x_holds_decays():
    """The states-only walk of a split call runs its chunks last to first
    (``ssd.walks_states_backward``) at dstate 128 and 256, out alone or with final states, and
    forward at dstate 64, where the H200 ran it slower; never for fp16 x, whose range does not
    hold a part's decays. The walk of out is never backward."""
    third = replace(anchor_key(), chunk_size=64, states_returned=False, batch=1, seqlen=65536)
    for key, backward in ((third, True), (replace(third, states_returned=True), True),
                          (replace(third, dstate=256), True), (replace(third, dstate=64), False),
                          (replace(third, seqlen=131072, nheads=32), True)):
        plan = ssd.make_plan(key)
        assert plan.walk_segments > 1
        assert (plan.segment_states.backward, plan.scan_out.backward) == (backward, False)
    fp16 = dict(x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    assert not ssd.walks_states_backward(replace(third, **fp16), 128)
    assert ssd.walks_states_backward(third, ssd.WALK_BACKWARD_MIN_DSTATE)


def test_fp16_calls_walk_in_their_default_mode_paired_up_to_dstate_128_on_sm90():
    """fp16 x walks in '2xfp16' (``ssd.WALK_MODES``) at chunk 64 by default, its state update in
    the chunk states' mode ('2xfp16' out alone, '3xfp16' with final states). Its blocks run two
    to an SM where that takes fewer rounds at its paired cost (``ssd.walk_pairing``), and so also
    with both z and D there: up to dstate 64, and on compute capability 9.x up to 128, out
    transposed there alone (``ssd.walk_out_transposed``); one an SM above, which so keeps the
    scan and compute_out with both. One an SM, out alone at dstate 64, its state update runs in
    '3xfp16' (``ssd.WALK_STATE_UPDATE_MODES``: the H200 ran it faster so)."""
    key = replace(anchor_key(), x_dtype=torch.float16, b_dtype=torch.float16,
                  c_dtype=torch.float16)
    assert ssd.default_chunk_size(_meta_problem(key)) == 64
    alone = replace(key, chunk_size=64, states_returned=False)
    for capability, paired_up_to in ((80, 64), (90, 128), (100, 64)):
        plan = functools.partial(ssd.make_plan, capability=capability)
        for dstate in (16, 32, 48, 64, 128, 256):
            occupancy = 2 if dstate <= paired_up_to else None
            transposed = occupancy == 2 and dstate == 128
            walk = plan(replace(alone, dstate=dstate)).scan_out
            assert (walk.precision, walk.state_precision, walk.occupancy,
                    walk.out_transposed) == ("2xfp16", "2xfp16", occupancy, transposed), dstate
            returned = plan(replace(alone, dstate=dstate, states_returned=True)).scan_out
            assert (returned.state_precision, returned.occupancy, returned.out_transposed) == \
                ("3xfp16", occupancy, transposed), dstate
            both = plan(replace(alone, dstate=dstate, has_d=True, z_dtype=torch.float16))
            assert (both.scan_out is not None) == (occupancy == 2), dstate
            if occupancy == 2:
                assert both.scan_out.out_transposed == transposed, dstate
    both = replace(key, dstate=128, has_d=True, z_dtype=torch.float16)
    assert ssd.default_chunk_size(_meta_problem(both)) == 64
    two_rows = replace(alone, batch=2)
    for dstate, state_mode in ((32, "2xfp16"), (64, "3xfp16"), (128, "2xfp16")):
        walk = ssd.make_plan(replace(two_rows, dstate=dstate)).scan_out
        assert (walk.state_precision, walk.occupancy, walk.out_transposed) == \
            (state_mode, None, False), dstate
    assert ssd.make_plan(alone, precision="3xfp16").scan_out is None


def test_bf16_calls_opting_in_to_2xbf16_walk_paired_where_unsplit():
    """bf16 x in '2xbf16' (an opt-in, ``ssd_forward(precision="2xbf16")``) walks as 'input' does
    from SCAN_OUT_MIN_ROW_HEADS (row, head) pairs (``ssd.WALK_MODES``; on the H100 0.39-0.45x of
    chunk 256, which such calls took before), up to dstate 256, at chunk 64 by default there, its
    state update in '3xbf16' out alone and with final states (``ssd.state_precision``), two blocks
    an SM up to dstate 128 where that takes fewer rounds at its paired cost (``ssd.WALK_PAIRING``:
    at 512 blocks, not 384 nor 128, nor at dstate 256), and so with both z and D there; from initial
    states too, its scores then its own (``ssd.walk_shares_scores``: read shared, they raced there
    on the H100), there one block an SM with one of z and D at dstate 128
    (``ssd.WALK_ALONE_FROM_START_WITH_Z_OR_D``). With fewer pairs over long sequences it splits them
    as 'input' does, one block an SM, its segments never doubled to pair
    (``ssd.WALK_SPLIT_PAIRING``), each from its entering state with its own scores: the third
    anchor's 64 pairs in two, the first's end state in two parts; with final states in four where
    'input' walks four from two doubled (67 to 82 pairs, ``ssd.walks_four_unpaired``); where the
    segments leave it fewer than WALK_MIN_SPLIT_ROW_HEADS blocks (80 pairs out alone, unsplit; 40 in
    two; 83 with final states) and with both z and D one block an SM it keeps chunk 256; a mode
    walks only with the x dtype WALK_MODES names for it."""
    key = anchor_key()
    alone = replace(key, chunk_size=64, states_returned=False)
    assert ssd.default_chunk_size(_meta_problem(key), precision="2xbf16") == 64
    for dstate in (16, 32, 64, 128, 256):
        for returned in (False, True):
            for batch, paired in ((8, dstate <= 128), (6, False), (2, False)):
                walk = ssd.make_plan(replace(alone, batch=batch, dstate=dstate,
                                             states_returned=returned),
                                     precision="2xbf16").scan_out
                assert (walk.precision, walk.state_precision, walk.occupancy) == (
                    "2xbf16", "3xbf16", 2 if paired else None), (dstate, returned, batch)
    assert ssd.make_plan(replace(alone, has_d=True), precision="2xbf16").scan_out
    assert ssd.make_plan(alone, precision="2xbf16").scan_out.shared_scores
    both = replace(key, has_d=True, z_dtype=bf16)
    assert ssd.default_chunk_size(_meta_problem(both), precision="2xbf16") == 64
    walk = ssd.make_plan(replace(both, chunk_size=64), precision="2xbf16").scan_out
    assert (walk.precision, walk.occupancy, walk.has_d, walk.has_z) == ("2xbf16", 2, True, True)
    for dstate in (128, 256):
        started = replace(alone, dstate=dstate, start_dtype=torch.float32)
        walk = ssd.make_plan(started, precision="2xbf16").scan_out
        assert (walk.shared_scores, walk.occupancy) == (False, 2 if dstate == 128 else None)
        assert ssd.make_plan(started).scan_out.shared_scores, dstate
    for dstate, z, d, occupancy in ((128, bf16, False, None), (128, None, True, None),
                                    (128, bf16, True, 2), (64, bf16, False, 2)):
        started = replace(alone, dstate=dstate, start_dtype=torch.float32, z_dtype=z, has_d=d)
        walk = ssd.make_plan(started, precision="2xbf16").scan_out
        assert walk.occupancy == occupancy, (dstate, z, d)
        assert ssd.make_plan(replace(started, start_dtype=None),
                             precision="2xbf16").scan_out.occupancy == 2, (dstate, z, d)
    third = replace(alone, batch=1, seqlen=65536)
    plan = ssd.make_plan(third, precision="2xbf16")
    assert (plan.walk_segments, plan.segment_split, plan.scan_out.occupancy,
            plan.segment_states.occupancy, plan.scan_out.precision,
            plan.scan_out.shared_scores) == (2, 2, None, None, "2xbf16", False)
    assert ssd.make_plan(third).scan_out.shared_scores
    assert ssd.make_plan(third).walk_segments == 2 and ssd.make_plan(third).segment_split == 4
    for nheads, segments in ((96, 1), (48, 2), (32, 4), (16, 8), (8, 16)):
        for returned in (False, True):
            plan = ssd.make_plan(replace(third, nheads=nheads, states_returned=returned),
                                 precision="2xbf16")
            assert (plan.walk_segments, plan.scan_out.occupancy) == (segments, None), nheads
    plan = ssd.make_plan(replace(third, has_d=True), precision="2xbf16")
    assert (plan.walk_segments, plan.segment_split, plan.scan_out.occupancy) == (2, 2, None)
    for nheads, segments in ((66, 2), (67, 4), (82, 4), (83, None), (96, 1)):
        returning = replace(third, nheads=nheads, states_returned=True)
        plan = ssd.make_plan(returning, precision="2xbf16")
        assert (plan.scan_out and (plan.walk_segments, plan.scan_out.occupancy)) == (
            segments and (segments, None)), nheads
        problem = _meta_problem(replace(returning, chunk_size=256), return_final_states=True)
        assert ssd.default_chunk_size(problem, precision="2xbf16") == (
            64 if segments else 256), nheads
    for other in (replace(alone, batch=2, has_d=True, z_dtype=bf16), replace(third, nheads=80),
                  replace(third, nheads=40), replace(third, seqlen=8192)):
        assert ssd.make_plan(other, precision="2xbf16").scan_out is None, other
        problem = _meta_problem(replace(other, chunk_size=256))
        assert ssd.default_chunk_size(problem, precision="2xbf16") == 256, other
    assert ssd.make_plan(replace(alone, start_dtype=torch.float32)).scan_out is not None
    assert ssd.default_chunk_size(_meta_problem(replace(key, batch=1, seqlen=65536))) == 64
    fp16 = replace(alone, x_dtype=torch.float16, b_dtype=torch.float16, c_dtype=torch.float16)
    assert ssd.make_plan(fp16, precision="3xbf16").scan_out is None


def test_float32_calls_walk_up_to_dstate_64_in_their_default_mode():
    """float32 x walks in '3xbf16' (``ssd.WALK_MODES``), out alone and with final states, up to
    dstate 64 (``ssd.WALK_MAX_DSTATE``: at 128 the H200 ran it 1.23-1.85x slower than chunk
    256), with 8 worker warps at dstate 64, one block an SM, and the compiler's below, two to an
    SM where that takes fewer rounds at its paired cost (``ssd.WALK_PAIRING``), and so with both
    z and D there; at chunk 64 by default there, at chunk 256 at dstate 128; not in another
    mode."""
    f32 = dict(x_dtype=torch.float32, b_dtype=torch.float32, c_dtype=torch.float32)
    key = replace(anchor_key(), dstate=64, **f32)
    assert ssd.default_chunk_size(_meta_problem(key)) == 64
    assert ssd.default_chunk_size(_meta_problem(replace(key, dstate=128))) == 256
    for returned in (False, True):
        walk = ssd.make_plan(replace(key, chunk_size=64, states_returned=returned)).scan_out
        assert (walk.precision, walk.state_precision, walk.occupancy, walk.worker_warps) == \
            ("3xbf16", "3xbf16", None, 8)
    alone = replace(key, chunk_size=64, states_returned=False)
    for dstate in (16, 32):
        walk = ssd.make_plan(replace(alone, dstate=dstate)).scan_out
        assert (walk.worker_warps, walk.occupancy) == (None, 2), dstate
        both = replace(alone, dstate=dstate, has_d=True, z_dtype=torch.float32)
        assert ssd.make_plan(both).scan_out.occupancy == 2, dstate
        assert ssd.make_plan(replace(both, batch=2)).scan_out is None, dstate
    assert ssd.make_plan(replace(alone, dstate=128)).scan_out is None
    assert ssd.make_plan(alone, precision="3xtf32").scan_out is None
    assert ssd.make_plan(replace(alone, has_d=True, z_dtype=torch.float32)).scan_out is None


def test_from_sm100_float32_calls_walk_up_to_dstate_32(monkeypatch):
    """On a GPU of compute capability 10.0 or more float32 x walks up to dstate 32
    (``ssd.walk_max_dstate``: tileiras 13.4 fails to compile its walk at 64 for sm_100), so a
    dstate-64 call takes chunk 256 by default there; the 16-bit walks keep their reach."""
    f32 = dict(x_dtype=torch.float32, b_dtype=torch.float32, c_dtype=torch.float32)
    alone = replace(anchor_key(), chunk_size=64, dstate=64, states_returned=False, **f32)
    assert ssd.make_plan(alone, capability=90).scan_out is not None
    assert ssd.make_plan(alone, capability=100).scan_out is None
    assert ssd.make_plan(replace(alone, dstate=32), capability=100).scan_out is not None
    for dtype in (torch.bfloat16, torch.float16):
        sixteen = replace(alone, x_dtype=dtype, b_dtype=dtype, c_dtype=dtype, dstate=256)
        assert ssd.make_plan(sixteen, capability=100).scan_out is not None, dtype
    problem = _meta_problem(alone)
    assert ssd.default_chunk_size(problem) == 64
    monkeypatch.setattr(ssd, "compute_capability", lambda device: 100)
    assert ssd.default_chunk_size(problem) == 256


@pytest.mark.parametrize("blocks, occupancy", [(128, None), (192, 2), (256, 2), (384, None),
                                               (512, 2), (1024, 2)])
def test_the_walk_pairs_its_blocks_where_the_h200_ran_them_faster_paired(blocks, occupancy):
    """The block counts of the H200 A/B (132 SMs; experiments/ab_scan_out_occupancy_*): two
    blocks to an SM won at 192, 256, 512 and 1024 blocks, lost at 128 and 384."""
    assert ssd.scan_out_occupancy(blocks, ssd.REFERENCE_SM_COUNT) == occupancy


@pytest.mark.parametrize("mode, dstate, capability, paired_at_384", [
    ("input", 128, 90, False), ("2xfp16", 64, 80, True), ("2xfp16", 128, 90, True),
    ("3xbf16", 32, 90, False)])
def test_each_mode_pairs_its_walk_at_its_own_cost(mode, dstate, capability, paired_at_384):
    """``ssd.walk_pairing``: at 384 blocks (6 rows of 64 heads: three rounds alone on 132 SMs,
    two paired) the fp16 walk pairs (the H200 ran it 0.85x so at dstate 64, 0.92x at 128 on
    sm_90), bf16's and float32's keep one block an SM; all three pair at 512 and at 256, none at
    128 or above their dstate."""
    dtype = {"input": torch.bfloat16, "2xfp16": torch.float16, "3xbf16": torch.float32}[mode]
    key = replace(anchor_key(), dstate=dstate, x_dtype=dtype, b_dtype=dtype, c_dtype=dtype,
                  chunk_size=64, states_returned=False)
    for batch, paired in ((2, False), (4, True), (6, paired_at_384), (8, True)):
        assert ssd.walk_occupancy(replace(key, batch=batch), mode, 132, capability) == \
            (2 if paired else None), batch
    assert ssd.walk_occupancy(replace(key, dstate=2 * dstate), mode, 132, capability) is None


def test_the_walk_pairing_follows_the_gpus_sm_count():
    """The plan takes the SMs of the call's GPU: the first anchor's 512 blocks run in one round
    alone on 512 SMs, and in two paired rounds against four alone on 132 (the default off a GPU)."""
    fused = replace(anchor_key(), chunk_size=64, states_returned=False)
    assert ssd.make_plan(fused, sms=512).scan_out.occupancy is None
    assert ssd.make_plan(fused, sms=132) == ssd.make_plan(fused)


@pytest.mark.parametrize("batch, nheads, ngroups, n_block", [(8, 64, 1, 128), (4, 32, 8, 64),
                                                             (1, 64, 1, 64)])
def test_an_explicit_chunk_128_fuses_one_chunk_a_step_at_its_table_tiles(batch, nheads, ngroups,
                                                                         n_block):
    """chunk_size=128 keeps the fused scan, one chunk a step, at the chunk-128 table's tiles
    (64 x 128 where 64 heads share their scores, 64 x 64 where 32 heads in 8 groups do not)."""
    fused = replace(anchor_key(), batch=batch, nheads=nheads, ngroups=ngroups, chunk_size=128,
                    states_returned=False)
    plan = ssd.make_plan(fused)
    assert (plan.state_scan.p_block, plan.state_scan.n_block) == (64, n_block)
    assert (plan.state_scan.chunk_size, plan.state_scan.chunks_per_step) == (128, 1)
    entry = ssd.TUNED[json.dumps(ssd.tuning_key(fused, DEFAULT), sort_keys=True)]
    assert {k: getattr(plan.out, k) for k in entry["compute_out"]} == entry["compute_out"]


def test_the_state_scan_halves_its_state_columns_until_enough_blocks_walk():
    """From the start tiles, the state columns halve (not below 64) while fewer than 128 blocks
    would walk and twice as many fit one round on the SMs (132 by default): 64 and 66 pairs walk
    64 x 64 tiles, 67 to 127 keep 64 x 128 (but on 256 SMs); headdim 128's two P blocks keep 128
    columns."""
    assert ssd.state_scan_tiles(512, 64, 128, (64, 128)) == (64, 128)
    assert ssd.state_scan_tiles(128, 64, 128, (64, 128)) == (64, 128)
    assert ssd.state_scan_tiles(64, 64, 128, (64, 128)) == (64, 64)
    assert ssd.state_scan_tiles(66, 64, 128, (64, 128)) == (64, 64)
    assert ssd.state_scan_tiles(67, 64, 128, (64, 128)) == (64, 128)
    assert ssd.state_scan_tiles(88, 64, 128, (64, 128)) == (64, 128)
    assert ssd.state_scan_tiles(88, 64, 128, (64, 128), sms=256) == (64, 64)
    assert ssd.state_scan_tiles(64, 64, 256, (64, 256)) == (64, 128)
    assert ssd.state_scan_tiles(64, 128, 128, (64, 128)) == (64, 128)
    assert ssd.state_scan_tiles(64, 64, 64, (64, 64)) == (64, 64)
    assert ssd.state_scan_tiles(64, 64, 32, (64, 128)) == (64, 32)     # dstate 32: its pad
    # The tuner searches only the tiles a shape keeps.
    anchor2 = (1, 65536, 64, 64, 128, 1, "bfloat16")
    assert [(c["p_block"], c["n_block"]) for c in tune.CANDIDATES["state_scan"]
            if tune.fits(c, anchor2, 128, "state_scan")] == [(64, 64), (32, 128), (32, 64),
                                                             (64, 32)]


@pytest.mark.parametrize("capability, b_dtype, chunk_size, n_block", [
    (100, torch.float32, 128, 64),      # sm_100's limit (ssd.STATE_SCAN_SM100_FLOAT32_B_N_BLOCK)
    (90, torch.float32, 128, 128), (100, torch.bfloat16, 128, 128), (100, torch.float32, 64, 128),
])
def test_the_state_scan_keeps_a_float32_b_within_sm100s_shared_memory(capability, b_dtype,
                                                                       chunk_size, n_block):
    """On 10.x a float32 B at chunk 128 takes 64 state columns a block: 64 x 128 tiles past 2^31
    elements took more shared memory than a block may use there (the constant's comment)."""
    bf16 = torch.bfloat16
    key = ssd.ProblemKey(batch=391, seqlen=3300, nheads=104, headdim=128, dstate=256,
                         ngroups=26, chunk_size=chunk_size, x_dtype=bf16, b_dtype=b_dtype,
                         c_dtype=torch.float32, states_returned=False)
    scan = ssd.make_plan(key, capability=capability).state_scan
    assert (scan.p_block, scan.n_block) == (64, n_block)


def test_a_fused_key_without_a_chunk_128_entry_borrows_chunk_256s_compute_out_tiles():
    """headdim 128 has no chunk-128 entry: compute_out takes its chunk-256 tiles, the scan its
    default start tiles."""
    key = replace(anchor_key(), headdim=128, chunk_size=128, states_returned=False)
    assert json.dumps(ssd.tuning_key(key, DEFAULT), sort_keys=True) not in ssd.TUNED
    plan = ssd.make_plan(key)
    at_256 = ssd.make_plan(replace(key, chunk_size=256)).out
    assert (plan.out.occupancy, plan.out.persistent, plan.out.p_block) == (
        at_256.occupancy, at_256.persistent, at_256.p_block)
    assert (plan.state_scan.p_block, plan.state_scan.n_block) == ssd.STATE_SCAN_TILES


def test_a_fused_record_makes_an_entry_of_the_scan_and_compute_out(tmp_path, monkeypatch):
    """A tune.json record of a fused key (no chunk_state or state passing searched) becomes an
    entry with state_scan and compute_out tiles, and the dispatcher takes them (here from the
    tuning cache)."""
    best = {"state_scan": dict(p_block=32, n_block=128, ms=1.0),
            "compute_out": dict(row_block=64, p_block=64, occupancy=4, ms=1.0)}
    fused = replace(anchor_key(), chunk_size=128, states_returned=False)
    record = dict(shape=anchor_shape(8), chunk_size=128, key=ssd.tuning_key(fused, DEFAULT),
                  best=best, default_ms=3.0, tuned_ms=2.0,
                  dispatcher={"state_scan": dict(p_block=64, n_block=128)})
    document = tune.table([record], dict(device="NVIDIA H200"), "python3 -m kernels.tune")
    (entry,) = document["entries"]
    assert set(entry) == {"key", "state_scan", "compute_out", "measured"}
    assert entry["state_scan"] == dict(p_block=32, n_block=128)
    assert not entry["measured"][0].get("dispatcher_kept")
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(ssd.TUNING_CACHE_ENV, str(path))
    monkeypatch.setattr(ssd, "current_device", lambda: "NVIDIA H200")
    tune.write_cache(document, str(path))
    plan = ssd.make_plan(fused)
    assert (plan.state_scan.p_block, plan.state_scan.n_block, plan.out.occupancy) == (32, 128, 4)


@pytest.mark.parametrize("change", ["long_single_row", "final_states", "seq_idx", "fp32",
                                    "chunk_256"])
def test_the_two_state_kernels_keep_what_the_scan_does_not_take(change):
    """Fewer than 64 (row, head) pairs where the walk does not take them (too short to split),
    returned states (float32-grade sums) where it does not (64 pairs too short to split), packed
    sequences with varlen states, float32 x, or an explicit chunk 256: chunk_state and the state
    passing."""
    key = anchor_key()
    problem_changes = {}
    if change == "long_single_row":
        key = replace(key, batch=1, seqlen=8192, nheads=32)
    elif change == "final_states":
        key = replace(key, batch=1, seqlen=1024)
        problem_changes = dict(return_final_states=True)
    elif change == "seq_idx":
        key = replace(key, batch=1, seq_dtype=torch.int32, cu_dtype=torch.int32, nseq=2,
                      varlen=True)
        problem_changes = dict(return_varlen_states=True)
    elif change == "fp32":
        key = replace(key, x_dtype=torch.float32, b_dtype=torch.float32, c_dtype=torch.float32)
    if change != "chunk_256":
        assert ssd.default_chunk_size(_meta_problem(key, **problem_changes)) == 256
    states_returned = change == "final_states"
    for chunk_size in ((64, 128) if change != "chunk_256" else (256,)):
        plan = ssd.make_plan(replace(key, chunk_size=chunk_size, states_returned=states_returned))
        assert plan.state_scan is None
        assert "chunk_state" in dict(plan.named_configs())


def test_chunk_states_are_stored_in_the_dtype_compute_out_rounds_them_to():
    """'input' rounds the entering states to x's 16-bit dtype in compute_out's matmul: stored so
    by default; every other mode stores float32, and a given state_dtype always wins."""
    f16, f32 = torch.float16, torch.float32
    assert ssd.resolve_state_dtype(None, "input", bf16) == bf16
    assert ssd.resolve_state_dtype(None, "input", f16) == f16
    for mode, x_dtype in (("tf32", bf16), ("3xbf16", bf16), ("3xtf32", f16), ("3xbf16", f32)):
        assert ssd.resolve_state_dtype(None, mode, x_dtype) == f32
    assert ssd.resolve_state_dtype(f32, "input", bf16) == f32
    plan = ssd.make_plan(anchor_key())
    assert DEFAULT == "input" and plan.state_passing.state_dtype == plan.out.state_dtype == bf16
    plan = ssd.make_plan(anchor_key(), precision="tf32")
    assert plan.state_passing.state_dtype == plan.out.state_dtype == f32
    assert ssd.make_plan(anchor_key(), torch.float32).out.state_dtype == f32


def test_a_probe_of_another_mode_stores_the_chunk_states_as_that_mode_does():
    """compute_out probed in a float32-storage mode from an 'input' search reads float32 states
    (5b56790..79bdf52's probes read the searched mode's bf16 ones)."""
    plan = ssd.make_plan(anchor_key())
    probe = tune.with_candidate(plan, "compute_out", dict(row_block=128), "2xbf16")
    assert probe.out.precision == "2xbf16" and probe.out.row_block == 128
    assert probe.out.state_dtype == probe.state_passing.state_dtype == torch.float32
    same = tune.with_candidate(plan, "compute_out", dict(row_block=128))
    assert same.out.state_dtype == same.state_passing.state_dtype == bf16
    states_probe = tune.with_candidate(plan, "chunk_state", {}, "3xtf32")
    assert states_probe.state_passing.state_dtype == bf16


def test_a_key_without_an_entry_keeps_the_heuristics(monkeypatch):
    tuned = ssd.make_plan(anchor_key())
    monkeypatch.setattr(ssd, "TUNED", {})
    untuned = ssd.make_plan(anchor_key())
    assert untuned.out.occupancy is None and untuned.chunk_state.occupancy is None
    assert (untuned.chunk_state.p_block, untuned.chunk_state.n_block) == (ssd.P_BLOCK,
                                                                          ssd.STATE_N_BLOCK)
    assert untuned != tuned
    # The key includes the precision mode and the dtype: 'input' or fp16 x is another entry.
    monkeypatch.setattr(ssd, "TUNED", {json.dumps(ssd.tuning_key(anchor_key(), DEFAULT),
                                                  sort_keys=True): {"compute_out": {"occupancy": 3}}})
    assert ssd.make_plan(anchor_key()).out.occupancy == 3
    other = "tf32" if DEFAULT != "tf32" else "input"
    assert ssd.make_plan(anchor_key(), precision=other).out.occupancy is None
    fp16 = replace(anchor_key(), x_dtype=torch.float16, b_dtype=torch.float16,
                   c_dtype=torch.float16)
    assert ssd.make_plan(fp16).out.occupancy is None


def test_table_takes_the_first_shape_of_a_key_and_lists_all(tmp_path, monkeypatch):
    def record(batch, chunk_state_occupancy, tuned_ms):
        best = {"chunk_state": dict(row_block=64, p_block=32, n_block=128,
                                    occupancy=chunk_state_occupancy, ms=1.0),
                "state_passing": dict(p_block=32, n_block=64, occupancy=4, ms=1.0),
                "compute_out": dict(row_block=64, p_block=64, occupancy=2, ms=1.0)}
        return dict(shape=anchor_shape(batch), key=ssd.tuning_key(anchor_key(), DEFAULT),
                    best=best, default_ms=3.0, tuned_ms=tuned_ms)

    probed = record(8, 2, 2.0)
    other = "tf32" if DEFAULT != "tf32" else "input"
    probed["precision_probes"] = {"compute_out": [
        dict(row_block=64, p_block=64, occupancy=4, transposed=True, precision=other, ms=0.9),
        dict(row_block=128, p_block=64, occupancy=2, precision=other, ms=0.8),
        dict(row_block=64, p_block=32, occupancy=4, precision="2xbf16", ms=None, error="x")]}
    saved = dict(provenance=dict(command="kernels/tune.py --out X", git_commit="abc"),
                 records=[probed, record(1, 4, 1.5)])
    source = tmp_path / "tune.json"
    source.write_text(json.dumps(saved))
    monkeypatch.setattr(tune, "TABLE_PATH", str(tmp_path / "tuned.json"))
    assert tune.main(["--table-from", str(source)]) == 0
    written = json.loads((tmp_path / "tuned.json").read_text())
    entry, probe_entry = written["entries"]     # a mode whose probes all failed has none
    assert probe_entry["key"] == ssd.tuning_key(anchor_key(), other)
    assert probe_entry["compute_out"] == dict(row_block=128, p_block=64, occupancy=2)
    assert probe_entry["chunk_state"] == entry["chunk_state"]
    assert probe_entry["measured"][0]["compute_out_ms"] == 0.8
    assert entry["chunk_state"]["occupancy"] == 2 and "ms" not in entry["chunk_state"]
    assert [m["shape"]["batch"] for m in entry["measured"]] == [8, 1]
    assert written["provenance"]["git_commit"] == "abc"
    assert written["tuned_by"] == "kernels/tune.py --out X"
    loaded = ssd.load_tuning_entries(str(tmp_path / "tuned.json"))
    assert [e["key"] for e in loaded] == [ssd.tuning_key(anchor_key(), m) for m in (DEFAULT, other)]


def test_later_runs_replace_the_stages_they_searched(tmp_path, monkeypatch):
    """--table-from, repeated: a run that searched chunk_state alone replaces the chunk_state
    tiles of every entry its keys reach, and leaves the earlier run's compute_out winners (its
    own compute_out rows are the dispatcher's choice, not a search)."""
    def run(command, searched, chunk_p_block, out_p_block, probe_row_block):
        stages = {"chunk_state": [dict(row_block=64, p_block=chunk_p_block, n_block=128,
                                       occupancy=2, transposed=False, ordered_loads=True,
                                       ms=0.5)],
                  "compute_out": [dict(row_block=64, p_block=out_p_block, occupancy=4,
                                       transposed=True, ordered_loads=True, ms=0.6)]}
        record = dict(shape=anchor_shape(8), key=ssd.tuning_key(anchor_key(), DEFAULT),
                      stages={s: stages[s] for s in searched},
                      best={"chunk_state": stages["chunk_state"][0],
                            "state_passing": dict(p_block=32, n_block=64, occupancy=4, ms=0.1),
                            "compute_out": stages["compute_out"][0]},
                      precision_probes={"compute_out": [
                          dict(row_block=probe_row_block, p_block=out_p_block, occupancy=4,
                               precision="tf32" if DEFAULT != "tf32" else "input", ms=1.0)]},
                      default_ms=2.0, tuned_ms=1.0)
        path = tmp_path / f"{command}.json"
        path.write_text(json.dumps(dict(provenance=dict(command=command), records=[record])))
        return str(path)

    first = run("first", ("chunk_state", "compute_out"), 32, 32, 128)
    second = run("second", ("chunk_state",), 64, 64, 64)
    monkeypatch.setattr(tune, "TABLE_PATH", str(tmp_path / "tuned.json"))
    assert tune.main(["--table-from", first, "--table-from", second]) == 0
    _check_merged(json.loads((tmp_path / "tuned.json").read_text()))
    # The same runs kept gzipped give the same entries.
    zipped = tmp_path / "first.json.gz"
    zipped.write_bytes(gzip.compress(Path(first).read_bytes()))
    assert tune.main(["--table-from", str(zipped), "--table-from", second]) == 0
    _check_merged(json.loads((tmp_path / "tuned.json").read_text()))

    # A third run that searched compute_out in the probed mode, then a fourth that only probed
    # it again: the search's tiles stay.
    other = "tf32" if DEFAULT != "tf32" else "input"
    third = json.loads(Path(first).read_text())
    third["records"][0]["key"] = ssd.tuning_key(anchor_key(), other)
    third["records"][0]["precision_probes"] = {}
    third["records"][0]["stages"]["compute_out"][0]["p_block"] = 16
    (tmp_path / "third.json").write_text(json.dumps(third))
    fourth = run("fourth", ("chunk_state", "compute_out"), 64, 32, 64)
    assert tune.main(["--table-from", first, "--table-from", str(tmp_path / "third.json"),
                      "--table-from", fourth]) == 0
    written = json.loads((tmp_path / "tuned.json").read_text())
    (probed,) = [e for e in written["entries"] if e["key"]["precision"] == other]
    assert probed["compute_out"]["p_block"] == 16


def _check_merged(written: dict) -> None:
    assert len(written["entries"]) == 2
    for entry in written["entries"]:
        assert entry["chunk_state"]["p_block"] == 64
        assert len(entry["measured"]) == 2
    searched, probed = written["entries"]
    assert searched["compute_out"]["p_block"] == 32
    assert probed["compute_out"]["row_block"] == 128
    assert written["tuned_by"] == "second"
    assert [s["tuned_by"] for s in written["sources"]] == ["first", "second"]


def test_a_probe_times_the_modes_table_tiles_beside_the_searchs_fastest():
    """A probe replaces its mode's entry, so it times that entry's tiles in the same run: the
    four fastest distinct codes of the search, then the mode's tiles in the table unless among
    them."""
    def row(p_block, ms, **kw):
        return dict(row_block=64, p_block=p_block, occupancy=3, ms=ms, **kw)
    rows = [row(8, 0.5), row(16, 0.4), row(16, 0.4, same_code_as=1), row(32, 0.3),
            row(64, 0.2), row(128, 0.1), dict(row_block=64, p_block=256, occupancy=3, error="x")]
    tabled = dict(row_block=128, p_block=64, occupancy=2)
    probed = tune.probe_candidates("compute_out", rows, rows[5], tabled)
    assert [c.get("p_block") for c in probed] == [128, 64, 32, 16, 64]
    assert probed[-1] == tabled and all("ms" not in c for c in probed)
    assert tune.probe_candidates("compute_out", rows, rows[5], probed[1]) == probed[:4]
    # A stage the run did not search is probed at its dispatched tiles and the table's.
    assert tune.probe_candidates("compute_out", [], row(64, 0.2), tabled) == [
        dict(row_block=64, p_block=64, occupancy=3), tabled]


def test_a_run_at_another_chunk_size_keys_its_winners_there():
    record = dict(shape=anchor_shape(8), chunk_size=128)
    assert tune.record_key(record, DEFAULT)["chunk_size"] == 128
    assert tune.record_key(dict(shape=anchor_shape(8)), DEFAULT)["chunk_size"] == 256   # older runs


def test_candidates_with_the_same_code_are_timed_once():
    """Twins point at the first candidate with their code; an unknown code is nobody's twin."""
    assert tune.same_code_as(["a", "b", "a", None, None, "b", "c"]) == [0, 1, 0, 3, 4, 1, 6]
    # At the first anchor, compute_out read in order or transposed after loading compiles to one
    # code in each orientation: untransposed the order only reaches transposed operands, and
    # transposed (two codes until 9951847) the D skip now reads the diagonal block's x_j^T.
    from kernels.variants import _anchor
    key = _anchor(8, 4096, 64, 1, has_d=True)
    plan = ssd.make_plan(key)
    codes = [tune._code_task((key, tune.with_candidate(plan, "compute_out", dict(
        transposed=transposed, ordered_loads=ordered)), "compute_out", "sm_90"))[0]
        for transposed in (False, True) for ordered in (False, True)]
    assert None not in codes and tune.same_code_as(codes) == [0, 0, 2, 2]
    assert tune._code_task((key, plan, "no such stage", "sm_90")) == (
        None, "KeyError: 'no such stage'")


def test_search_compiles_and_times_each_code_once(monkeypatch):
    """The search (GPU parts stubbed): twins are neither compiled nor timed, take their first's
    time and name it; the best is a first."""
    from types import SimpleNamespace
    from kernels.variants import _anchor, launch_problem
    key = _anchor(8, 4096, 64, 1, has_d=True)
    cands = [dict(row_block=64, transposed=t, ordered_loads=o, latency=h)
             for t in (False, True) for o in (False, True) for h in (0, 2)]
    codes = {(False, 0): "u", (False, 2): "u2", (True, 0): "t", (True, 2): "t"}
    compiled, timed = [], []
    monkeypatch.setitem(tune.CANDIDATES, "compute_out", cands)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(tune, "_pipeline", lambda inputs, chunk_size, plan=None: SimpleNamespace(
        problem=launch_problem(key), plan=plan))
    monkeypatch.setattr(tune, "_code_task", lambda args: (codes[
        args[1].out.transposed, args[1].out.latency], None) if args[1].out.ordered_loads or
        not args[1].out.transposed else (None, "unknown here"))
    monkeypatch.setattr(tune, "_compile_task", lambda args: compiled.append(args))
    monkeypatch.setattr(tune, "_stage_call", lambda pipeline, *a: pipeline.plan.out)
    monkeypatch.setattr(tune, "time_ms",
                        lambda out, reps: timed.append(out) or 1.0 - 0.1 * len(timed))
    shape = (8, 4096, 64, 64, 128, 1, "bfloat16")
    rows, best = tune._search(shape, 256, "compute_out", SimpleNamespace(map=map), None,
                              ssd.make_plan(key), None, None, None)
    # Untransposed: ordered or not, one code per latency. Transposed: unknown unless ordered,
    # then one code for both latencies.
    assert [r.get("same_code_as") for r in rows] == [None, None, 0, 1, None, None, None, 6]
    assert [r.get("code_unknown") for r in rows] == [None] * 4 + ["unknown here"] * 2 + [None] * 2
    assert len(compiled) == len(timed) == 5
    assert [round(r["ms"], 6) for r in rows] == [0.9, 0.8, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5]
    assert best is rows[6]
    # What tune_shape carries on to the next stage's search: the knobs, not the annotations.
    rows[6]["code_unknown"] = "annotated"
    carried = tune.with_candidate(ssd.make_plan(key), "compute_out",
                                  tune._tiles("compute_out", rows[6])).out
    assert (carried.transposed, carried.ordered_loads, carried.latency) == (True, True, 0)
    # The compile workers build the kind of call the search times (out alone or not).
    assert {task[5] for task in compiled} == {False}
    tune._search(shape, 256, "compute_out", SimpleNamespace(map=map), None, ssd.make_plan(key),
                 None, None, None, out_alone=True)
    assert {task[5] for task in compiled[5:]} == {True}


def test_tuner_candidates_respect_the_problem_sizes():
    small = (1, 512, 4, 32, 16, 1, "bfloat16")
    assert tune.fits(dict(row_block=64, p_block=32, n_block=16), small, 256)
    assert not tune.fits(dict(row_block=64, p_block=64, n_block=16), small, 256)
    assert not tune.fits(dict(row_block=64, p_block=32, n_block=32), small, 256)
    assert not tune.fits(dict(row_block=512), small, 256)
    assert not tune.fits(dict(row_block=128, p_block=32, n_block=16), small, 64)


def test_tune_needs_an_output_folder_or_a_saved_run():
    with pytest.raises(SystemExit):
        tune.main([])


# ---- the per-user tuning cache (python3 -m kernels.tune --shape ... --cache) ------------------

def _tuned_document(occupancy: int, device: str = "NVIDIA H200") -> dict:
    best = {"chunk_state": dict(row_block=64, p_block=32, n_block=128, occupancy=occupancy, ms=1.0),
            "state_passing": dict(p_block=32, n_block=64, occupancy=4, ms=1.0),
            "compute_out": dict(row_block=64, p_block=32, occupancy=occupancy, ms=1.0)}
    record = dict(shape=anchor_shape(2), key=ssd.tuning_key(anchor_key(), DEFAULT), best=best,
                  default_ms=3.0, tuned_ms=2.0)
    return tune.table([record], dict(device=device, git_commit="abc"), "python3 -m kernels.tune")


def test_the_cache_merges_per_key_and_gpu_model_atomically(tmp_path):
    path = str(tmp_path / "sub" / "tuned.json")
    tune.write_cache(_tuned_document(1), path)
    tune.write_cache(_tuned_document(4, device="NVIDIA A100"), path)
    tune.write_cache(_tuned_document(2), path)          # replaces the H200 entry of that key
    entries = ssd.load_tuning_entries(path)
    assert sorted((e["device"], e["compute_out"]["occupancy"]) for e in entries) == [
        ("NVIDIA A100", 4), ("NVIDIA H200", 2)]
    assert all(e["provenance"]["git_commit"] == "abc" for e in entries)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["tuned.json"]   # no temporaries


def test_calls_prefer_the_cache_entry_of_their_gpu_model(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(ssd.TUNING_CACHE_ENV, str(path))
    tune.write_cache(_tuned_document(3, device="NVIDIA H200"), str(path))
    monkeypatch.setattr(ssd, "current_device", lambda: "NVIDIA H200")
    plan = ssd.make_plan(anchor_key())
    assert (plan.out.occupancy, plan.out.p_block, plan.chunk_state.occupancy) == (3, 32, 3)
    # Another GPU model, or no GPU at all (CI compiling variants): the repository's table.
    table = ssd.TUNED[json.dumps(ssd.tuning_key(anchor_key(), DEFAULT), sort_keys=True)]
    for device in ("NVIDIA A100", None):
        monkeypatch.setattr(ssd, "current_device", lambda d=device: d)
        assert ssd.make_plan(anchor_key()).out.occupancy == table["compute_out"]["occupancy"]


def test_plans_are_remembered_per_key_until_a_tuning_source_changes(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(ssd.TUNING_CACHE_ENV, str(path))
    monkeypatch.setattr(ssd, "current_device", lambda: "NVIDIA H200")
    first = ssd.make_plan(anchor_key())
    assert ssd.make_plan(anchor_key()) is first
    assert ssd.make_plan(replace(anchor_key(), batch=3)) is not first
    tune.write_cache(_tuned_document(3), str(path))       # the user's cache appears
    assert ssd.make_plan(anchor_key()).out.occupancy == 3
    monkeypatch.setattr(ssd, "TUNED", {})                  # another repository table
    monkeypatch.delenv(ssd.TUNING_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "none"))
    assert ssd.make_plan(anchor_key()).out.occupancy is None


def test_an_unreadable_cache_is_an_error_that_names_it(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text("{not json")
    monkeypatch.setenv(ssd.TUNING_CACHE_ENV, str(path))
    monkeypatch.setattr(ssd, "current_device", lambda: "NVIDIA H200")
    with pytest.raises(RuntimeError, match=f"tuning table {path}: expected the JSON"):
        ssd.make_plan(anchor_key())


def test_the_cache_lives_under_xdg_cache_home_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv(ssd.TUNING_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ssd.tuning_cache_path() == str(tmp_path / "mamba2-cutile" / "tuned.json")
    monkeypatch.setenv(ssd.TUNING_CACHE_ENV, "/elsewhere/t.json")
    assert ssd.tuning_cache_path() == "/elsewhere/t.json"


@pytest.mark.parametrize("text, expected", [
    ("2,2048,32,64,128,1", (2, 2048, 32, 64, 128, 1, "bfloat16")),
    ("1, 4096, 8, 128, 64, 2, float32", (1, 4096, 8, 128, 64, 2, "float32")),
])
def test_own_shapes_parse(text, expected):
    assert tune.parse_shape(text) == expected


@pytest.mark.parametrize("text", ["2,2048,32,64,128", "2,2048,30,64,128,4", "2,0,32,64,128,1",
                                  "2,2048,32,64,128,1,int8", "a,b,c,d,e,f"])
def test_bad_own_shapes_are_refused_with_the_expected_form(text, capsys):
    with pytest.raises(SystemExit):
        tune.main(["--out", "/tmp/unused", "--shape", text])
    assert "--shape: expected B,L,H,P,N,G[,dtype]" in capsys.readouterr().err


def test_a_call_seen_before_launches_its_plan_without_planning_again(monkeypatch):
    """ssd_forward remembers the chunk size and plan of a signed call (kernels.contract
    .call_signature); the same call again (other values) launches the same kernels on the same
    grids without stage_pipeline, and a call that differs in an option is planned anew. CPU
    tensors, launches recorded (kernels.variants.recorded_launches)."""
    from kernels.variants import recorded_launches
    from properties.problems import ProblemSpec, build_problem
    monkeypatch.setattr(ssd, "require_gpu", lambda x: None)
    monkeypatch.setattr(ssd, "_PREPARED", {})
    planned = []
    real = ssd.stage_pipeline
    monkeypatch.setattr(ssd, "stage_pipeline",
                        lambda *a, **k: (planned.append(a), real(*a, **k))[1])
    call = build_problem(ProblemSpec(batch=2, seqlen=300, nheads=4, headdim=16, dstate=32,
                                     ngroups=1, chunk_size=64, D="head")).call_kwargs()
    del call["chunk_size"]

    def launches(**changes):
        with recorded_launches() as launched:
            ssd.ssd_forward(**{**call, **changes})
        return [(grid, kernel) for grid, kernel, _ in launched]

    flipped = not call["return_final_states"]
    first = launches()
    assert launches(x=call["x"].clone(), dt=call["dt"] * 0.5) == first and len(planned) == 1
    assert launches(return_final_states=flipped) and len(planned) == 2
    assert launches(chunk_size=256) and len(planned) == 3
    assert launches(return_final_states=flipped) and len(planned) == 3
    assert launches() == first and len(planned) == 3
