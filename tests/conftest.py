"""Test options and Hypothesis profiles for the suite.

``--impl NAME[,NAME...]`` picks the implementations the property tests run on (default
``reference``; GPU runners pass ``cutile``): cutile, reference, reference-fp64, mamba_ssm or
``package.module:function``. Tests taking the ``impl`` fixture run once per name; cutile and
mamba_ssm instances carry the ``gpu`` mark.

Hypothesis profiles (``--hypothesis-profile NAME``, else ``$MAMBA2_CUTILE_PROFILE``, else ``ci``):
  ci       few examples, derandomized: CPU CI in minutes, the same examples on every run. It keeps
           no example database, so a failure reaches disk only as a repro artifact (failures/).
           Hypothesis loads a built-in profile called ``ci`` when $CI is set; ours is registered
           under the same name afterwards, so it is the one used.
  gpu      hundreds of examples per property (300), random, with the example database in
           .hypothesis/ (failures found once are replayed first next time).
  nightly  thousands (3000), with target-guided search toward the largest error ratios.

In gpu and nightly a property taking the ``mixes`` fixture runs as one test item per dtype mix
(``properties.strategies.DTYPE_MIXES``), each with its share of the examples. On the GPU nearly
every new draw of dtypes and features compiles kernel variants (seconds each); per mix an item
compiles only its own, and ``pytest -n`` spreads one property's items over workers. ci keeps one
item drawing every mix.
"""
from __future__ import annotations

import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kernels.ssd import TUNING_CACHE_ENV
from properties import repro
from properties.impls import IMPL_NAMES_HELP, ImplUnavailable, get_impl
from properties.provenance import REPO_ROOT
from properties.strategies import DTYPE_MIXES

from gpu_memory import gpu_test_memory

PROFILE_ENV = "MAMBA2_CUTILE_PROFILE"
IMPL_ENV = "MAMBA2_CUTILE_IMPL"
GPU_IMPLS = ("cutile", "mamba_ssm")

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
_database = DirectoryBasedExampleDatabase(str(REPO_ROOT / ".hypothesis" / "examples"))
# ci leaves out the target phase: with few examples, hill-climbing around one example would spend
# most of them on near-copies; breadth is worth more there.
settings.register_profile("ci", max_examples=200, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                          **_common)
# Examples per property in the profiles that shard by dtype mix, split evenly over the mixes.
SHARDED_EXAMPLES = {"gpu": 300, "nightly": 3000}
settings.register_profile("gpu", max_examples=math.ceil(SHARDED_EXAMPLES["gpu"] / len(DTYPE_MIXES)),
                          database=_database, **_common)
settings.register_profile("nightly",
                          max_examples=math.ceil(SHARDED_EXAMPLES["nightly"] / len(DTYPE_MIXES)),
                          database=_database, phases=list(Phase), **_common)
# pytest -n runs a worker per core: torch's own thread pool in each would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
# The plugin applies --hypothesis-profile after this; without it, the environment or ``ci``.
settings.load_profile(os.environ.get(PROFILE_ENV) or "ci")


def pytest_addoption(parser):
    parser.addoption("--impl", default=os.environ.get(IMPL_ENV, "reference"),
                     help=f"implementation(s) under test, comma-separated: {IMPL_NAMES_HELP} "
                          f"(default: ${IMPL_ENV} or reference)")


def pytest_generate_tests(metafunc):
    if "mixes" in metafunc.fixturenames:
        if settings.get_current_profile_name() in SHARDED_EXAMPLES:
            metafunc.parametrize("mixes", [(m,) for m in DTYPE_MIXES],
                                 ids=["-".join(m) for m in DTYPE_MIXES])
        else:
            metafunc.parametrize("mixes", [None], ids=["all-mixes"])
    if "impl_name" in metafunc.fixturenames:
        names = [n.strip() for n in metafunc.config.getoption("--impl").split(",") if n.strip()]
        metafunc.parametrize("impl_name", [
            pytest.param(n, id=n, marks=[pytest.mark.gpu] if n in GPU_IMPLS else [])
            for n in names])


@pytest.fixture(autouse=True, scope="session")
def _no_user_tuning_cache(tmp_path_factory):
    """Tests see kernels/tuned.json only, never the tuning cache of whoever runs them."""
    patch = pytest.MonkeyPatch()
    patch.setenv(TUNING_CACHE_ENV, str(tmp_path_factory.mktemp("tuning") / "tuned.json"))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """GPU tests give their worker's cached memory back when they end, and those marked
    ``large_gpu_problem`` run only as many at once as the GPU's memory holds
    (tests/gpu_memory.py)."""
    large = request.node.get_closest_marker("large_gpu_problem") is not None
    if (large or request.node.get_closest_marker("gpu")) and torch.cuda.is_available():
        with gpu_test_memory(large):
            yield
    else:
        yield


@pytest.fixture
def impl(impl_name):
    """The implementation under test. cutile unavailable on a machine with a CUDA device is a
    failure (a broken cuTile must not pass as skipped); anything unavailable elsewhere skips."""
    try:
        return get_impl(impl_name)
    except ImplUnavailable as exc:
        if impl_name == "cutile" and torch.cuda.is_available():
            pytest.fail(f"cutile unavailable on a machine with a CUDA device: {exc}")
        pytest.skip(str(exc))


def pytest_runtest_setup(item):
    repro.take_written()   # artifacts belong to the test that writes them


_BLOB = re.compile(r"@reproduce_failure\([^)]*\)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach Hypothesis' reproduce_failure blob to the artifacts the failing test wrote."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call":
        return
    written = repro.take_written()
    if report.failed and written:
        found = _BLOB.search(str(report.longrepr))
        for path in written:
            if found:
                repro.attach_hypothesis_blob(path, found.group(0))
            report.sections.append(("repro artifact", f"{path}\nreplay: mamba2-cutile repro {path}"))
