"""What the launchers read from the CUDA card they run on."""
import functools

import torch


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device`. Not cached here: torch caches the properties, and torch.compile,
    which traces the launchers of triton_op kernels, folds this call (it warns on a functools cache)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.compiler.assume_constant_result
def max_shared(device: torch.device) -> int:
    """Shared memory a block may opt into on CUDA `device`, bytes, as Triton's driver reports it (what Triton checks
    a launch against). A constant to torch.compile, which traces the decode attention's launcher in the compiled
    decode step, where the driver's query (a C call) would break the step's graph at every attention call."""
    return _max_shared(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _max_shared(index: int) -> int:
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]
