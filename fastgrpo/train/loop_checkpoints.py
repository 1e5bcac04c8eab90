"""A training loop's own checkpoints, as its save_checkpoint writes them and its resume reads them back: one copy for
GRPOTrainer, SFTTrainer and ExpertIteration (as step_end.end_step is one), so that a fix to one is a fix to all.

`loop` has config, dist, model, output_dir, evaluator, _unevaluated, history, and the newest checkpoint it wrote or
resumed from: _saved_step, _saved_path, _saved_identity (options.check_own_run, for a trainer whose train() called
again continues its own run) and _saved_time (its last save, for config.save_minutes).
"""
from __future__ import annotations

import time
from pathlib import Path

from fastgrpo.train.checkpoint import UNEVALUATED, newest_readable_checkpoint, prune_checkpoints, warn_skipped
from fastgrpo.train.options import checkpoint_identity
from fastgrpo.train.resume_checks import check_resumed_checkpoint


def write_checkpoint(loop, step: int, optimizer, state: dict, rng: dict | None = None,
                     unevaluated: dict | None = None) -> Path:
    """checkpoint-<step> of loop.output_dir: `state` (step, config, the loop's own fields), rng (RNG states captured
    earlier, for a step that was abandoned or whose evaluation failed; None: taken now) and unevaluated (the metrics
    of the latter), with the model's trainable parameters and the optimizer's state (None: a loop that keeps none);
    then the oldest checkpoints past save_total_limit, and those of a history a resume went back over, are
    deleted (prune_checkpoints). It is recorded as the loop's newest."""
    state = {
        **state,
        **({"rng": rng} if rng is not None else {}),
        **({UNEVALUATED: unevaluated} if unevaluated is not None else {}),
    }
    # the loop's previous checkpoint: a checkpoint between it and this one is none of the loop's (None: unknown)
    since = loop._saved_step
    path = loop.dist.save_checkpoint(loop.output_dir / f"checkpoint-{step}", loop.model, optimizer, state)
    loop._saved_step, loop._saved_path, loop._saved_time = step, path, time.monotonic()
    loop._saved_identity = checkpoint_identity(path) if loop.dist.is_main else None
    if loop.dist.is_main:
        prune_checkpoints(loop.output_dir, loop.config.save_total_limit, step, since)
    return path


def restore_newest(loop, last: int, optimizer) -> tuple[Path, dict]:
    """Load the newest complete checkpoint of loop.output_dir (a torn one is skipped with a warning) into the model,
    the optimizer (None: a loop that keeps none) and the RNGs, once its settings are checked against the config's
    (check_resumed_checkpoint; last: the step or round the run ends at), and take up the metrics of a step whose
    evaluation failed (loop._unevaluated). Returns (its folder, the rest of its state)."""
    path, state, skipped = newest_readable_checkpoint(loop.output_dir)
    if loop.dist.is_main:  # every process skips the same ones (process_agreement): rank 0 says so
        warn_skipped(skipped)
    check_resumed_checkpoint(state, loop.config, path, last, loop.evaluator is not None)
    state = loop.dist.restore_checkpoint(path, state, loop.model, optimizer)
    # with the evaluation off now (eval_steps 0), the metrics line written without it stands
    loop._unevaluated = state.get(UNEVALUATED) if loop.evaluator is not None else None
    return path, state


def resumed_at(loop, path: Path, step: int, unit: str = "step") -> None:
    """After a loop restored checkpoint `path` of `step` (its metrics' key `unit`: expert iteration's "round"): it
    is the loop's newest checkpoint, and the history past it is undone."""
    loop._saved_step, loop._saved_path = step, path
    loop._saved_identity = checkpoint_identity(path) if loop.dist.is_main else None
    loop.history = [m for m in loop.history if m[unit] <= step]  # past the checkpoint: undone
