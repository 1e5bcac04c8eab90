"""Runs under torchrun, on the CPU: worker(rank, tmp_path, *args) on WORLD forked processes joined in a gloo group;
and what the tests of the commands under torchrun share: the tiny model, full weights, a CLI worker."""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgrpo.train import default_task

WORLD = 2
U32 = 2.0**-23  # fp32 unit roundoff (ulp of 1)


def run_forked(worker, tmp_path: Path, *args, deadline_s: float, group_timeout_s: float) -> list:
    """What worker returned on each process, by rank. A process still running after deadline_s fails the test (one
    waits for the other); group_timeout_s bounds each collective."""
    default_task.build_model(default_task.build_tokenizer())  # import transformers' model classes before the fork
    import peft  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    # A store file of its own: gloo's file store is not always deleted when a group ends (a race between the ranks'
    # cleanups), and a later group reading the earlier one's addresses fails with "Connection refused".
    with tempfile.TemporaryDirectory(prefix="gloo-store-") as store:
        context = mp.start_processes(_joined, args=(worker, str(tmp_path), f"{store}/store", group_timeout_s, *args),
                                     nprocs=WORLD, start_method="fork", join=False)
        deadline = time.monotonic() + deadline_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the processes still ran after {deadline_s} s: one waits for the other")
    return [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _joined(rank: int, worker, tmp: str, store: str, group_timeout_s: float, *args) -> None:
    torch.set_num_threads(1)  # 2 processes on a 2-core CI machine; and no OpenMP pool inherited through fork
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        # gloo's handshake ends on one rank before the other: a worker that runs no collective ended its process, and
        # the other rank's init_process_group, still reading from it, failed ("Connection closed by peer")
        dist.barrier()
        torch.save(worker(rank, Path(tmp), *args), Path(tmp, f"rank-{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ---- the model ----
def tiny_model(lora: bool, dtype=torch.float32):
    """The built-in tiny model (seeded) and its tokenizer; lora: a rank-4 adapter on every linear layer."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))  # B != 0: the base's gradients flow
    return model.to(dtype), tokenizer


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as a whole fp64 copy (an FSDP2 shard gathered)."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().double().clone()


def trained_weights(model) -> dict:
    return {n: full_tensor(p) for n, p in model.named_parameters() if p.requires_grad}


# ---- the command ----
def record_writes(folder: Path) -> list:
    """The paths under `folder` that this process opens for writing, creates, renames or deletes from now on (an
    audit hook: it sees Python's and os's calls, so a torch.save into a folder shows as that folder's mkdir)."""
    root, found = os.path.abspath(folder), []
    changes = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate")

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if mode else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        elif event in changes and isinstance(args[0], (str, bytes, os.PathLike)):
            path, writing = args[0], True
        else:
            return
        if writing and os.path.abspath(os.fsdecode(path)).startswith(root):
            found.append(f"{event} {os.fsdecode(path)}")

    sys.addaudithook(hook)  # for the rest of this (forked) process
    return found


def cli(rank: int, tmp: Path, runs: list[list[str]], env: dict | None = None) -> dict:
    """A worker: `fastgrpo <argv>` for each of `runs` on this process: exit codes, stdout, stderr, and (rank 1) its
    writes under tmp/out."""
    from fastgrpo.train.cli import main

    os.environ.update(env or {})
    writes = record_writes(tmp / "out") if rank == 1 else []
    exits, out, err = [], io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for argv in runs:
            exits.append(main(argv))
    return {"exits": exits, "stdout": out.getvalue(), "stderr": err.getvalue(), "writes": writes}


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
