"""How many pytest-xdist workers `-n auto` starts (conftest's pytest_xdist_auto_num_workers): one per core as long as
the available memory gives each WORKER_MEMORY_GIB, so a machine of many cores and little memory runs fewer workers
instead of swapping. Kept out of conftest, whose import has side effects, so a test can import it."""
import os

WORKER_MEMORY_GIB = 2  # the CPU suite's largest Python process (worker or test child) peaked at 1.1 GB RSS


def auto_workers(config) -> int | None:
    """The worker count; None where PYTEST_XDIST_AUTO_NUM_WORKERS is set, which is xdist's to apply."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    from xdist.plugin import pytest_xdist_auto_num_workers as one_per_core

    available_kib = available_memory_kib()
    if available_kib is None:
        return one_per_core(config)
    return max(1, min(one_per_core(config), available_kib // (WORKER_MEMORY_GIB * 2**20)))


def available_memory_kib() -> int | None:
    """What the kernel estimates new processes can take without swapping, in KiB; None without /proc/meminfo (not
    Linux: the cores alone decide)."""
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
