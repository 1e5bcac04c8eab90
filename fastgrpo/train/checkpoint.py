"""Checkpoints for exact resume, and export of the trained model as a Hugging Face directory.

A checkpoint `<output_dir>/checkpoint-<step>/` holds `trainer_state.pt` (the trainable parameters, optimizer,
LR scheduler, RNG states, step, data position, beta, the resolved config), `run_config.json` (the same config,
readable without loading the state) and, for LoRA, the adapter in PEFT's format. Loading it restores every tensor
bit for bit, so N straight steps equal k steps + resume + N - k steps.

Safety: a checkpoint is written into a hidden sibling folder, fsynced and renamed into place, so a kill leaves
either the whole checkpoint or none (`.checkpoint-*` leftovers are not checkpoints). The state is read with
`torch.load(weights_only=True)`: tensors and plain containers only, so a crafted file cannot run code. A checkpoint
that still fails to load (torn by a file system without atomic rename, a disk error, a copy cut short; an FSDP2
run's shards/ checked against its .metadata) raises TornCheckpoint, and `load_latest_checkpoint` falls back to the next
older one with a warning.

A run's export `<output_dir>/final/` (export_model) records the step of its weights and the files it wrote
(`export.json`): a resumed run writes it again unless it is of the run's last step (export_due); an export that would
delete files the user put in it is refused, at the start of a run that will export (check_final_exportable) and at its
end.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import fnmatch
import json
import logging
import os
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from fastgrpo.hf.models import is_peft_model
from fastgrpo.hf.peft import merged_state_dict
from fastgrpo.train.config_file import RUN_RECORD
from fastgrpo.train.naming import setting
from fastgrpo.train.sharded_state import SHARDS, damaged_shards, load_sharded_state

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = RUN_RECORD  # the run's config, beside a checkpoint's state and an export's weights
EXPORT_FILE = "export.json"  # in a run's final/: the step of its weights, the files the export wrote
# The names of the files a model export holds (weights, config, tokenizer): in a final/ exported before EXPORT_FILE,
# any other file is the user's.
_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*", CONFIG_FILE)
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")
# A state's key for the metrics of its step (round), whose periodic evaluation failed after the update: the resumed run
# evaluates that step first, as its settings say it is due, and writes the step's metrics line again, whole.
UNEVALUATED = "unevaluated"
_NEARLY_FULL = 2**20  # bytes free on a disk where a write failed: it failed for want of space


class TornCheckpoint(Exception):
    """A checkpoint folder whose state cannot be read back (incomplete or damaged)."""


def rng_states() -> dict:
    """Python, torch and CUDA RNG states as tensors and plain lists (loadable with weights_only=True)."""
    version, state, gauss = random.getstate()
    states = {"python": [version, list(state), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a hidden temporary sibling of `path` to fill; once the block ends without an error it is fsynced
    and renamed to `path` (replacing a previous one), so readers see the whole folder or the old one. A write that
    fails as the disk fills up is an OSError saying so (_raise_if_disk_full)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            yield tmp
        except Exception as err:
            _raise_if_disk_full(path, err)
            raise
        for file in tmp.rglob("*"):
            if file.is_file():
                _fsync(file)
        _fsync(tmp)
        if path.exists():
            # Two renames, not rmtree first: the old folder stays whole until the new one is in place.
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_if_disk_full(path: Path, err: Exception) -> None:
    """A one-line OSError for a write into `path` that failed as its disk filled up, which torch.save reports as
    "unexpected pos 573632 vs 573524" and safetensors as "Error while serializing" (a traceback at the command line)."""
    if shutil.disk_usage(path.parent).free < _NEARLY_FULL:
        full = OSError(f"{path.name}: not written, the disk of {path.parent} is full; make room and run again "
                       f"({setting('resume', True)} continues from the last checkpoint)")
        full.errno = errno.ENOSPC
        raise full from err


def save_checkpoint(path: str | Path, model: torch.nn.Module, state: dict) -> Path:
    """Write `state` (optimizer, scheduler, step, config, ...) plus the trainable parameters and RNG states (taken
    now unless state["rng"] holds earlier ones) to the folder `path`, atomically."""
    path = Path(path)
    trainable = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    state = {**state, "trainable": trainable, "rng": state.get("rng") or rng_states()}
    with atomic_directory(path) as tmp:
        torch.save(state, tmp / STATE_FILE)
        if "config" in state:
            write_run_config(tmp, state["config"])
        if is_peft_model(model):
            model.save_pretrained(tmp)  # the adapter alone, loadable with PeftModel.from_pretrained
    return path


def read_checkpoint(path: str | Path, mmap: bool = False) -> dict:
    """The saved state of checkpoint folder `path` (tensors on the CPU; mmap: memory-mapped, not read), without
    touching any model.

    Raises TornCheckpoint when the file (or, for an FSDP2 run's, its shards/) is incomplete or damaged, ValueError
    when it holds anything but tensors and plain containers (refused: unpickling it could run code)."""
    state = _load_state(Path(path) / STATE_FILE, mmap=mmap)
    if isinstance(state, dict) and state.get("sharded"):
        problem = damaged_shards(Path(path) / SHARDS)
        if problem is not None:
            raise TornCheckpoint(f"{Path(path) / SHARDS}: {problem}")
    return state


def read_run_config(path: str | Path) -> dict:
    """The resolved config of the run that wrote checkpoint folder `path`: its run_config.json, or (a checkpoint
    from before that file) the state's "config", memory-mapped so the weights are not read. A damaged state is a
    ValueError naming it."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return _config_json(path / CONFIG_FILE, "checkpoint", "restore it, or delete it to read the config saved "
                                                              "with the weights")
    file = path / STATE_FILE
    try:
        state = _load_state(file, mmap=True)
    except TornCheckpoint as err:
        if not file.exists():  # deleted as it was read (a live run prunes its checkpoints): its callers' case
            raise FileNotFoundError(str(err)) from None
        raise ValueError(f"checkpoint: cannot read {err}") from None
    config = state.get("config") if isinstance(state, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"checkpoint: {path / STATE_FILE} holds no run config")
    return config


def _load_state(file: Path, mmap: bool = False) -> dict:
    """torch.load of a trainer state with weights_only. A file that is no zip archive (torch.save writes one) is
    damaged, TornCheckpoint: torch reads it as a legacy pickle, whose garbage it reported as objects other than
    tensors, the refusal of a crafted file."""
    try:
        if file.exists() and not zipfile.is_zipfile(file):
            zipfile.ZipFile(file)  # raises BadZipFile, whose message names the problem
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except zipfile.BadZipFile as err:
        raise TornCheckpoint(f"{file}: not a file torch.save wrote ({err})") from None
    except pickle.UnpicklingError as err:
        if "weights_only" in str(err) or "Weights only" in str(err):
            raise ValueError(f"checkpoint: {file} holds objects other than tensors and plain containers; refused, "
                             "since loading it could run code (was it written by fastgrpo?)") from None
        raise TornCheckpoint(f"{file}: {str(err).splitlines()[0]}") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise TornCheckpoint(f"{file}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def read_exported_run_config(folder: str | Path) -> dict | None:
    """The run config an export wrote beside its model (export_model's run_config), None where there is none."""
    file = Path(folder) / CONFIG_FILE
    if not file.is_file():
        return None
    return _config_json(file, "model", "restore it, or delete it (it only tells `fastgrpo eval` how the run "
                                       "prompted; the model does not need it)")


def _config_json(file: Path, field: str, remedy: str) -> dict:
    """A run config file's {field: value} mapping; a damaged one is a one-line ValueError naming `field`."""
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        problem = f"{err.msg}, line {err.lineno}"
    else:
        if isinstance(config, dict):
            return config
        problem = f"a JSON {type(config).__name__}, not an object"
    raise ValueError(f"{field}: {file} is damaged ({problem}); {remedy}")


def restore_checkpoint(state: dict, model: torch.nn.Module) -> dict:
    """Copy the saved trainable parameters of `state` (from read_checkpoint) into `model`, restore the RNG states;
    return the rest of the state."""
    params = dict(model.named_parameters())
    saved = state["trainable"]
    missing = sorted(set(saved) - set(params))
    if missing:
        raise ValueError(f"checkpoint: parameters {missing[:3]} are not in the model; was it built the same way?")
    untrained = sorted(n for n, p in params.items() if p.requires_grad and n not in saved)
    if untrained:
        raise ValueError(f"checkpoint: lacks the model's trainable parameters {untrained[:3]}; "
                         "was it built the same way?")
    # copy_ would broadcast e.g. a rank-1 LoRA A [1, H] into a rank-4 one [4, H] without a word
    shapes = [(n, tuple(v.shape), tuple(params[n].shape)) for n, v in saved.items() if v.shape != params[n].shape]
    if shapes:
        name, got, want = shapes[0]
        raise ValueError(f"checkpoint: parameter {name} has shape {got}, the model's has {want}; "
                         "was it built the same way?")
    state = dict(state)
    with torch.no_grad():
        for name, value in state.pop("trainable").items():
            params[name].copy_(value)
    set_rng_states(state.pop("rng"))
    return state


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict:
    """read_checkpoint + restore_checkpoint: load `path` into `model` and the RNGs; return the rest of the state. The
    checkpoint of a run that sharded its weights over processes (FSDP2: Distributed Checkpoint's files in shards/)
    loads whole into this process's model."""
    state = read_checkpoint(path)
    if not state.get("sharded"):
        return restore_checkpoint(state, model)
    load_sharded_state(Path(path) / SHARDS, model, None)
    state = dict(state)
    set_rng_states(state.pop("rng"))
    return state


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of each checkpoint-<step> with a trainer state, oldest first."""
    return [(step, p) for step, p in _checkpoint_folders(output_dir) if (p / STATE_FILE).exists()]


def _checkpoint_folders(output_dir: str | Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*") if (m := _CHECKPOINT.search(p.name))]
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def load_latest_checkpoint(output_dir: str | Path) -> tuple[Path, dict]:
    """(folder, state) of the newest checkpoint of output_dir that reads back; torn ones are skipped with a
    warning. ValueError when there is none."""
    path, state, skipped = newest_readable_checkpoint(output_dir)
    for line in skipped:
        logger.warning(line)
    return path, state


def newest_readable_checkpoint(output_dir: str | Path, mmap: bool = False) -> tuple[Path, dict, list[str]]:
    """The checkpoint a resume loads: (folder, state) of the newest checkpoint of output_dir that reads back (mmap:
    its tensors memory-mapped, not read), and the warning for each newer one skipped as incomplete or damaged,
    for the caller to say. ValueError when none reads back (the warnings said first, as the error points to them)."""
    found = list_checkpoints(output_dir)
    if not found:
        raise ValueError(f"resume: no checkpoint-<step> with a trainer state in {output_dir}; start without "
                         f"{setting('resume', True)} (with {setting('overwrite_output_dir', True)} where a run left "
                         "files there before its first checkpoint)")
    skipped = []
    for _, path in reversed(found):
        try:
            return path, read_checkpoint(path, mmap=mmap), skipped
        except TornCheckpoint as err:
            skipped.append(f"resume: skipped {path.name}, which is incomplete or damaged ({err})")
    for line in skipped:
        logger.warning(line)
    raise ValueError(f"resume: every checkpoint in {output_dir} is incomplete or damaged (see the warnings)")


def prune_checkpoints(output_dir: str | Path, keep: int | None, newest: int) -> list[Path]:
    """After checkpoint-<newest> is written: delete every checkpoint of a later step, and all but the newest `keep`
    of the others (None: keep all); returns the deleted folders. A later step's checkpoint is of the history a resume
    went back over (it fell back past a damaged one): kept, it would outrank this run's own checkpoints in the
    rotation and take the next --resume back to that history."""
    found = _checkpoint_folders(output_dir)
    abandoned = [path for step, path in found if step > newest]
    kept = [path for step, path in found if step <= newest and (path / STATE_FILE).exists()]
    doomed = abandoned + (kept[:-keep] if keep is not None and len(kept) > keep else [])
    for path in abandoned:
        logger.warning("checkpoint: deleted %s, left by the steps this run went back over when it resumed", path.name)
    for path in doomed:
        _delete_folder(path)
    return doomed


def _delete_folder(path: Path) -> None:
    """rmtree, after a rename to a partial write's hidden name: a kill in the middle of it leaves no checkpoint-<step>
    lacking files (one without its state, which no prune deletes again), but a leftover that a resume deletes."""
    hidden = path.with_name(f".{path.name}.old-{os.getpid()}")
    os.replace(path, hidden)
    shutil.rmtree(hidden)


def nothing_to_train(output_dir: str | Path, where: str, of: str, field: str, export_step: int | None = None) -> str:
    """The line for a resumed run at its last step already (`where`: "step 40", `of`: its limit, as the user set
    it), naming the setting to raise; the CLI prints it, the Python trainers warn it (train() returns []).
    export_step: the step of the run's weights, where export is on: a final/ not of it (export_due) is the work left,
    which the line says instead."""
    final = Path(output_dir) / "final"
    if export_step is not None and _exported_step(final) != export_step:
        left = "holds another point's weights" if final.is_dir() else "is missing"
        return f"nothing to train: the run in {output_dir} is at {where} of {of}; exporting it to {final}, which {left}"
    return (f"nothing to train: the run in {output_dir} is at {where} of {of}; pass a larger {setting(field)} to "
            "train on")


def _exported_step(final: Path) -> int | None:
    """The step of final/'s weights as its export recorded it; None where it is missing, unrecorded or damaged
    (export_due says what a damaged record stops)."""
    if not final.is_dir():
        return None
    try:
        return _export_record(final).get("step")
    except ValueError:
        return None


def export_due(output_dir: str | Path, step: int, trained: bool) -> bool:
    """Whether a run's end at `step` (export on) writes final/: not when this call trained nothing and final/ holds
    that step's weights already (a finished run resumed keeps it: the same weights, and the files the user put beside
    them); a final/ of an earlier step (the run went on with export off, or stopped before its export) is written
    again. A ValueError where that would delete files the export did not write: they are the user's to move."""
    final = Path(output_dir) / "final"
    if not final.is_dir():
        return True
    record = _export_record(final)
    if not trained and record.get("step") == step:
        return False
    _refuse_users_files(final, record, f"exporting checkpoint-{step}",
                        f"resume ({setting('resume', True)}) to export it")
    return True


def check_final_exportable(output_dir: str | Path) -> None:
    """For a run with steps left to train and export on, before the first: export_due's refusal of the files the
    user put in final/, said now rather than once the run is trained (files put there during the run are still
    refused at its end)."""
    final = Path(output_dir) / "final"
    if final.is_dir():
        _refuse_users_files(final, _export_record(final), "exporting the run's last step", "start the run again")


def check_final_overwritable(output_dir: str | Path) -> None:
    """For overwrite_output_dir, before it deletes the previous run: the files the user put in its final/ are refused
    as an export refuses them (the refusal of a fresh run named final/, the export, among the files it deletes)."""
    final = Path(output_dir) / "final"
    if final.is_dir():
        _refuse_users_files(final, _export_record(final), "starting afresh",
                            f"start afresh with {setting('overwrite_output_dir', True)}", field="overwrite_output_dir")


def check_export_replaceable(folder: Path, exporting: str) -> None:
    """For `fastgrpo export --overwrite-output-dir`: the files of the model folder it replaces that no export wrote
    are refused, as check_final_overwritable refuses them in a run's final/."""
    _refuse_users_files(folder, _export_record(folder), exporting,
                        f"export again with {setting('overwrite_output_dir', True)}", field="overwrite_output_dir")


def _refuse_users_files(final: Path, record: dict, exporting: str, then: str, field: str = "export") -> None:
    """A ValueError naming the files in final/ its export did not write (they are the user's to move), which
    `exporting` there would delete; `then`: what to do once they are moved; `field`: the setting that would."""
    foreign = _not_exported(final, record)
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{field}: {final} holds files the export did not write ({listed}), which {exporting} "
                         f"there would delete; move them out of it, then {then}")


def warn_stale_export(output_dir: str | Path, step: int) -> None:
    """For a run at `step` that did not export (export off): a final/ of another step is an earlier export of the
    run it continued."""
    final = Path(output_dir) / "final"
    if final.is_dir() and _export_record(final).get("step") != step:
        logger.warning("export: %s holds the weights of an earlier point of this run, not its last step's (export is "
                       "off: %s)", final, setting("export", False))


def _write_export_record(folder: Path, step: int) -> None:
    """EXPORT_FILE in an export being filled: the run's step its weights are of, and every file in `folder` (so
    call it last), which export_due tells from files put there later."""
    record = {"step": step, "files": [*_files(folder), EXPORT_FILE]}
    (folder / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _files(folder: Path) -> list[str]:
    """Every file under `folder`, as sorted paths relative to it."""
    return sorted(file.relative_to(folder).as_posix() for file in folder.rglob("*") if file.is_file())


def _export_record(final: Path) -> dict:
    """final/'s EXPORT_FILE; {} for one exported before the record was written (its step is unknown)."""
    file = final / EXPORT_FILE
    if not file.is_file():
        return {}
    return _config_json(file, "export", "delete it, and the next resume exports final/ again")


def _not_exported(final: Path, record: dict) -> list[str]:
    """The files in final/ its export did not write: those its record does not list, or (no record) those whose
    names a model folder does not use."""
    files = _files(final)
    if isinstance(record.get("files"), list):
        return [name for name in files if name not in record["files"]]
    return [name for name in files if not any(fnmatch.fnmatchcase(name, pattern) for pattern in _MODEL_FILES)]


def write_run_config(folder: Path, config: dict) -> None:
    """The run's resolved config as CONFIG_FILE in `folder` (a checkpoint, or an exported model: read_run_config)."""
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def export_model(model: torch.nn.Module, tokenizer, path: str | Path, dtype: torch.dtype | None = None,
                 run_config: dict | None = None, step: int | None = None) -> Path:
    """Save an HF model directory (weights, config, tokenizer), atomically. A LoRA model is merged and saved in
    `dtype` (None: merged_dtype's); a fully fine-tuned model is saved as it is, in its own dtype. run_config: the
    run's config, saved beside
    (CONFIG_FILE), so that `fastgrpo eval --model` on the folder prompts as the run did; step: the run's step of the
    weights, recorded with the files written (EXPORT_FILE: export_due); transformers ignores both."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    with atomic_directory(path) as tmp:
        if not is_peft_model(model):
            model.save_pretrained(tmp)
        else:
            config = model.get_base_model().config
            config = config.__class__.from_dict(
                {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
            )
            dtype = dtype or merged_dtype(model)
            with torch.device("meta"):
                fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
            fresh.load_state_dict(merged_state_dict(model, dtype), strict=False, assign=True)
            fresh.tie_weights()
            # from_config derives one from config.json: the base's own (an end-of-turn EOS, sampling defaults) goes
            fresh.generation_config = copy.deepcopy(model.get_base_model().generation_config)
            missing = [n for n, p in fresh.named_parameters() if p.is_meta]
            if missing:
                raise ValueError(f"model: merged weights lack {missing[:3]}; unsupported adapter layout")
            fresh.save_pretrained(tmp)
        finish_export(tmp, tokenizer, run_config, step)
    return path


def merged_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a LoRA model's merged weights are saved in: the one its base loaded in (its embedding's, which PEFT's
    fp32 adapters do not change, and a 4-bit base leaves unquantized), as PEFT's merge_and_unload keeps it: the run's
    dtype, so an fp32 run exports fp32 and a 4-bit base's weights dequantize to its compute dtype."""
    return model.get_base_model().get_input_embeddings().weight.dtype


def finish_export(folder: Path, tokenizer, run_config: dict | None, step: int | None) -> None:
    """What an export being filled holds beside the weights: the tokenizer, the run's config (CONFIG_FILE) and, last,
    the record of the step and every file written (EXPORT_FILE)."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if run_config is not None:
        write_run_config(folder, run_config)
    if step is not None:
        _write_export_record(folder, step)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
