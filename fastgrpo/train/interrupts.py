"""SIGINT / SIGTERM during a run: stop at a step boundary with a checkpoint, never halfway through an update.

A training step has two phases. Before its update (rollout, rewards, reference log-probs) the weights, optimizer
and step counter are still as the previous step left them: a signal there abandons the step at once, and the loop
saves the state the step began from (with the RNG states it captured at the step's start). Once the update has
begun, a signal lets the step finish and the loop stops after it. A second signal stops at once, wherever the step
is (no checkpoint then). The loop raises Interrupted, a KeyboardInterrupt, once its checkpoint is written;
`fastgrpo` prints it as one line and exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM).

A command's loop uses it as GRPOTrainer.train does:

    with InterruptGuard() as guard:
        while step < max_steps:
            rng = rng_states()
            guard.abandonable = True        # nothing has changed yet
            try:
                ...rollout, rewards...      # a signal raises Interrupted here
            except Interrupted as stop:
                raise stop.saved(step, save_checkpoint(..., rng=rng))
            guard.abandonable = False       # the update: a signal waits for the step to end
            ...update; step += 1...
            if guard.requested:
                raise guard.interrupted(step, save_checkpoint(...))

Outside the main thread (where Python cannot take signals) the guard does nothing. With several processes
(`deferred`) a process acting on its own signal would enter a checkpoint's collectives while the others wait in the
step's: the first signal is only noted, and the loop stops every process together where they agree on it (before
the update, or at the step's end: GRPOTrainer); a second one still stops at once, without a checkpoint. A signal
that comes after another process ended (torchrun stops the others then) stops this one at once with
fastgrpo.train.lost_process's line, as the failed collective it would next meet does.
"""
from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import sys
import threading
from pathlib import Path

from fastgrpo.train.lost_process import ProcessLost, another_process_ended, sigterm_unless_leaving
from fastgrpo.train.ranks import is_main_process

logger = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal. checkpoint: where the state of `step` was saved (None: stopped at once, after the
    last periodic checkpoint). how_to_resume: the command that continues it (a CLI fills in its own). unit: what the
    loop calls a step in its messages ("round" for expert iteration)."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None, unit: str = "step"):
        super().__init__(signum)
        self.signum, self.step, self.checkpoint, self.unit = signum, step, checkpoint, unit
        self.how_to_resume = "resume=True (and the same settings otherwise)"  # the CLI puts its command line here
        self.how_to_restart = "call train() again"  # with nothing saved; the CLI says to run its command again
        # stopped at once (a second signal) before the run's first checkpoint: no --resume can continue it, and the
        # metrics it logged make a plain restart refuse the folder; the loop sets it, the CLI names its command
        self.nothing_saved = False
        self.how_to_start_over = "overwrite_output_dir=True in a new trainer (deletes the metrics it logged)"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def saved(self, step: int, checkpoint: Path | None) -> Interrupted:
        """This interrupt, after the loop saved `step` to `checkpoint`."""
        out = Interrupted(self.signum, step, checkpoint, self.unit)
        out.how_to_resume, out.how_to_restart = self.how_to_resume, self.how_to_restart
        out.how_to_start_over = self.how_to_start_over
        return out

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None and self.step == 0:
            return f"stopped by {name} before the first {self.unit} ended; nothing to keep: {self.how_to_restart}"
        if self.checkpoint is not None:
            return (f"stopped by {name}: {self.unit} {self.step} saved in {self.checkpoint}; continue with "
                    f"{self.how_to_resume}")
        if self.nothing_saved:
            return (f"stopped by {name} in the middle of a {self.unit}, before the run's first checkpoint: nothing to "
                    f"continue from; start afresh with {self.how_to_start_over}")
        return (f"stopped by {name} in the middle of a {self.unit}, without a new checkpoint; continue from the last "
                f"checkpoint with {self.how_to_resume}")


class Terminated(KeyboardInterrupt):
    """SIGTERM in a command outside a run loop's InterruptGuard (sigterm_as_ctrl_c): it stops as a Ctrl-C does;
    `fastgrpo` prints one line and exits 143."""

    signum = signal.SIGTERM
    exit_code = 128 + signal.SIGTERM


_STARTING: list[int] = []  # the signals starting_signals and sigterm_as_ctrl_c took


@contextlib.contextmanager
def starting_signals():
    """While a command starts (imports, checks, the model's load), until a run loop's InterruptGuard takes the
    signals (eval and export have none: to their end): SIGINT raises KeyboardInterrupt, as Python's own handler does,
    and is noted (interrupted_while_starting, stop_if_interrupted), since a library may swallow it (seen: the run went
    on) or turn it into another error (transformers' lazy import of the model class, cut in numpy's: a RecursionError,
    then a ModuleNotFoundError and its traceback). SIGTERM raises Terminated, noted the same way, from the first
    import on (sigterm_as_ctrl_c keeps it so for the command's body): Python's default killed the process without a
    line. Each is left alone where it is not Python's default (ignored in a background job, a caller's own)."""
    main_thread = threading.current_thread() is threading.main_thread()
    takes_int = main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    takes_term = main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if not (takes_int or takes_term):
        yield
        return

    def note(signum, frame):
        _STARTING.append(signum)
        raise KeyboardInterrupt

    if takes_int:
        signal.signal(signal.SIGINT, note)
    if takes_term:
        signal.signal(signal.SIGTERM, _sigterm_stops)
    try:
        yield
    finally:
        if takes_int:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if takes_term and signal.getsignal(signal.SIGTERM) is _sigterm_stops:  # not sigterm_unless_leaving
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _STARTING.clear()


def _sigterm_stops(signum, frame) -> None:
    """SIGTERM's handler while a command starts and runs outside a run loop (starting_signals, sigterm_as_ctrl_c)."""
    if another_process_ended():
        raise ProcessLost(signal.Signals(signum).name)
    _STARTING.append(signum)
    raise Terminated


def terminated_while_starting() -> bool:
    return signal.SIGTERM in _STARTING


def interrupted_while_starting() -> bool:
    return bool(_STARTING)


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt (Terminated for a SIGTERM) where starting_signals or sigterm_as_ctrl_c took a signal
    that a library swallowed. `fastgrpo eval` and `fastgrpo export` have no run loop to take the signals over:
    starting_signals keeps them to the command's end, and they call this where their work begins (after the model's
    load), after each of eval's batches, and before a folder atomic_directory filled is renamed into place."""
    if terminated_while_starting():
        raise Terminated
    if _STARTING:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """For a command's whole body (`fastgrpo eval`, `fastgrpo export`; `train`, `sft` and `ei` too, whose run loop's
    InterruptGuard takes SIGTERM over while it runs and gives it back after): SIGTERM (a cluster scheduler's,
    `timeout`'s, `docker stop`'s, torchrun's) stops it as a Ctrl-C does, raising Terminated where it lands, so that its
    cleanups run (the output folder's lock, the hidden partial writes beside its results or export), instead of Python's
    default: killed at once, with no line, leaving them. Noted as starting_signals notes a SIGINT: one a library
    swallowed stops the command at stop_if_interrupted, and an error it left in its place ends as the Terminated. One
    that comes after another process of a torchrun launch ended stops this one with fastgrpo.train.lost_process's
    line, as InterruptGuard does, and one that comes as this block is left with an error, before its line is printed,
    is taken as lost_process.sigterm_unless_leaving takes it. Left alone outside the main thread and where SIGTERM
    has a handler of another's (a caller's own, a run loop's InterruptGuard)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    if not main_thread or previous not in (signal.SIG_DFL, sigterm_unless_leaving, _sigterm_stops):
        yield
        return

    signal.signal(signal.SIGTERM, _sigterm_stops)
    try:
        yield
    except Exception as err:  # e.g. transformers' ModuleNotFoundError for a lazy import the signal cut
        if terminated_while_starting():
            raise Terminated from err
        raise
    finally:
        # an error on its way to its line as another process ended: torchrun's SIGTERM follows, and must not cut it
        lost = sys.exc_info()[1] is not None and another_process_ended()
        signal.signal(signal.SIGTERM, sigterm_unless_leaving if lost else previous)
        _STARTING[:] = [signum for signum in _STARTING if signum != signal.SIGTERM]  # starting_signals' stay


class InterruptGuard:
    """Handles SIGINT and SIGTERM while entered (the previous handlers come back on exit); see the module doc."""

    def __init__(self, unit: str = "step", deferred: bool = False):
        self.unit = unit  # what the loop calls a step, for its messages
        self.deferred = deferred  # the first signal never raises: the loop polls `requested` (several processes)
        self.requested: int | None = None  # the first signal received
        self.abandonable = False  # True while the current step has changed nothing
        self.finishing: str | None = None  # what a signal lets finish once the last step is saved (its export)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> InterruptGuard:
        stop_if_interrupted()  # a Ctrl-C as the command started, which a library swallowed: before the first step
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def arrived_alone(self) -> int:
        """The signal received (0: none), for a loop to act on alone: one received as it saved the step it had
        checked for a signal stops it there, not a step later. 0 under `deferred`: the processes agree on one at
        their next check."""
        return 0 if self.deferred else self.requested or 0

    def begin_update(self, dist) -> None:
        """Called as a step's update begins (GRPOTrainer's, expert iteration's SFT): from here a signal lets the step
        finish. Several processes (`deferred`) abandon the step here together when any got a signal before (their
        guards only note it): dist.max, Distributed's, agrees on it."""
        if self.deferred and (signum := dist.max(self.requested or 0)[0]):
            raise Interrupted(signum, unit=self.unit)
        self.abandonable = False

    def interrupted(self, step: int, checkpoint: Path | None) -> Interrupted:
        """The exception to raise once the loop has saved `step` after a requested stop."""
        return Interrupted(self.requested, step, checkpoint, self.unit)

    def _handle(self, signum: int, frame) -> None:
        if self.deferred and another_process_ended():  # torchrun stopping the others: no stop they can agree on
            raise ProcessLost(signal.Signals(signum).name)
        first = self.requested is None
        if first:
            self.requested = signum
        elif self.deferred:
            self.abandonable = False  # no checkpoint: the other processes may be anywhere in the step
        if (self.abandonable and not self.deferred) or not first:
            raise Interrupted(signum, unit=self.unit)
        if self.deferred and not is_main_process():
            return  # torchrun passes a signal to every process: rank 0 says what follows, once
        name = signal.Signals(signum).name
        what = f"finishing {self.finishing} (the last {self.unit} is saved), then stopping" if self.finishing else \
            f"all processes save a checkpoint and stop, before the current {self.unit}'s update or after it" \
            if self.deferred else f"finishing the current {self.unit}, then saving a checkpoint"
        logger.warning("%s: %s (another %s stops at once)", name, what, name)


def resume_command(argv: list[str]) -> str:
    """The command line that continues the run `argv` started (the words after `fastgrpo`): the same flags, --resume,
    no overwrite (--overwrite-output-dir would delete the checkpoint --resume continues from)."""
    return shlex.join(["fastgrpo", *_without_run_start(argv), "--resume"])


def start_over_command(argv: list[str]) -> str:
    """The command line that starts the run `argv` started afresh, in the folder it left without a checkpoint."""
    return shlex.join(["fastgrpo", *_without_run_start(argv), "--overwrite-output-dir"])


def _without_run_start(argv: list[str]) -> list[str]:
    return [a for a in argv if a not in ("--resume", "--no-resume", "--overwrite-output-dir",
                                         "--no-overwrite-output-dir")]
