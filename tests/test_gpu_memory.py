"""The slots that keep large GPU tests from running one GPU's memory out (tests/gpu_memory.py):
the locks themselves, on the CPU."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from gpu_memory import hold_slot


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
