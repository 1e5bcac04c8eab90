"""What the CLI checks of a --resume before the model loads: the run's settings and base model against its newest
checkpoint's record, and whether the run is finished (nothing to train: said without loading the model)."""
from __future__ import annotations

from pathlib import Path

from fastgrpo.train.config import check_resume, check_resumed_base


def check_resume_before_load(config) -> None:
    """A --resume checked against the newest checkpoint's run config before the model loads; the trainer checks what
    it loads again, and warns of the changes --resume-allow-changes lets through then. The base model's files are
    check_base_before_load's: a finished run loads no model, and says it has nothing to train whatever its base."""
    _check_newest_checkpoint(config, lambda saved, name: check_resume(saved, config, name, warn=False, base=False))


def check_base_before_load(config) -> None:
    """For a --resume that trains or exports (not finished_run's): the base model is the one the newest checkpoint's
    run trained on (check_resumed_base), before it loads; a LoRA adapter put on another base mixes two runs."""
    _check_newest_checkpoint(config, lambda saved, name: check_resumed_base(saved, config, name, warn=False))


def _check_newest_checkpoint(config, check) -> None:
    """check(run config, checkpoint name) of a --resume's newest checkpoint, where it has a run_config.json."""
    from fastgrpo.train.checkpoint import CONFIG_FILE, latest_checkpoint, read_run_config

    newest = latest_checkpoint(config.output_dir) if config.resume else None
    if newest is not None and (newest / CONFIG_FILE).is_file():
        check(read_run_config(newest), newest.name)


def finished_run(config) -> str | None:
    """For a --resume of a GRPO run whose newest checkpoint is at max_steps or past it (and whose final/ is that
    checkpoint's export when export is on): the line saying there is nothing to train, instead of loading the model to
    find that out. report_to is checked first, on every run: a finished one builds no trainer, whose metrics log
    checks it."""
    from fastgrpo.train.naming import setting

    return finished_at(config, config.max_steps, "step", setting("max_steps", config.max_steps), "max_steps")


def finished_at(config, last: int, unit: str, of: str, field: str) -> str | None:
    """finished_run for a run whose checkpoints count `unit`s (step, round) up to `last`, as setting `field` gives
    it (`of`: the limit as the user set it)."""
    from fastgrpo.train.checkpoint import apply_save_limit, list_checkpoints, newest_readable_checkpoint, warn_skipped
    from fastgrpo.train.final_export import nothing_to_train
    from fastgrpo.train.metrics_log import check_report_to
    from fastgrpo.train.ranks import is_main_process
    from fastgrpo.train.resume_checks import has_work_left

    check_report_to(config.report_to)
    found = list_checkpoints(config.output_dir) if config.resume else []
    if not found or found[-1][0] < last:
        return None
    # the checkpoint the resume loads, read as it reads it (tensors left unread): a damaged newest one is skipped
    newest, state, skipped = newest_readable_checkpoint(config.output_dir, mmap=True)
    # an older checkpoint than `last` (the resume goes on from it, and says which it skipped), a failed evaluation
    # to redo, or final/ to export: the resume has work
    if has_work_left(state, config, config.output_dir, last, bool(config.eval_steps)):
        return None
    step = state["step"]
    if is_main_process():
        warn_skipped(skipped)  # said here only when no resume follows to say it; by rank 0 alone under torchrun
        apply_save_limit(config.output_dir, config.save_total_limit, step)
    exported = f", exported to {Path(config.output_dir) / 'final'}" if config.export else ""
    return nothing_to_train(config.output_dir, f"{unit} {step} ({newest.name})", of + exported, field)


def check_export_before_load(config, dist) -> None:
    """A run about to train (not finished_run's) with export on: a final/ holding files its export would delete is
    refused now, before the model loads, not once the run is trained; rank 0 reads it, every process stops with its
    line."""
    if config.export:
        dist.check_final_exportable(config.output_dir)


def finished_sft(config, num_rows: int) -> str | None:
    """finished_run for an SFT run on num_rows rows (its last step: max_steps, or num_epochs passes)."""
    from fastgrpo.train.naming import setting
    from fastgrpo.train.sft import total_steps

    field = "max_steps" if config.max_steps else "num_epochs"
    last = total_steps(config, num_rows)
    return finished_at(config, last, "step", f"{last} ({setting(field, getattr(config, field))})", field)
