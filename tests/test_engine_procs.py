"""The kit's engine-process helpers: every thread of every process below the server moves to
``SCHED_IDLE``, while the server itself and its neighbours keep their policy (real processes and
threads, read back from the kernel)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pipelinerl_sdk.kit.inference.procs import descendants, idle_descendants

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")

#: A child that starts a grandchild, and a second thread in each, then waits.
CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if sys.argv[1] == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "leaf", ""])
time.sleep(60)
"""


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_every_thread_below_goes_idle_and_nothing_else() -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = subprocess.Popen([sys.executable, "-c", CHILD, "parent", CHILD])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            below = descendants(child.pid)
            if below and all(len(_threads(p)) >= 2 for p in [child.pid, *below]):
                break
            time.sleep(0.05)
        assert len(below) == 1, f"expected the grandchild below the child, found {below}"
        # as the server does for its engine: the processes below the child, not the child
        n = idle_descendants(child.pid)
        tids = _threads(below[0])
        assert n == len(tids) >= 2
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        untouched = _threads(child.pid) + _threads(bystander.pid) + _threads(os.getpid())
        assert {os.sched_getscheduler(t) for t in untouched} == {os.SCHED_OTHER}
    finally:
        for p in (child, bystander):
            p.kill()
            p.wait()
        for p in below:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass


def test_a_process_with_no_children_has_no_descendants() -> None:
    leaf = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert descendants(leaf.pid) == []
        assert leaf.pid in descendants(os.getpid())
    finally:
        leaf.kill()
        leaf.wait()
