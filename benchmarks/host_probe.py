"""Where a data-parallel step's host time goes between launches of the same case: which CPUs a rank runs on, how
much CPU time its main thread spends per step, and how long Python's garbage collector pauses it.

The 2-GPU FSDP2 step moved by 20-50 ms from one launch to the next while each launch's own steps agreed within a
few ms; these probes tell CPU placement (`bind_local_rank`), a slower host (thread time up with the step) and GC
pauses apart.
"""
from __future__ import annotations

import gc
import os
import time
from pathlib import Path


def _physical_cores(cpus: set[int]) -> list[list[int]]:
    """The allowed logical CPUs grouped by physical core (hyperthread siblings together), in CPU order."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:  # no sysfs topology: each logical CPU its own core
            key = ("?", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def bind_local_rank() -> list[int]:
    """Pin every thread of this process to its own share of the allowed physical cores: local rank r of n takes the
    r-th n-th of them, so two ranks never share a core (or its hyperthread sibling). Returns the CPUs bound to."""
    rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = _physical_cores(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"FASTGRPO_BENCH_BIND: {len(cores)} physical cores allowed for {ranks} local ranks")
    share = len(cores) // ranks
    mine = sorted(cpu for core in cores[rank * share:(rank + 1) * share] for cpu in core)
    for tid in os.listdir("/proc/self/task"):  # threads started before this call keep their own mask otherwise
        try:
            os.sched_setaffinity(int(tid), mine)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return mine


class GcClock:
    """Milliseconds the garbage collector ran, per generation, since the last `take()`; a context manager that
    removes its gc callback on exit."""

    def __init__(self):
        self._start = 0.0
        self._ms = [0.0, 0.0, 0.0]

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._ms[info["generation"]] += 1000 * (time.perf_counter() - self._start)

    def take(self) -> list[float]:
        ms, self._ms = self._ms, [0.0, 0.0, 0.0]
        return ms
