"""Failure artifacts round-trip: a failing property saves one before it raises, and the replay on
this machine gives the same numbers and names the stage the bug is in."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis.errors import UnsatisfiedAssumption

from properties import repro
from properties.impls import get_impl
from properties.problems import ProblemSpec, build_problem
from properties.provenance import REPO_ROOT, atomic_write

BROKEN = "tests.broken_impls:drop_last_partial_chunk"
SPEC = ProblemSpec(batch=2, seqlen=100, nheads=4, headdim=8, dstate=8, ngroups=2, chunk_size=32,
                   D="head", z=True, dt_softplus=True, initial_states=True, seed=4)


def run_module(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def test_a_failing_property_saves_an_artifact_that_replays_to_the_same_numbers(tmp_path):
    env = {repro.FAILURES_ENV: str(tmp_path), "MAMBA2_CUTILE_PROFILE": "ci"}
    run = run_module("-m", "pytest", "-q", "-p", "no:cacheprovider",
                     "tests/test_properties.py::test_accuracy_against_float64", "--impl", BROKEN,
                     env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    paths = list(tmp_path.glob("property-accuracy*.json"))
    assert len(paths) == 1, (paths, run.stdout)
    assert str(paths[0]) in run.stdout                       # the report names the artifact
    assert not list(tmp_path.glob(".*.tmp"))                  # no half-written files left

    record, directory = repro.load_artifact(paths[0])
    assert record["impl"] == BROKEN and record["kind"] == "property"
    assert record["hypothesis_blob"].startswith("@reproduce_failure(")
    assert record["environment"]["torch"] == torch.__version__
    spec = ProblemSpec.from_dict(record["recipe"])
    # Hypothesis shrank to a case the bug shows in: a partial last chunk.
    assert spec.seqlen % spec.chunk_size != 0
    problem, source = repro.artifact_problem(record, directory)
    assert source.startswith("saved tensors")
    assert repro.input_hash(problem) == record["input_sha256"] == \
        repro.input_hash(build_problem(spec))                  # tensors and recipe agree

    replayed = repro.replay(record, directory, out=io.StringIO())
    assert replayed["first_failing"] == "out"
    assert replayed["errors"] == record["errors"]["impl"]     # same machine: the same numbers

    cli = run_module("-m", "properties", "repro", str(paths[0]), env=env)
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "first stage where the error appears: out" in cli.stdout
    out_row = next(line.split() for line in cli.stdout.splitlines() if line.startswith("out "))
    assert float(out_row[1]) == pytest.approx(record["errors"]["impl"]["out"]["max_abs"], rel=1e-3)
    assert out_row[1] == out_row[2]                           # measured == recorded, as printed


@pytest.mark.parametrize("broken, stage", [
    ("tests.broken_stages:exclusive_decay_cumsum", "log2_decay_cumsum"),
    ("tests.broken_stages:causal_mask_off_by_one", "out"),
    (BROKEN, "out"),
])
def test_replay_names_the_stage_the_bug_is_in(broken, stage):
    summary = repro.replay_problem(build_problem(SPEC), get_impl(broken), out=io.StringIO())
    assert summary["first_failing"] == stage


def test_the_reference_replays_clean():
    summary = repro.replay_problem(build_problem(SPEC), get_impl("reference"), out=io.StringIO())
    assert summary["first_failing"] is None


def _save(tmp_path, **kwargs):
    problem = build_problem(SPEC)
    return repro.save_artifact(kind="property", name="unit test[x]", problem=problem,
                               impl="reference", errors={"impl": {}}, spec=SPEC,
                               directory=tmp_path, **kwargs), problem


def test_saving_again_replaces_atomically_and_a_failed_write_leaves_the_old_artifact(
        tmp_path, monkeypatch):
    first, _ = _save(tmp_path, message="first")
    second, _ = _save(tmp_path, message="second")
    assert first == second
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.with_suffix(".pt").name]

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(repro.provenance, "collect", broken)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, message="third")
    assert json.loads(first.read_text())["message"] == "second"
    assert not list(tmp_path.glob(".*.tmp"))


def test_large_inputs_rebuild_from_the_recipe_and_the_hash_vouches_for_them(tmp_path, monkeypatch):
    monkeypatch.setattr(repro, "TENSOR_LIMIT_BYTES", 0)
    path, problem = _save(tmp_path)
    record, directory = repro.load_artifact(path)
    assert record["tensor_file"] is None
    rebuilt, source = repro.artifact_problem(record, directory)
    assert source == "recipe" and repro.input_hash(rebuilt) == repro.input_hash(problem)
    record["input_sha256"] = "0" * 64
    with pytest.raises(ValueError, match="sha256"):
        repro.artifact_problem(record, directory)


def test_seed_replays_a_neighbouring_case_from_the_recipe(tmp_path):
    path, problem = _save(tmp_path)
    record, directory = repro.load_artifact(path)
    other, source = repro.artifact_problem(record, directory, seed=SPEC.seed + 1)
    assert source == f"recipe with seed {SPEC.seed + 1}"
    assert repro.input_hash(other) != repro.input_hash(problem)


def test_failure_artifact_saves_before_reraising_and_ignores_rejections(tmp_path, monkeypatch):
    monkeypatch.setenv(repro.FAILURES_ENV, str(tmp_path))
    problem = build_problem(SPEC)
    with pytest.raises(AssertionError) as info:
        with repro.failure_artifact(kind="property", name="ctx", problem=problem, impl="x",
                                    spec=SPEC, options={"split": 3}) as rec:
            rec.errors["out"] = {"max_abs": 1.5}
            assert False, "the check failed"
    saved = json.loads((tmp_path / "property-ctx.json").read_text())
    assert saved["errors"] == {"out": {"max_abs": 1.5}} and saved["options"] == {"split": 3}
    assert "the check failed" in saved["message"]
    if sys.version_info >= (3, 11):
        assert "repro artifact" in " ".join(info.value.__notes__)
    with pytest.raises(UnsatisfiedAssumption):
        with repro.failure_artifact(kind="property", name="rejected", problem=problem, impl="x"):
            raise UnsatisfiedAssumption()
    assert not (tmp_path / "property-rejected.json").exists()


def test_missing_or_foreign_artifacts_are_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="artifact"):
        repro.load_artifact(tmp_path / "nope.json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError, match="schema"):
        repro.load_artifact(tmp_path / "other.json")


def test_failures_dir_defaults_to_the_ignored_folder_and_follows_the_environment(monkeypatch):
    monkeypatch.delenv(repro.FAILURES_ENV, raising=False)
    assert repro.failures_dir() == Path(REPO_ROOT) / "failures"
    ignored = subprocess.run(["git", "check-ignore", "-q", "failures/x.json"], cwd=REPO_ROOT)
    assert ignored.returncode == 0
    monkeypatch.setenv(repro.FAILURES_ENV, "/tmp/elsewhere")
    assert repro.failures_dir() == Path("/tmp/elsewhere")


def test_a_write_cut_short_keeps_the_file_it_would_replace(tmp_path):
    """Every report and artifact is written through properties.provenance.atomic_write: a
    write that fails midway (here the writer raises; on the H200 a device call's time limit
    kills the run) leaves the previous file whole and no temporary file beside it."""
    path = tmp_path / "reports" / "bench.json"
    assert atomic_write(path, '{"rows": 1}\n') == path and path.read_text() == '{"rows": 1}\n'
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask      # as open() would have made it
    atomic_write(path, b"bytes")
    assert path.read_bytes() == b"bytes"

    def cut_short(f):
        f.write(b'{"rows": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, cut_short)
    assert path.read_bytes() == b"bytes" and os.listdir(path.parent) == ["bench.json"]
