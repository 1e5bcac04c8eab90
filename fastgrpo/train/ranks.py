"""Which process of a torchrun launch speaks for the run. Every process runs the command; rank 0 prints its result,
and its one-line error or stop where every process meets the same one (bad input that every process reads alike,
an error fastgrpo.train.distributed raises on every process, a stop the processes agreed on), so that the line shows
once, not once per process. An error a process meets alone still prints there."""
from __future__ import annotations

import os
import signal
import threading

_ON_EVERY_PROCESS = "_fastgrpo_on_every_process"  # set on an exception every process of the run raises
RANK_0_GRACE_S = 60  # how long a process waits for rank 0 to end with the bad input it met too


def process_rank() -> int:
    """This process's rank: its process group's when it joined one, else torchrun's RANK (0 without torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def process_count() -> int:
    """This run's process count: its process group's when it joined one (processes a caller forked), else torchrun's
    WORLD_SIZE (1 without torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return process_rank() == 0


def raised_on_every_process(err: BaseException) -> BaseException:
    """err, marked as one that every process of the run raises (rank 0 reports it)."""
    setattr(err, _ON_EVERY_PROCESS, True)
    return err


def reported_by_rank_0(err: BaseException) -> bool:
    """Whether rank 0 prints the line for `err`, met on this process: on rank 0 itself False (it prints it); on
    another, True for bad input (a ValueError: every process reads the same flags, files and folders, and a process's
    own refusal reaches the others through Distributed.raise_together) and for an error every process raised."""
    if is_main_process():
        return False
    if _on_every_process(err):
        return True  # raised here and on rank 0 after one collective: rank 0 prints it as this process ends
    return isinstance(err, ValueError) and rank_0_ended()


def rank_0_ended() -> bool:
    """Under torchrun, whether rank 0 ended within RANK_0_GRACE_S (torchrun then stops this process with SIGTERM,
    taken here): bad input is met by each process at its own pace, and torchrun stops the others as soon as one
    fails, so a process that exited first on it had rank 0 stopped before rank 0 printed the line. False: rank 0 has
    not ended (this process prints the line itself). Without torchrun (processes a caller forked): True."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or threading.current_thread() is not threading.main_thread():
        return True
    # blocked: torchrun's SIGTERM is taken by sigtimedwait, not by the default action (an exit by the signal)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return signal.sigtimedwait({signal.SIGTERM}, RANK_0_GRACE_S) is not None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _on_every_process(err: BaseException | None) -> bool:
    """err, or the error it was raised from (a loop that saves a checkpoint before raising it again), was raised on
    every process."""
    while err is not None:
        if getattr(err, _ON_EVERY_PROCESS, False):
            return True
        err = err.__cause__
    return False
