"""The processes an engine starts behind its server: finding them and moving them out of the way
of the server's front and of a trainer on the same CPU machine.

Why (measured on the 2-core machine, vLLM 0.32's CPU build, kernel 6.18): with more runnable
threads than cores, vLLM's engine core, which waits for its worker by spinning on
``sched_yield``, took 85% of both cores even at nice 10 against three nice-0 busy loops, and
every other process (the engine's own HTTP front, the trainer, unrelated ones) stalled for 4-5 s
at a time. Under the ``SCHED_IDLE`` policy the same engine ran only on cycles nobody else wanted:
no stalls, and the front answered within 0.1-1.3 s while it decoded (at a third of its idle
speed: the share the busy loops left it). On an idle machine ``SCHED_IDLE`` costs nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["descendants", "idle_descendants", "idle_process"]

_PROC = Path("/proc")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from ``/proc``; empty where
    there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = list(_PROC.iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def idle_process(pid: int) -> int:
    """Put every thread of process ``pid`` under the ``SCHED_IDLE`` policy (Linux keeps a policy
    per thread; threads started later inherit their creator's). Returns how many threads were
    set; threads that end meanwhile are passed over. 0 where the platform has no ``SCHED_IDLE``."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return 0
    try:
        tids = [int(t.name) for t in (_PROC / str(pid) / "task").iterdir()]
    except OSError:
        return 0
    count = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            count += 1
        except OSError:
            pass
    return count


def idle_descendants(pid: int | None = None) -> int:
    """:func:`idle_process` for every process below ``pid`` (this process by default); returns
    how many threads were set."""
    return sum(idle_process(child) for child in descendants(os.getpid() if pid is None else pid))
