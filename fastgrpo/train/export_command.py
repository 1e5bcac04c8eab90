"""`fastgrpo export`: a run's checkpoint as a whole Hugging Face model folder, what the run's final/ holds at that
step (the LoRA adapter merged, tokenizer, generation_config, run_config.json, export.json: export_model), so a
mid-run checkpoint can start another run (`train --model`), be evaluated as a model, or go to transformers / vLLM.

The checkpoint loads as `fastgrpo eval --checkpoint` loads it: over the base model its run recorded (--model: that
model's new path), with the run's LoRA settings and seed, in the run's dtype unless --dtype. The output folder is
checked as a run's is (never inside a run's checkpoint-<step>/ or final/; a file or broken symlink there is one line),
must be new or empty, or (--overwrite-output-dir) hold another export's files only, and is written whole or not at
all (atomic_directory). A Ctrl-C or SIGTERM (cli's sigterm_as_ctrl_c) stops it with one line, exit 130 / 143, and
nothing new in place, one that a library swallowed too.
"""
from __future__ import annotations

import argparse
import contextlib
import types
from pathlib import Path

from fastgrpo.train.commands import check_checkpoint_base, config_from_args, trained_by
from fastgrpo.train.naming import setting
from fastgrpo.train.ranks import process_count

EXPORT_HELP = "write a run's checkpoint as an HF model folder, as its final/ (LoRA merged, tokenizer, run config)"
EXPORT_DESCRIPTION = (
    "Every ExportConfig field is a flag; flags override the YAML file given with --config. --checkpoint "
    "run/checkpoint-<step> (or run: its newest complete checkpoint) loads as `fastgrpo eval --checkpoint` loads it, "
    "and --output-dir receives what the run's final/ would hold at that step, for `fastgrpo train --model`, "
    "`fastgrpo eval --model`, transformers or vLLM."
)
_REQUIRED = {"checkpoint": "a run's checkpoint-<step>/ folder or its output_dir",
             "output_dir": "the folder to write the model to"}


def run_export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from fastgrpo.train.final_export import export_model
    from fastgrpo.train.eval_model import evaluated_model
    from fastgrpo.train.interrupts import stop_if_interrupted
    from fastgrpo.train.loading import tokenizer_before_load
    from fastgrpo.train.sources import check_model_source, resolve_device

    config = config_from_args("export", args)
    if (processes := process_count()) > 1:  # each would load the checkpoint and replace the same folder
        raise ValueError(f"export: runs in one process (torchrun launched {processes}); run `fastgrpo export` without "
                         "torchrun")
    for name, expected in _REQUIRED.items():
        if getattr(config, name) is None:
            raise ValueError(f"{name}: expected {expected}; pass {setting(name)}")
    resolve_device(config.device)
    if config.model is not None:
        check_model_source(config.model)
    checkpoint = _checkpoint(config.checkpoint)
    if config.model is not None:  # eval's checks of a base beside a checkpoint: not a checkpoint, not its own export
        trained_by({"model": config.model, "checkpoint": str(checkpoint)})
    check_checkpoint_base(checkpoint, config.model)
    base = evaluated_model(config.model, checkpoint)
    output = Path(config.output_dir)
    _check_not_the_base(output, base, checkpoint)
    with _output_folder(output):
        _check_output_contents(output, config.overwrite_output_dir, checkpoint)  # before the model loads
        tokenizer = tokenizer_before_load(base)
        model, run, step, loaded = _load(config, checkpoint, tokenizer)
        stop_if_interrupted()  # a Ctrl-C a library swallowed as the model loaded: before anything is written
        _check_output_contents(output, config.overwrite_output_dir, loaded)  # files put there as it loaded
        # the folder a symlink at output names is replaced, not the link (rmtree refuses one)
        export_model(model, tokenizer, output.resolve(), run_config=run, step=step)
    print(f"exported {loaded} (step {step}) to {output}")
    return 0


def _checkpoint(path: str) -> Path:
    """find_checkpoint's; a model folder (a run's final/) is one already: its refusal does not send it to --model,
    which here is a checkpoint's base."""
    from fastgrpo.train.loading import find_checkpoint

    try:
        return find_checkpoint(path)
    except ValueError:
        if (Path(path) / "config.json").is_file():
            raise ValueError(f"checkpoint: {path} is a model folder already, which transformers and "
                             f"{setting('model')} load as it is; pass a run's checkpoint-<step>/ folder or its "
                             "output_dir") from None
        raise


def _load(config, checkpoint: Path, tokenizer):
    """(model, run config, step, the checkpoint loaded) as eval loads a checkpoint (load_evaluated_model: a run
    still training may prune it as it loads, and then its newest is taken), in the run's dtype unless --dtype."""
    from fastgrpo.train.checkpoint import read_checkpoint, read_run_config
    from fastgrpo.train.eval_model import load_evaluated_model
    from fastgrpo.train.sources import naming_the_model

    run = read_run_config(checkpoint)
    # the seed builds the built-in model's base weights, as the run built them (load_inference_model takes the run's)
    loading = types.SimpleNamespace(model=config.model, checkpoint=config.checkpoint, device=config.device,
                                    dtype=exported_dtype(config.dtype, run), seed=run.get("seed", 0))
    with naming_the_model(config.model):
        model, source = load_evaluated_model(loading, checkpoint, tokenizer)
    loaded = Path(source["checkpoint"])
    return model, read_run_config(loaded), read_checkpoint(loaded, mmap=True)["step"], loaded


def exported_dtype(dtype: str | None, run: dict) -> str:
    """The dtype an export loads and writes the model in: `dtype` (--dtype), else (none or auto) the one the run
    trained in, as its final/ holds it: its "auto" as it resolved where it trained (a GPU run's bfloat16), not here
    (a CPU's float32); a run recorded before that was kept: its dtype resolved here."""
    from fastgrpo.train.config_file import DTYPE_KEY

    if dtype not in (None, "auto"):
        return dtype
    return run.get(DTYPE_KEY) or run.get("dtype", "auto")


@contextlib.contextmanager
def _output_folder(output: Path):
    """The output folder, checked and created as a run's (RunDirectory's messages); one created here and left empty
    (the export failed) is removed."""
    from fastgrpo.train.run_dir import check_outside_run_folders, make_output_folder

    check_outside_run_folders(output)
    created = make_output_folder(output)
    try:
        yield
    finally:
        if created:
            with contextlib.suppress(OSError):  # not empty: the export took its place
                output.rmdir()


def _check_output_contents(output: Path, overwrite: bool, checkpoint: Path) -> None:
    """An export replaces its whole folder: an empty one, or (overwrite) one holding another export's files only."""
    from fastgrpo.train.final_export import EXPORT_FILE, check_export_replaceable

    found = sorted(path.name for path in output.iterdir())
    if not found:
        return
    if overwrite:
        check_export_replaceable(output, f"exporting {checkpoint.name}")
        return
    names = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    replace = f", or replace that export with {setting('overwrite_output_dir', True)}" \
        if (output / EXPORT_FILE).is_file() else ""
    raise ValueError(f"output_dir: {output} is not empty ({names}); pick another {setting('output_dir')}{replace}")


def _check_not_the_base(output: Path, base: str | None, checkpoint: Path) -> None:
    """The base model a checkpoint loads over is never replaced by an export of it (--overwrite-output-dir)."""
    if base is not None and Path(base).exists() and Path(base).resolve() == output.resolve():
        raise ValueError(f"output_dir: {output} is the base model of {checkpoint}'s run, which its checkpoints load "
                         f"over; pick another {setting('output_dir')}")
