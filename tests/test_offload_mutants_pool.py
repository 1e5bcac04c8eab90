"""The host buffer pool's eviction order and the backward's prefetch across live graphs, where the suite's other
cases could not tell a mutant apart (found by the offload mutation audit). CPU pool and offloader."""
import torch

from fastgrpo.offload import ActivationOffloader, offload_checkpoint
from fastgrpo.offload.pool import HostBufferPool
from tests.test_offload import MIB, Block, LoggingCopies


def test_pool_under_its_limit_drops_the_largest_free_buffers_first():
    """Free 1 MiB and 4 MiB buffers, a bound of 6 MiB, a new 2 MiB one: dropping the 4 MiB one alone makes room, and
    the small one (the likelier match for the next request) stays. Dropping the smallest first kept the 4 MiB one
    and passed the suite, whose eviction case had one free buffer."""
    pool = HostBufferPool(max_bytes=6 * MIB, pin_memory=False)
    small, large = pool.acquire(1 * MIB), pool.acquire(4 * MIB)
    pool.release(small)
    pool.release(large)
    pool.acquire(2 * MIB)
    assert pool.bytes_free == 1 * MIB and pool.num_free == 1, (pool.bytes_free, pool.num_free)
    assert pool.acquire(1 * MIB).data_ptr() == small.data_ptr() and pool.num_allocations == 3


def test_backward_prefetches_nothing_of_a_graph_whose_backward_already_ran():
    """Two micro-batches' graphs alive at once, the first kept (retain_graph) and already backpropagated: the second
    one's backward brings back its own layers' inputs only. Fetching the first graph's newest input too (a replay
    count of <= instead of <) held a device copy nobody reads, and passed the suite."""
    log = []
    blocks = [Block() for _ in range(3)]
    off = ActivationOffloader("cpu")
    off._copies = LoggingCopies(log)
    hosts, losses = [], []
    for _ in range(2):
        h = torch.randn(2, 16, requires_grad=True) * 1.0
        for block in blocks:
            h = offload_checkpoint(block, h, offloader=off)
            hosts.append(off._live[-1]()._host.data_ptr())
        losses.append(h.square().sum())
    losses[0].backward(retain_graph=True)
    log.clear()
    losses[1].backward()
    fetched = [ptr for kind, ptr in log if kind == "fetch"]
    assert fetched and set(fetched) <= set(hosts[3:]), (fetched, hosts)
