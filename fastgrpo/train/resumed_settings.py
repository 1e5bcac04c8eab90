"""What a --resume takes from the run it continues: each run-control setting (one that --resume lets change) that no
flag and no config file sets keeps the run's own value, read from its newest checkpoint's run_config.json. So
`fastgrpo train --output-dir run --resume` keeps the run's --save-total-limit (a default of 2 deleted the checkpoints a
run with `none` kept), its --max-steps, micro-batches, offload, rollout options and periodic evaluation."""
from __future__ import annotations

import dataclasses
import logging

from fastgrpo.train.checkpoint import CONFIG_FILE, list_checkpoints, read_run_config
from fastgrpo.train.config import run_control_fields
from fastgrpo.train.run_kind import written_by

logger = logging.getLogger(__name__)

# run-control settings a resume never takes from the run: how this invocation runs, not what the run was told (export:
# the invocation that ends the run writes final/ unless told not to, as a final/ of an earlier step is replaced then)
NOT_INHERITED = ("resume", "resume_allow_changes", "overwrite_output_dir", "output_dir", "device", "export")


def resumed_run_settings(config_class: type, merged: dict) -> tuple[dict, str | None]:
    """({field: the run's value} for each run-control field of config_class that `merged` (the config file's and
    the flags' settings) leaves unset, and the record they come from); ({}, None) where `merged` resumes nothing, the
    output folder holds no checkpoint with a record, or its run is another command's."""
    if not merged.get("resume"):
        return {}, None
    output_dir = merged.get("output_dir", _defaults(config_class).get("output_dir"))
    records = [path / CONFIG_FILE for _, path in list_checkpoints(output_dir) if (path / CONFIG_FILE).is_file()]
    if not records:
        return {}, None
    saved = read_run_config(records[-1].parent)
    if written_by(saved) not in (None, config_class.COMMAND):  # another command's run: the resume refuses it
        return {}, None
    taken = {name: saved[name] for name in run_control_fields(config_class)
             if name in saved and name not in merged and name not in NOT_INHERITED}
    return taken, str(records[-1])


def say_kept(taken: dict, record: str | None, config_class: type, preset: dict) -> None:
    """One line naming each setting resumed_run_settings took (from `record`) whose value differs from the one the run
    would take otherwise (the default, or the built-in task's preset)."""
    otherwise = _defaults(config_class) | preset
    kept = [f"{name} {value!r}" for name, value in taken.items() if value != otherwise.get(name)]
    if kept:
        logger.info("resume: keeping the run's %s (from %s; a flag or the config file sets another)", ", ".join(kept),
                    record)


def _defaults(config_class: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(config_class)}
