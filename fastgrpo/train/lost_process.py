"""One line, not every process's traceback, when a process of a torchrun launch ends in the middle of a run.

A process that is killed (SIGKILL: often the host's out-of-memory killer), crashes, or stops on an error it met alone
(outside Distributed.raise_together, through which the processes stop together on one) leaves the others in a
collective that can never complete. gloo raises "Connection closed by peer" in them at once; NCCL may wait until
torchrun stops them (torchrun sends SIGTERM to the rest within a second of seeing a process end, SIGKILL 30 s later).
fastgrpo's commands turn that collective's error into one line naming the process that ended, printed by the
lowest-ranked process still running (by every process left, where none can tell which one ended); the ended process's
own line, if it printed one, says why, torchrun's summary its exit code or signal. torchrun's SIGTERM reaching a
process after another ended stops it with the same line (ProcessLost), in its run loop (InterruptGuard) and outside
it (loading; eval, export: fastgrpo.train.interrupts.sigterm_as_ctrl_c); reaching it on its way out with that error
(the loop left, the line not yet printed) it is taken (sigterm_unless_leaving). A collective that times out (a
process stuck, not ended) gets one line on each process that waited. Any other error of torch.distributed is not one
of these and keeps its traceback.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time

# what gloo / NCCL say, in a collective's error, when the process at the other end has ended, or has not joined in
# the process group's timeout
_PEER_ENDED = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exit")
_TIMED_OUT = ("ms for recv operation", "ms for send operation", "application timeout caused pair closure",
              "collective operation timeout")
ENDED_WAIT_S = 0.5  # the dead process's socket closes just before its process table entry says it ended

_processes: list[tuple[str, int]] = []  # (host, pid) of every process of the run, by rank


def note_processes() -> None:
    """Record every process's host and pid (a collective: each process of the group calls it as it joins)."""
    import torch.distributed as dist

    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (socket.gethostname(), os.getpid()))
    _processes[:] = found


def sigterm_unless_leaving(signum: int, frame) -> None:
    """SIGTERM's handler in a process of a torchrun launch (init_distributed installs it where SIGTERM had none, and a
    command's sigterm_as_ctrl_c hands SIGTERM to it when left with such an error; the run loop's InterruptGuard puts
    its own in place while it runs, then this one back). torchrun sends SIGTERM to the processes left once one
    ended: arriving after the collective's error left the loop and before the line was printed, its default action
    ended the process without a word (1 launch in 20 on a loaded 2-core machine). An error on its way out and another
    process ended: the signal is taken, the line follows. Anywhere else it has its default action."""
    if sys.exc_info()[1] is not None and another_process_ended():
        return
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


class ProcessLost(BaseException):
    """Another process of the run ended, found outside a collective: as torchrun's SIGTERM (its name, the message)
    arrived (fastgrpo.train.interrupts). A BaseException, as KeyboardInterrupt is: raised wherever the signal lands
    (a reward function, say), it must pass the `except Exception` of the code there, which would take it for that
    code's own error (scoring then called a stuck reward function again, and the process waited for torchrun's
    SIGKILL)."""


def another_process_ended() -> bool:
    """Whether another process of this host's share of the run has ended (note_processes recorded them)."""
    import torch.distributed as dist

    if len(_processes) < 2 or not dist.is_initialized():
        return False
    rank = dist.get_rank()
    return any(_has_ended(*process) for r, process in enumerate(_processes) if r != rank)


def lost_process_line(err: BaseException) -> tuple[str, bool] | None:
    """(the line to print, whether this process prints it) when `err`, or an error it was raised from or while
    handling, is a collective's failure because another process ended or never joined; None for any other error."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    found = [e for e in _chain(err) if isinstance(e, (RuntimeError, ProcessLost))]
    # torch.distributed's own errors (gloo's are plain RuntimeErrors that name its source file, or its pairs)
    texts = [str(e).lower() for e in found if isinstance(e, dist.DistError) or "gloo" in str(e).lower()
             or "pair closure" in str(e).lower()]
    rank, world = dist.get_rank(), dist.get_world_size()
    if any(isinstance(e, ProcessLost) for e in found) or any(p in text for text in texts for p in _PEER_ENDED):
        ended = _ended_ranks(rank, world)
        running = [r for r in range(world) if r not in ended]
        who = f"process {ended[0]}" if len(ended) == 1 else "another process"
        return (f"{who} of {world} ended in the middle of the run, and process {rank} stopped with it; its own error "
                "line says why, and where it printed none, torchrun's summary gives its exit code or signal (SIGKILL: "
                "often the host's out-of-memory killer)", not ended or rank == min(running))
    if any(p in text for text in texts for p in _TIMED_OUT):
        return (f"process {rank} of {world} waited longer than the process group's timeout for the others in a "
                "collective: one of them is stuck (a reward function that never returns, say) or ended on another "
                "machine", True)
    return None


def _chain(err: BaseException | None) -> list[BaseException]:
    found = []
    while err is not None and err not in found:
        found.append(err)
        err = err.__cause__ or err.__context__
    return found


def _ended_ranks(rank: int, world: int) -> list[int]:
    """The other processes known to have ended: by their pids on this host (note_processes), else, of two, the
    other one. Waits up to ENDED_WAIT_S for one to show as ended."""
    others = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + ENDED_WAIT_S
    while len(_processes) == world:
        ended = [r for r in others if _has_ended(*_processes[r])]
        if ended or time.monotonic() > deadline:
            return ended or (others if world == 2 else [])
        time.sleep(0.01)
    return others if world == 2 else []


def _has_ended(host: str, pid: int) -> bool:
    """Whether process `pid` of `host` has ended (a zombie its parent has not collected yet counts); False where this
    host cannot tell (another host, no /proc)."""
    if host != socket.gethostname():
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    except FileNotFoundError:
        return os.path.isdir("/proc/self")
    except OSError:
        return False
    return state in ("Z", "X")
