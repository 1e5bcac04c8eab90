"""Joining the process group of a torchrun launch (init_distributed), and refusing a launcher fastgrpo does not serve:
`accelerate launch --use_deepspeed` sets ACCELERATE_USE_DEEPSPEED, and fastgrpo runs no DeepSpeed engine (LoRA
trains through DDP, full fine-tuning shards with FSDP2), so such a run would go on without the ZeRO sharding or
offload its user asked for.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import signal
import threading

import torch
import torch.distributed as dist

from fastgrpo.train.config import DDP_TIMEOUT_S
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.lost_process import note_processes, sigterm_unless_leaving
from fastgrpo.train.naming import setting

_ACCELERATE_TRUE = ("y", "yes", "t", "true", "on", "1")  # accelerate's str_to_bool, for its ACCELERATE_USE_* flags


def launched_processes() -> int:
    """How many processes torchrun launched for this run (WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launcher(command: str) -> None:
    """A ValueError naming ACCELERATE_USE_DEEPSPEED when it is set true (`accelerate launch --use_deepspeed`), on one
    process too: before the model loads."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() in _ACCELERATE_TRUE:
        raise ValueError(f"ACCELERATE_USE_DEEPSPEED: `accelerate launch --use_deepspeed` set it, and fastgrpo runs no "
                         f"DeepSpeed (full fine-tuning shards with FSDP2, LoRA trains through DDP); launch with "
                         f"`torchrun --nproc_per_node N -m fastgrpo {command} ...` instead")


def init_distributed(device: str = "auto", timeout_s: int = DDP_TIMEOUT_S) -> Distributed:
    """Join the process group torchrun describes (WORLD_SIZE > 1 in the environment); a no-op otherwise.

    On CUDA each process takes the GPU of its LOCAL_RANK (before any model is loaded, so "cuda" means that GPU)
    and NCCL; on the CPU, gloo. timeout_s bounds each collective's wait for the other processes (a stuck one: then
    each process that waited stops with fastgrpo.train.lost_process's line)."""
    if launched_processes() > 1 and not dist.is_initialized():
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if cuda and ":" in device:
            raise ValueError(f"device: {device!r} under torchrun; pass {setting('device', 'cuda')} (each process "
                             "takes the GPU of its LOCAL_RANK)")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_close_process_group)
        note_processes()  # so that the others can name this process if it ends in the middle of the run
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a caller's own handler stays
            signal.signal(signal.SIGTERM, sigterm_unless_leaving)
    return Distributed.current()


def _close_process_group() -> None:
    """Closes the process group at exit (NCCL warns about one left open), after collecting reference cycles (a trainer
    and its DDP wrapper): DDP's reducer destroyed after its group aborted the process now and then (gloo)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
