"""The mamba2-cutile command end to end (``python3 -m properties``), on small problems."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from properties import repro
from properties.problems import ProblemSpec, build_problem
from properties.provenance import REPO_ROOT

SMALL = ["--batch", "2", "--seqlen", "70", "--nheads", "4", "--headdim", "8", "--dstate", "8",
         "--ngroups", "2", "--chunk-size", "32"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "properties", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_check_runs_every_available_implementation_and_oracle_tier(tmp_path):
    report_path = tmp_path / "check.json"
    run = cli("check", *SMALL, "--dtype", "bf16", "--D", "channel", "--z", "--dt-softplus",
              "--mpmath-slices", "2", "--json", str(report_path))
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "errors against float64 sequential (tier 2)" in out
    assert "errors against mpmath (tier 1" in out
    for row in ("parallel_scan (tier 3)", "reference ", "reference-fp64"):
        assert row in out
    assert "FAIL" not in out
    if "cuda" not in out:   # a CPU machine says why the GPU implementations did not run
        assert "skipped cutile: cutile needs a CUDA device" in out
    report = json.loads(report_path.read_text())
    assert report["failed"] is False
    assert set(report["impls"]) >= {"reference", "reference-fp64"}
    assert report["impls"]["reference"]["errors"]["out"]["count"] == 2 * 70 * 4 * 8


def test_check_fails_on_a_broken_implementation_and_says_where():
    run = cli("check", *SMALL, "--impl", "reference", "--impl",
              "tests.broken_impls:drop_last_partial_chunk", "--mpmath-slices", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    failing = [line for line in run.stdout.splitlines() if " FAIL " in line]
    assert failing and all(line.startswith("tests.broken_impls") for line in failing)
    assert {line.split()[1] for line in failing} == {"out", "final_states"}


def test_check_with_packed_sequences_and_the_regime_dt_limit():
    run = cli("check", "--batch", "1", "--seqlen", "50", "--nheads", "2", "--headdim", "4",
              "--dstate", "4", "--chunk-size", "16", "--cu-seqlens", "0,7,16,17,50",
              "--initial-states", "--per-sequence-initial-states", "--varlen-states",
              "--regime", "dt_limit_bounds", "--impl", "reference", "--mpmath-slices", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "varlen_states" in run.stdout and "dt_limit" in run.stdout


def test_repro_from_options_without_an_artifact():
    ok = cli("repro", *SMALL, "--impl", "reference")
    assert ok.returncode == 0 and "does not reproduce" in ok.stdout, ok.stdout + ok.stderr
    bad = cli("repro", *SMALL, "--impl", "tests.broken_stages:exclusive_decay_cumsum")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "first stage where the error appears: log2_decay_cumsum" in bad.stdout


def test_help_lists_every_subcommand():
    run = cli("--help")
    assert run.returncode == 0
    for command in ("check", "repro", "envelope", "bench", "ab"):
        assert command in run.stdout


def test_a_broken_subcommand_module_breaks_only_itself():
    code = ("import sys, properties.cli as c; "
            "c.COMMANDS['bench'] = ('properties.no_such_module', 'x'); "
            "sys.exit(c.main(sys.argv[1:]))")
    broken = subprocess.run([sys.executable, "-c", code, "bench"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert broken.returncode == 2
    assert "cannot load properties.no_such_module" in broken.stderr
    works = subprocess.run([sys.executable, "-c", code, "check", "--help"], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    assert works.returncode == 0 and "--chunk-size" in works.stdout


def test_bad_options_are_refused_naming_the_option():
    run = cli("check", "--regime", "no_such_regime")
    assert run.returncode == 2 and "--regime" in run.stderr


def test_repro_of_an_implementation_this_machine_lacks_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the message where cutile cannot run: this machine has a CUDA device")
    spec = ProblemSpec(seqlen=20, nheads=2, headdim=4, dstate=4, chunk_size=64)
    path = repro.save_artifact(kind="property", name="gpu-only", problem=build_problem(spec),
                               impl="cutile", errors={}, spec=spec, directory=tmp_path)
    run = cli("repro", str(path))
    assert run.returncode == 2 and "cutile needs a CUDA device" in run.stderr
    assert "--impl reference" in run.stderr
    other = cli("repro", str(path), "--impl", "reference")
    assert other.returncode == 0, other.stdout + other.stderr


def test_cutile_in_a_precision_mode_is_an_implementation_name():
    from properties.impls import ImplUnavailable, get_impl
    if torch.cuda.is_available():
        impl = get_impl("cutile:tf32")
        assert impl.name == "cutile:tf32" and "'tf32'" in impl.description
    else:
        with pytest.raises(ImplUnavailable, match="cutile needs a CUDA device"):
            get_impl("cutile:tf32")
