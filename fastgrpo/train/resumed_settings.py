"""What a --resume takes from the run it continues: each run-control setting (one that --resume lets change) that no
flag and no config file sets keeps the run's own value, read from its newest checkpoint's run_config.json. So
`fastgrpo train --output-dir run --resume` keeps the run's --save-total-limit (a default of 2 deleted the checkpoints a
run with `none` kept), its --max-steps, micro-batches, offload, rollout options and periodic evaluation.

The micro-batch is one process's memory setting: a resume under torchrun on more processes than the run had, where
the run's no longer divides each process's share of a minibatch, takes the largest one below it that does (said), so
the batch stays the run's and no process holds more at a time than the run's processes did."""
from __future__ import annotations

import dataclasses
import logging

from fastgrpo.train.checkpoint import CONFIG_FILE, list_checkpoints, read_run_config
from fastgrpo.train.config import run_control_fields
from fastgrpo.train.default_task import fit_micro_batch
from fastgrpo.train.naming import setting
from fastgrpo.train.run_kind import written_by

logger = logging.getLogger(__name__)

# run-control settings a resume never takes from the run: how this invocation runs, not what the run was told (export:
# the invocation that ends the run writes final/ unless told not to, as a final/ of an earlier step is replaced then)
NOT_INHERITED = ("resume", "resume_allow_changes", "overwrite_output_dir", "output_dir", "device", "export")


def resumed_run_settings(config_class: type, merged: dict, preset: dict, processes: int = 1) -> dict:
    """{field: the run's value} for each run-control field of config_class that `merged` (the config file's and the
    flags' settings) leaves unset, its micro_batch_size fitted to `processes` (torchrun's process count: the module
    docstring); said in a line where a value differs from the one the run would take otherwise (the default, or the
    built-in `preset`). {} where `merged` resumes nothing, the output folder holds no checkpoint with a record, or
    its run is another command's."""
    if not merged.get("resume"):
        return {}
    output_dir = merged.get("output_dir", _defaults(config_class).get("output_dir"))
    records = [path / CONFIG_FILE for _, path in list_checkpoints(output_dir) if (path / CONFIG_FILE).is_file()]
    if not records:
        return {}
    saved = read_run_config(records[-1].parent)
    if written_by(saved) not in (None, config_class.COMMAND):  # another command's run: the resume refuses it
        return {}
    taken = {name: saved[name] for name in run_control_fields(config_class)
             if name in saved and name not in merged and name not in NOT_INHERITED}
    fitted = _fitted_micro_batch(taken, {**saved, **merged}, processes)
    _say_kept({k: v for k, v in taken.items() if k not in fitted}, str(records[-1]), config_class, preset)
    return {**taken, **fitted}


def _fitted_micro_batch(taken: dict, settings: dict, processes: int) -> dict:
    """{"micro_batch_size": a lower one} where taken's (the run's) does not divide one of `processes` processes' share
    of the minibatch that `settings` (the run's, under the flags and config file) make, said; else {}."""
    run_value = taken.get("micro_batch_size")
    if not isinstance(run_value, int):
        return {}
    sizes = {name: settings[name] for name in ("batch_size", "num_minibatches") if name in settings}
    fitted = fit_micro_batch({"micro_batch_size": run_value}, sizes, processes)["micro_batch_size"]
    if fitted == run_value:
        return {}
    share = sizes["batch_size"] // sizes.get("num_minibatches", 1) // processes
    whose = f"each of the {processes} processes' share of a minibatch" if processes > 1 else "a minibatch"
    logger.info("resume: %s, not the run's %d, which does not divide %s (%d); the batch stays the run's (pass %s to "
                "choose another)", setting("micro_batch_size", fitted), run_value, whose, share,
                setting("micro_batch_size"))
    return {"micro_batch_size": fitted}


def _say_kept(taken: dict, record: str, config_class: type, preset: dict) -> None:
    """One line naming each setting taken from the run (from `record`) whose value differs from the one the run would
    take otherwise."""
    otherwise = _defaults(config_class) | preset
    kept = [f"{name} {value!r}" for name, value in taken.items() if value != otherwise.get(name)]
    if kept:
        logger.info("resume: keeping the run's %s (from %s; a flag or the config file sets another)", ", ".join(kept),
                    record)


def _defaults(config_class: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(config_class)}
