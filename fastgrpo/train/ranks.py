"""Which process of a torchrun launch speaks for the run. Every process runs the command; rank 0 prints its result,
and its one-line error or stop where every process meets the same one (bad input that every process reads alike,
an error fastgrpo.train.distributed raises on every process, a stop the processes agreed on), so that the line shows
once, not once per process. An error a process meets alone still prints there."""
from __future__ import annotations

import os

from fastgrpo.train.interrupts import Interrupted

_ON_EVERY_PROCESS = "_fastgrpo_on_every_process"  # set on an exception every process of the run raises


def process_rank() -> int:
    """This process's rank: its process group's when it joined one, else torchrun's RANK (0 without torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return process_rank() == 0


def raised_on_every_process(err: BaseException) -> BaseException:
    """err, marked as one that every process of the run raises (rank 0 reports it)."""
    setattr(err, _ON_EVERY_PROCESS, True)
    return err


def reported_by_rank_0(err: BaseException) -> bool:
    """Whether rank 0 prints the line for `err`, met on this process: on rank 0 itself False (it prints it); on
    another, True for bad input (a ValueError: every process reads the same flags, files and folders, and a process's
    own refusal reaches the others through Distributed.raise_together), for an error every process raised, and for a
    stop every process agreed on (Interrupted at a step)."""
    if is_main_process():
        return False
    if isinstance(err, Interrupted):
        return err.step is not None
    return isinstance(err, ValueError) or getattr(err, _ON_EVERY_PROCESS, False)
