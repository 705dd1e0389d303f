"""The error envelope end to end on the CPU: measure and write a report, check a baseline, catch a
broken kernel by name, and replay its failure artifact with the same numbers.

A handful of quick-grid cells (``--only``) keeps this to seconds; the whole quick grid runs in the
``slow`` test.
"""
from __future__ import annotations

import io
import json
import math
import re

import pytest

from properties import envelope, repro
from properties.cli import main as cli
from properties.provenance import REPO_ROOT

CELLS = ("mamba2_init/fp32/L100", "mamba2_init/fp32/L64", "mamba2_init/bf16/L100",
         "mamba2_init/bf16/L64", "strong_decay/fp32/L100", "near_unit_decay/fp32/L100",
         "mamba2_init/fp32/L100/packed")
ONLY = "^(" + "|".join(re.escape(c) for c in CELLS) + ")$"
BROKEN = "tests.broken_impls:drop_last_partial_chunk"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("envelope")
    assert cli(["envelope", "--quick", "--impl", "reference", "--only", ONLY, "--out", str(out)]) == 0
    return out


@pytest.fixture
def importable_tests(monkeypatch):
    """``tests.broken_impls`` imports from the repository root, as under ``python3 -m``."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))


def test_quick_envelope_writes_json_markdown_and_plots(baseline):
    doc = json.loads((baseline / "envelope.json").read_text())
    assert doc["schema"] == envelope.SCHEMA and doc["grid"] == "quick" and doc["seed"] == 0
    assert doc["provenance"]["git_commit"] and doc["provenance"]["torch"]
    assert doc["slack"]["factor"] == envelope.SLACK_FACTOR and doc["slack"]["reason"]
    grid = [c.name for c in envelope.build_cells(envelope.GRIDS["quick"], 0)]
    assert [c["name"] for c in doc["cells"]] == [name for name in grid if name in CELLS]
    for cell in doc["cells"]:
        assert len(cell["seeds"]) == envelope.GRIDS["quick"].nseeds
        assert all(v <= envelope.ORACLE_AGREEMENT_TOL for v in cell["oracle_agreement"].values())
        assert set(cell["stages"]) == set(envelope.STAGES)
        for stage, entry in cell["stages"].items():
            metrics = entry["impls"]["reference"]["metrics"]
            assert metrics == entry["reference"]
            assert all(math.isfinite(metrics[k]) for k in envelope.CHECKED_METRICS)
            assert metrics["rel_floor"] > 0
            # The fp32 reference is a few rounding floors from float64, never exact by luck
            # everywhere and never off by orders of magnitude.
            if stage != "chunk_states" or cell["spec"]["seqlen"] > cell["spec"]["chunk_size"]:
                assert 0 < metrics["rounding_floor_ratio"] < 100, (cell["name"], stage, metrics)
        assert cell["stages"]["out"]["out_dtype"] == cell["dtype_mix"]
    md = (baseline / "envelope.md").read_text()
    for stage in envelope.STAGES:
        assert f"(`{stage}`)" in md
    for name in ("error_vs_seqlen.png", "error_vs_decay.png", "error_per_stage.png"):
        data = (baseline / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and 2_000 < len(data) < 100_000, name
        assert f"]({name})" in md


def test_check_passes_against_the_baseline_it_just_wrote(baseline, capsys):
    before = (baseline / "envelope.json").read_bytes()
    assert cli(["envelope", "--check", str(baseline / "envelope.json"), "--impl", "reference"]) == 0
    assert "envelope --check passed: 7 cells" in capsys.readouterr().out
    assert (baseline / "envelope.json").read_bytes() == before   # --check never rewrites it


def test_check_names_the_cells_a_broken_kernel_gets_wrong_and_saves_replayable_artifacts(
        baseline, tmp_path, capsys, importable_tests):
    status = cli(["envelope", "--check", str(baseline / "envelope.json"), "--impl", BROKEN,
                  "--against", "reference", "--failures-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1, err
    failed = set(re.findall(r"^  cell (\S+):$", err, re.M))
    # Dropping the partial last chunk breaks exactly the cells whose seqlen is not a multiple of
    # the chunk size (100 = 64 + 36); the L64 cells are one whole chunk and still pass.
    assert failed == {c for c in CELLS if "/L64" not in c}, err
    assert re.search(r"mamba2_init/fp32/L100 \[" + re.escape(BROKEN) + r"\] out\.max_abs", err)

    artifacts = sorted(tmp_path.glob("envelope-*.json"))
    assert len(artifacts) == len(failed)
    record, directory = repro.load_artifact(artifacts[0])
    assert record["impl"] == BROKEN and record["kind"] == "envelope"
    assert record["name"].split()[0] in failed
    replayed = repro.replay(record, directory, out=io.StringIO())
    assert replayed["first_failing"] in ("out", "final_states")
    for stage in ("out", "final_states"):   # the same float64 sequential oracle: the same numbers
        for metric in envelope.CHECKED_METRICS:
            assert replayed["errors"][stage][metric] == record["errors"]["impl"][stage][metric]
    for stage in ("log2_decay_cumsum", "chunk_states"):
        # repro's exact intermediates come from the definition and the sequential loop, the
        # envelope's from the float64 chunked reference; the two agree to ORACLE_AGREEMENT_TOL.
        assert replayed["errors"][stage]["max_abs"] == pytest.approx(
            record["errors"]["impl"][stage]["max_abs"], rel=1e-6)
    assert cli(["repro", str(artifacts[0])]) == 1      # the failure reproduces from the CLI


def test_check_refuses_a_baseline_without_the_implementation(baseline, capsys):
    assert cli(["envelope", "--check", str(baseline / "envelope.json"), "--impl",
                "reference-fp64"]) == 2
    assert "reference-fp64" in capsys.readouterr().err


def test_check_refuses_a_baseline_it_cannot_read_naming_the_file(tmp_path, capsys):
    not_a_report = tmp_path / "list.json"
    not_a_report.write_text("[1, 2]")
    for path, found in ((tmp_path / "missing.json", "readable JSON document"),
                        (not_a_report, "got 'list'")):
        assert cli(["envelope", "--check", str(path), "--impl", "reference"]) == 2
        err = capsys.readouterr().err
        assert found in err and str(path) in err


def _cell(metrics: dict, out_dtype="fp32", absmax=1.0, impl="k") -> dict:
    return {"name": "c", "unsupported": {}, "stages": {"out": {
        "out_dtype": out_dtype, "exact_absmax": absmax,
        "impls": {impl: {"metrics": metrics, "worst_seed": {m: 0 for m in metrics}}}}}}


def test_slack_is_factor_times_recorded_plus_units_of_the_output_dtype():
    recorded = {"max_abs": 1e-6, "max_rel": 1e-6, "normwise_rel": 1e-7, "ulp_max": 3.0}
    u = 2.0 ** -24
    limits = {"max_abs": 2e-6 + 2 * u * 4.0, "max_rel": 2e-6 + 2 * u, "normwise_rel": 2e-7 + 2 * u,
              "ulp_max": 8.0}
    base = _cell(recorded, absmax=4.0)
    assert envelope.compare(base, _cell(limits), "k", "k") == []
    for metric in recorded:
        worse = dict(limits, **{metric: limits[metric] * (1 + 1e-9)})
        found = envelope.compare(base, _cell(worse), "k", "k")
        assert [(e.stage, e.metric) for e in found] == [("out", metric)]
    nan = envelope.compare(base, _cell(dict(limits, normwise_rel=math.nan)), "k", "k")
    assert [e.metric for e in nan] == ["normwise_rel"]
    # An exact recorded result still admits a rounding-level change, in the dtype's own units.
    zero = {m: 0.0 for m in recorded}
    rounding_level = _cell({**zero, "ulp_max": 2.0}, "bf16")
    assert envelope.compare(_cell(zero, "bf16"), rounding_level, "k", "k") == []


def test_check_holds_the_count_of_non_finite_results_to_the_baseline():
    sound = {"max_abs": 1e-6, "max_rel": 1e-6, "normwise_rel": 1e-7, "ulp_max": 3.0, "nonfinite": 0}
    one_inf = dict(sound, max_abs=math.inf, max_rel=math.inf, normwise_rel=math.inf,
                   ulp_max=math.inf, nonfinite=1)
    found = envelope.compare(_cell(sound), _cell(one_inf), "k", "k")
    assert ("out", "nonfinite") in [(e.stage, e.metric) for e in found]
    # A baseline that recorded Infs (a known defect) passes every error metric by itself: only
    # the count still holds, so one more non-finite result fails.
    assert envelope.compare(_cell(one_inf), _cell(one_inf), "k", "k") == []
    found = envelope.compare(_cell(one_inf), _cell(dict(one_inf, nonfinite=2)), "k", "k")
    assert [e.metric for e in found] == ["nonfinite"]


def test_rule_column_is_the_rule_the_tests_enforce():
    """The report's "rule (<= 1)" divides by check.judge's allowance, which never takes the
    baseline below one rounding at the largest exact value: a result the tests pass reads <= 1."""
    import torch
    u = 2.0 ** -24
    reference = {"max_abs": 0.0, "exact_absmax": 1.0, "nonfinite": 0}   # the reference is exact
    impl = {"max_abs": 2 * u, "exact_absmax": 1.0, "nonfinite": 0}       # judge allows 4 u + tiny
    ratio = envelope._accuracy_rule_ratio("out", torch.float32, impl, reference)
    assert ratio == pytest.approx(2 * u / (4 * u + torch.finfo(torch.float32).tiny))


@pytest.mark.slow
def test_whole_quick_grid_measures_and_checks_itself(tmp_path, capsys):
    assert cli(["envelope", "--quick", "--impl", "reference", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "envelope.json").read_text())
    assert len(doc["cells"]) == len(envelope.build_cells(envelope.GRIDS["quick"], 0))
    assert cli(["envelope", "--check", str(tmp_path / "envelope.json"), "--impl", "reference"]) == 0
