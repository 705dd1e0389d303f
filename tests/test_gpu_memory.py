"""What keeps GPU tests from running one GPU's memory out (tests/gpu_memory.py), on the CPU: the
large tests' slots, their locks and counts, and the cache every GPU test gives back."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gpu_memory
from gpu_memory import hold_slot, large_problem_slots


def _waiter(folder, slots):
    """A thread asking for a slot: (the thread, an event set once it holds one, a release)."""
    held, release = threading.Event(), threading.Event()

    def run():
        with hold_slot(folder, "gpu", slots, poll_s=0.01):
            held.set()
            release.wait(10)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, held, release


def test_a_slot_waits_while_every_slot_is_held_and_takes_the_first_released(tmp_path):
    with hold_slot(tmp_path, "gpu", 2) as first:
        with hold_slot(tmp_path, "gpu", 2) as second:
            assert {first, second} == {0, 1}
            thread, held, release = _waiter(tmp_path, 2)
            assert not held.wait(0.3)
        assert held.wait(5)
        release.set()
        thread.join(5)


def test_a_slot_held_by_a_process_that_dies_is_free_again(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, time; from gpu_memory import hold_slot\n"
         f"with hold_slot(pathlib.Path({str(tmp_path)!r}), 'gpu', 1):\n"
         "    print('held', flush=True); time.sleep(60)"],
        cwd=Path(__file__).parent, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        thread, held, release = _waiter(tmp_path, 1)
        assert not held.wait(0.3)
        holder.kill()
        assert held.wait(5)
        release.set()
        thread.join(5)
    finally:
        holder.kill()
        holder.wait()


def test_large_tests_leave_each_other_worker_its_share_of_the_gpu():
    gib = 2**30
    h100, h200 = int(79.18 * gib), int(139.8 * gib)
    # Two large tests beside two other workers ran the H100 out at -n 4 (the module docstring),
    # and one peaks at 53 GiB: two share an H100 at no worker count, an H200 at two at most.
    assert large_problem_slots(h100, 4) == 1
    assert large_problem_slots(h100, 2) == 1
    assert large_problem_slots(h100, 1) == 1
    assert large_problem_slots(h200, 8) == 1
    assert large_problem_slots(h200, 6) == 1
    assert large_problem_slots(h200, 2) == 2
    assert large_problem_slots(h200, 1) == 2
    # However full the GPU, one large test still runs (alone, when the others are small).
    assert large_problem_slots(16 * gib, 8) == 1


def test_a_gpu_test_gives_its_cached_memory_back_when_it_ends(monkeypatch):
    emptied = []
    monkeypatch.setattr(gpu_memory.torch.cuda, "empty_cache", lambda: emptied.append(1))
    with gpu_memory.gpu_test_memory(large=False):
        assert emptied == []
    assert emptied == [1]
    # Also when the test fails: the worker's next tests run beside large ones all the same.
    with pytest.raises(AssertionError), gpu_memory.gpu_test_memory(large=False):
        raise AssertionError("the test failed")
    assert emptied == [1, 1]
