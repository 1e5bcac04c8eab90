"""The check of the checkpoint a trainer resumes from, as the CLI makes it: a resume with work left (steps or rounds
to train, a failed evaluation to redo, final/ to export) checks the base model's files too, which the checkpoint's
LoRA adapter goes on; a finished run's says there is nothing to train whatever its base, from Python as from the CLI
(fastgrpo.train.resume_before_load: finished_run, check_base_before_load)."""
from __future__ import annotations

from pathlib import Path

from fastgrpo.train.checkpoint import UNEVALUATED
from fastgrpo.train.config import check_resume
from fastgrpo.train.dataset_fingerprint import warn_changed_datasets
from fastgrpo.train.final_export import export_due
from fastgrpo.train.ranks import is_main_process


def check_resumed_checkpoint(state: dict, config, checkpoint: Path, last: int, evaluates: bool) -> None:
    """check_resume of `checkpoint` (its state, read), the base model's files checked only where resuming it has
    work left (has_work_left), which is told too where the dataset's file changed since (warn_changed_datasets)."""
    work_left = has_work_left(state, config, checkpoint.parent, last, evaluates)
    check_resume(state.get("config", {}), config, checkpoint.name, base=work_left)
    if work_left and is_main_process():  # every process reads the same file: rank 0 says so
        warn_changed_datasets(state.get("config", {}), config, checkpoint.name)


def has_work_left(state: dict, config, output_dir: str | Path, last: int, evaluates: bool) -> bool:
    """Whether resuming the checkpoint of `state` (its "step": the step or round it saved) has work to do: steps or
    rounds up to `last`; its last step's evaluation, which failed (evaluates: the run evaluates now); or final/ to
    export (missing, or of an earlier step: stopped before its export, or went on with export off)."""
    done = state["step"]
    return done < last or (evaluates and UNEVALUATED in state) \
        or bool(config.export and export_due(output_dir, done, trained=False))
