"""One-line errors for fastgrpo's commands, and the exit code each kind of ending gets.

  a mistake in the input (ValueError naming the argument: flags, YAML, data, paths)   one line, exit 2
  a run stopped by what it met (RunError, e.g. a failing reward; OSError: disk full)  one line, exit 1
  another process of a torchrun launch ended mid-run (fastgrpo.train.lost_process)    one line, exit 1
  SIGINT / SIGTERM (fastgrpo.train.interrupts.Interrupted, after its checkpoint)      one line, exit 128 + signal
  SIGINT / SIGTERM outside a run loop (loading; eval, export: all of them)           one line, exit 130 / 143
  anything else is a bug                                                              the traceback, exit 1
`--debug` shows the traceback of every error instead of the line.

A command of `fastgrpo` (train, sft, ei, eval, ...) gets this by being registered in fastgrpo.train.cli.COMMANDS:
cli.main runs each command's `run(args)` under `run_command`. Raise ValueError for bad input (the codebase's
convention: `name: expected ..., got ...`), RunError (or a subclass) where the run itself cannot go on.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable

from fastgrpo.train.interrupts import Interrupted, Terminated
from fastgrpo.train.lost_process import ProcessLost, lost_process_line
from fastgrpo.train.naming import command_line
from fastgrpo.train.ranks import is_main_process, reported_by_rank_0

USAGE_EXIT = 2
RUN_EXIT = 1


class RunError(RuntimeError):
    """A run cannot go on because of what it met (a reward function failing, a memory bound): one line, exit 1."""


class _LineFormatter(logging.Formatter):
    """`fastgrpo train: warning: ...` for warnings, `fastgrpo train: ...` for info."""

    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"{self.prog}: {level}{record.getMessage()}"


def one_line(err: BaseException) -> str:
    """The message of `err` on one line (a foreign library's message may span several: the first line, which names
    the problem, is kept)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} (--debug shows the rest)"


def _report(line: str, err: BaseException) -> None:
    """Print `line` to stderr, unless rank 0 of a torchrun launch prints it (fastgrpo.train.ranks)."""
    if not reported_by_rank_0(err):
        print(line, file=sys.stderr, flush=True)


# What another library logs on every command that a fastgrpo user cannot act on: bitsandbytes, imported through peft
# (LoRA, or transformers' TrainerState for a reward function), on a CPU with AVX512-BF16 and no `kernels` package,
# says its optional CPU 4-bit kernel is missing (a speed hint for 4-bit models run on the CPU).
_LIBRARY_NOISE = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward"}


class _DropStartingWith(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def run_command(prog: str, body: Callable[[], int], *, debug: bool = False,
                run_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's body and turn its ending into an exit code, printing one line to stderr for the ends the
    module docstring lists. run_errors: more exception types to treat as RunError (e.g. OffloadMemoryError).
    fastgrpo's log records (warnings, info) print to stderr as `prog: ...` lines meanwhile; under torchrun the
    info lines only on rank 0, as the step lines (each rank's warnings still print), and the error or stop that rank
    0 reports too on rank 0 alone."""
    logger = logging.getLogger("fastgrpo")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LineFormatter(prog))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    other_rank = os.environ.get("RANK", "0") != "0"
    logger.setLevel(logging.DEBUG if debug else logging.WARNING if other_rank else logging.INFO)
    logger.propagate = False
    quiet = [(logging.getLogger(name), _DropStartingWith(prefix)) for name, prefix in _LIBRARY_NOISE.items()]
    for library_logger, noise in quiet:
        library_logger.addFilter(noise)
    try:
        with command_line():  # messages name flags, not the configs' field names
            return body()
    except Interrupted as stop:  # not an error: the run saved its state and says how to continue
        if stop.step is None or is_main_process():  # at a step: where every process agreed to stop; rank 0 says it
            print(f"{prog}: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except KeyboardInterrupt as stop:  # before the run loop took over the signals (while loading, say)
        terminated = isinstance(stop, Terminated)  # SIGTERM outside a run loop: sigterm_as_ctrl_c
        if debug and not terminated:
            raise
        if debug:  # raised on, it would end the process with exit 1 (a Ctrl-C's ends as SIGINT: 130)
            traceback.print_exc()
        elif is_main_process():  # torchrun passes the signal to every process: rank 0 says it
            print(f"{prog}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr, flush=True)
        return Terminated.exit_code if terminated else 130
    except ValueError as err:
        if debug:
            raise
        _report(f"{prog}: error: {one_line(err)}", err)
        return USAGE_EXIT
    except (RunError, OSError, *run_errors) as err:
        if debug:
            raise
        _report(f"{prog}: error: {one_line(err)}", err)
        return RUN_EXIT
    except (RuntimeError, ProcessLost) as err:  # a collective another process of a torchrun launch left: one line
        lost = None if debug else lost_process_line(err)
        if lost is None:
            raise
        line, here = lost
        if here:
            print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
        return RUN_EXIT
    finally:
        for library_logger, noise in quiet:
            library_logger.removeFilter(noise)
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
