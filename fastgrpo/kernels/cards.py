"""What the launchers read from the CUDA card they run on, read once per device (a launch on the decode path must
not pay a driver query)."""
import functools

import torch


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _max_shared(index: int) -> int:
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device`."""
    return _sm_count(_index(device))


def max_shared(device: torch.device) -> int:
    """Shared memory a block may opt into on CUDA `device`, bytes, as Triton's driver reports it (what Triton checks
    a launch against)."""
    return _max_shared(_index(device))
