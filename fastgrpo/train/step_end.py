"""What every training loop does after an update, in one place: GRPOTrainer's and SFTTrainer's steps, expert
iteration's rounds. The evaluation when due, the metrics line (history, metrics.jsonl, console), the checkpoint when
due, and the stop a signal asked for, in that order: a stop comes after the save, so that the step it ends is kept."""
from __future__ import annotations

import time
from pathlib import Path

from fastgrpo.train.interrupts import Interrupted


def end_step(loop, metrics: dict, *, step: int, total: int, log, console, guard, save_now: bool = False,
             saved_time: float | None = None, unit: str = "step") -> Path | None:
    """After the update of `step` (of `total`): loop's evaluator when due (a failing one saves the step: PeriodicEval.
    add_to), the metrics appended to loop.history, written to `log` and `console`, loop.save_checkpoint() when due
    (config.save_steps; config.save_minutes since saved_time, for a loop that has it) or save_now, then Interrupted
    when `guard` got a signal. Returns the checkpoint written, None when none. `loop` has config, dist, evaluator,
    history and save_checkpoint(); `unit` is what it calls a step ("round")."""
    config, dist = loop.config, loop.dist
    if loop.evaluator is not None:
        metrics = loop.evaluator.add_to(metrics, step, force=step == total, dist=dist, log=log,
                                        save=loop.save_checkpoint)
    loop.history.append(metrics)
    log.write(metrics)
    console.add(metrics)
    due = save_now or checkpoint_due(config, step, saved_time)
    # all processes save, or none; and all stop when any got a signal
    signum, save = dist.max(guard.requested or 0, int(due))
    path = loop.save_checkpoint() if save or signum else None
    if path is not None:
        signum = signum or guard.arrived_alone()  # one that came as the step was saved: stop with it
    if signum:
        raise Interrupted(signum, step, path, unit=unit)
    return path


def checkpoint_due(config, step: int, saved_time: float | None) -> bool:
    """Whether `step` ends with a periodic checkpoint: every config.save_steps steps, or config.save_minutes after
    the last save (saved_time, time.monotonic()'s; None for a loop without save_minutes)."""
    if config.save_steps and step % config.save_steps == 0:
        return True
    return saved_time is not None and bool(config.save_minutes) and \
        time.monotonic() - saved_time >= 60 * config.save_minutes
