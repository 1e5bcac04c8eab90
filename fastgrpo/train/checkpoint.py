"""Checkpoints for exact resume: writing, pruning and reading them back.

A checkpoint `<output_dir>/checkpoint-<step>/` holds `trainer_state.pt` (the trainable parameters, optimizer,
LR scheduler, RNG states, step, data position, beta, the resolved config), `run_config.json` (the same config,
readable without loading the state) and, for LoRA, the adapter in PEFT's format. Loading it restores every tensor
bit for bit, so N straight steps equal k steps + resume + N - k steps.

Safety: a checkpoint is written into a hidden sibling folder, fsynced and renamed into place (atomic_folder), so a kill
leaves either the whole checkpoint or none (`.checkpoint-*` leftovers are not checkpoints). The state is read with
`torch.load(weights_only=True)`: tensors and plain containers only, so a crafted file cannot run code. A checkpoint
that still fails to load (torn by a file system without atomic rename, a disk error, a copy cut short; an FSDP2
run's shards/ checked against its .metadata) raises TornCheckpoint, and `load_latest_checkpoint` falls back to the next
older one with a warning. The export of a run's final/ is fastgrpo.train.final_export's.
"""
from __future__ import annotations

import json
import logging
import pickle
import random
import re
import zipfile
from pathlib import Path

import torch

from fastgrpo.hf.models import is_peft_model
from fastgrpo.train.atomic_folder import atomic_directory, delete_folder
from fastgrpo.train.config_file import RUN_RECORD
from fastgrpo.train.naming import setting
from fastgrpo.train.sharded_state import SHARDS, damaged_shards, load_sharded_state

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = RUN_RECORD  # the run's config, beside a checkpoint's state and an export's weights
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")
# A state's key for the metrics of its step (round), whose periodic evaluation failed after the update: the resumed run
# evaluates that step first, as its settings say it is due, and writes the step's metrics line again, whole.
UNEVALUATED = "unevaluated"


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
        return read_json_object(path / CONFIG_FILE, "checkpoint", "restore it, or delete it to read the config saved "
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


def read_json_object(file: Path, field: str, remedy: str) -> dict:
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
    warn_skipped(skipped)
    return path, state


def warn_skipped(lines: list[str]) -> None:
    """Say newest_readable_checkpoint's lines for the checkpoints a resume skipped."""
    for line in lines:
        logger.warning(line)


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
    warn_skipped(skipped)
    raise ValueError(f"resume: every checkpoint in {output_dir} is incomplete or damaged (see the warnings)")


def prune_checkpoints(output_dir: str | Path, keep: int | None, newest: int, since: int | None = None) -> list[Path]:
    """After checkpoint-<newest> is written: delete every checkpoint of a later step, and of a step between `since`
    (the run's previous checkpoint, written or resumed from; None: unknown) and newest, and all but the newest `keep`
    of the others (None: keep all); returns the deleted folders. Those are of the history a resume went back over (it
    fell back past a damaged one): kept, a later one would outrank this run's own checkpoints in the rotation and take
    the next --resume back to that history, one between would count in the limit in place of a readable one."""
    abandoned = [path for step, path in _checkpoint_folders(output_dir)
                 if step > newest or (since is not None and since < step < newest)]
    doomed = abandoned + _past_limit(output_dir, keep, newest, abandoned)
    for path in abandoned:
        logger.warning("checkpoint: deleted %s, left by the steps this run went back over when it resumed", path.name)
    for path in doomed:
        delete_folder(path)
    return doomed


def apply_save_limit(output_dir: str | Path, keep: int | None, newest: int) -> None:
    """For a resumed run with nothing to train, at checkpoint-<newest>: it saves no checkpoint, after which the
    limit applies, so a save_total_limit lowered since applies now; what it deletes is said. A later (damaged)
    checkpoint stays, as the resume skipped it: a run deletes one once it has saved its own (prune_checkpoints)."""
    doomed = _past_limit(output_dir, keep, newest)
    for path in doomed:
        delete_folder(path)
    if doomed:
        logger.info("save_total_limit: deleted %s, past the newest %s checkpoint(s) the limit keeps",
                    ", ".join(path.name for path in doomed), keep)


def _past_limit(output_dir: str | Path, keep: int | None, newest: int, abandoned: list[Path] = ()) -> list[Path]:
    """The checkpoints of steps up to `newest` but the newest `keep` (None: keep all), those `abandoned` (deleted
    anyway) not counted."""
    kept = [path for step, path in list_checkpoints(output_dir) if step <= newest and path not in abandoned]
    return kept[:-keep] if keep is not None and len(kept) > keep else []


def write_run_config(folder: Path, config: dict) -> None:
    """The run's resolved config as CONFIG_FILE in `folder` (a checkpoint, or an exported model: read_run_config)."""
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")

