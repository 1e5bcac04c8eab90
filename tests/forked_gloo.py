"""Runs under torchrun, on the CPU: worker(rank, tmp_path, *args) on WORLD forked processes joined in a gloo group."""
from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgrpo.train import default_task

WORLD = 2


def run_forked(worker, tmp_path: Path, *args, deadline_s: float, group_timeout_s: float) -> list:
    """What worker returned on each process, by rank. A process still running after deadline_s fails the test (one
    waits for the other); group_timeout_s bounds each collective."""
    default_task.build_model(default_task.build_tokenizer())  # import transformers' model classes before the fork
    import peft  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    context = mp.start_processes(_joined, args=(worker, str(tmp_path), group_timeout_s, *args), nprocs=WORLD,
                                 start_method="fork", join=False)
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the processes still ran after {deadline_s} s: one waits for the other")
    return [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _joined(rank: int, worker, tmp: str, group_timeout_s: float, *args) -> None:
    torch.set_num_threads(1)  # 2 processes on a 2-core CI machine; and no OpenMP pool inherited through fork
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        torch.save(worker(rank, Path(tmp), *args), Path(tmp, f"rank-{rank}.pt"))
    finally:
        dist.destroy_process_group()
