"""Benchmarks need a CUDA GPU: without one every case is skipped with the reason."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need a CUDA GPU; run them on the GPU machine")
    for item in items:
        item.add_marker(skip)
