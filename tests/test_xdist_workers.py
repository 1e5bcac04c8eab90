"""`-n auto` (README's test command): one pytest-xdist worker per core while the available memory gives each
worker_count.WORKER_MEMORY_GIB, fewer otherwise, and at least one."""
import pytest
import xdist.plugin

from tests import worker_count

GIB_KIB = 2**20


@pytest.mark.parametrize(("cores", "available_gib", "workers"), [
    (2, 23, 2),  # this project's CI: the cores
    (16, 5, 2),  # many cores, little memory: what memory allows
    (4, 1, 1),  # not even one worker's worth: still one
    (8, None, 8),  # no /proc/meminfo: the cores
])
def test_workers_are_the_cores_as_memory_allows(monkeypatch, cores, available_gib, workers):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(xdist.plugin, "pytest_xdist_auto_num_workers", lambda config: cores)
    available = None if available_gib is None else available_gib * GIB_KIB
    monkeypatch.setattr(worker_count, "available_memory_kib", lambda: available)
    assert worker_count.auto_workers(config=None) == workers


def test_xdists_own_variable_is_left_to_xdist(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert worker_count.auto_workers(config=None) is None


def test_this_machine_reports_its_available_memory():
    available = worker_count.available_memory_kib()
    assert available is None or 0 < available, available
