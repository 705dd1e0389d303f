"""Slots of GPU memory for the tests marked ``large_gpu_problem``, shared by every pytest process
on the machine (xdist workers, or two runs side by side).

Each xdist worker is its own process with its own caching allocator, so nothing inside torch
keeps six workers' float64 checks of 16,400-token problems (up to 53 GiB each) off one GPU at
once: on the H200 at 0def9fb five such tests ran out of its 140 GiB among six workers and passed
with fewer beside them (reports/h200/experiments/pytest_gpu_0def9fb.txt.gz). A slot is an
exclusive ``flock`` on one of ``large_problem_slots`` files; the kernel drops it when its process
ends, however it ends. The slots leave room for the run's other workers: their tests hold up to
OTHER_WORKER_GIB each (their running test's memory). On the H100 at aab4aca two large tests at
~26-30 GiB beside two workers at 9-13 GiB ran its 79 GiB out at -n 4 (eleven tests, each passing
at -n 2: reports/h100/experiments/pytest_gpu_half0_aab4aca.txt.gz). That
share holds only if a worker keeps no more than its running test needs: its allocator caches what
every earlier test freed, so at 64b42b2 on the H100 two workers held 26-31 GiB between their small
tests and four large tests ran out beside them (reports/h100/experiments/pytest_gpu_64b42b2.txt.gz);
``gpu_test_memory`` gives that cache back after every GPU test. A second pytest run on the same GPU
is not counted.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile
import time
from pathlib import Path

import torch

# A large test's peak in one process, CUDA context and the allocator's cache included: 53.2 GiB
# the most sampled (nvidia-smi each second) on the H100 at 7548d42, three of the split walks'
# tests (reports/h100/experiments/gpu_memory_samples_7548d42.csv.gz). The 26.4 GiB that an
# out-of-memory report on the H200 showed was a test's memory where it failed, not its peak.
LARGE_GPU_PROBLEM_GIB = 56
# What another xdist worker may hold while a large test runs: its running test's memory, its
# cache given back after each test (gpu_test_memory). In the out-of-memory reports the workers
# held 8.5-13.4 GiB beside 21.9-34.4 (the large tests, their allocators' caches included) on the
# H100 at aab4aca, 3.9-14.8 beside 25.2-30.5 on the H200 at d677366 (-n 8), before any cache
# was given back.
OTHER_WORKER_GIB = 15
SLOTS_DIR = Path(tempfile.gettempdir()) / "mamba2-cutile-gpu-slots"


@contextlib.contextmanager
def hold_slot(folder: Path, device: str, slots: int, poll_s: float = 0.5):
    """Hold one of ``slots`` locks named after ``device`` in ``folder``, waiting while all are
    held."""
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        for slot in range(slots):
            handle = open(folder / f"{device}-{slot}.lock", "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield slot
            finally:
                handle.close()
            return
        time.sleep(poll_s)


def large_problem_slots(total_memory: int, workers: int) -> int:
    """How many large tests may run at once on a GPU of ``total_memory`` bytes beside the run's
    other ``workers - 1`` workers (OTHER_WORKER_GIB each): at least one."""
    spare = total_memory - (workers - 1) * OTHER_WORKER_GIB * 2**30
    return max(1, spare // (LARGE_GPU_PROBLEM_GIB * 2**30))


@contextlib.contextmanager
def large_gpu_problem_slot():
    """A slot on the current GPU for one large test."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slots = large_problem_slots(props.total_memory, workers)
    with hold_slot(SLOTS_DIR, str(props.uuid), slots):
        yield


@contextlib.contextmanager
def gpu_test_memory(large: bool):
    """Around one GPU test, a large one in a slot (``large_gpu_problem_slot``): when it ends its
    process's cached memory goes back to the device (not only to its allocator's cache), a large
    test's before its slot is released, so that each worker holds what its own running test
    needs, not the cache of the tests it ran before (a large test then starts with none)."""
    with large_gpu_problem_slot() if large else contextlib.nullcontext():
        try:
            yield
        finally:
            _return_cached_memory()


def _return_cached_memory():
    gc.collect()
    torch.cuda.empty_cache()
