"""The weights and optimizer state of an FSDP2 run in Distributed Checkpoint's format: checkpoint-<step>/shards,
written by every process of the run (each its shard) and read back by any number of processes, or by one process
without a process group (`fastgrpo eval --checkpoint`), which loads them whole."""
from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch

SHARDS = "shards"  # the Distributed Checkpoint folder inside checkpoint-<step>/ (FSDP2)


def load_sharded_state(shards: Path, model: torch.nn.Module, optimizer) -> None:
    """Load the weights and optimizer state Distributed Checkpoint wrote to `shards` into model and optimizer (None:
    the weights alone, as expert iteration saves them). An optimizer state this run keeps but the checkpoint lacks
    (StochasticRoundingAdamW's fp32 `master` of offloaded weights, when the run that wrote it stepped on the GPU) is
    left out of the load; the optimizer's load_state_dict then derives it from the loaded weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    saved = sharded_state(model, optimizer)
    stored = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    for fqn, param_state in saved.get("optimizer", {}).get("state", {}).items():
        for key in [k for k in param_state if f"optimizer.state.{fqn}.{k}" not in stored]:
            del param_state[key]
    with warnings.catch_warnings():  # without a process group: whole, into one process (`fastgrpo eval`), as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        try:
            dcp.load(saved, checkpoint_id=shards)
        except CheckpointException as err:  # a BaseException: it passed every handler as a traceback
            raise ValueError(f"checkpoint: cannot load {shards} ({_first_failure(err)})") from None
    if optimizer is None:
        set_model_state_dict(model, saved["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])


def damaged_shards(shards: Path) -> str | None:
    """What is wrong with the Distributed Checkpoint folder `shards` (its .metadata unreadable, a file it names missing
    or shorter than the bytes it names there: a copy cut short, `cp shards/*` leaving .metadata behind), in a few
    words; None when nothing is. Checked before a load, whose failures are a traceback from every process."""
    import torch.distributed.checkpoint as dcp

    try:
        stored = dcp.FileSystemReader(str(shards)).read_metadata().storage_data
    except FileNotFoundError:
        return "no .metadata" if shards.is_dir() else "no shards folder"
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        return f".metadata unreadable ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in stored.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = shards / name
        if not file.is_file():
            return f"no {name}"
        if file.stat().st_size < size:
            return f"{name} holds {file.stat().st_size} of its {size} bytes"
    return None


def _first_failure(err) -> str:
    """The first sentence of the error one process of a failed Distributed Checkpoint load raised (torch's
    weights-only refusal goes on to suggest weights_only=False, not for a damaged file)."""
    failure = next(iter(err.failures.values()), err)
    failure = failure[0] if isinstance(failure, tuple) else failure
    line = next((line for line in str(failure).splitlines() if line.strip()), type(failure).__name__)
    return line.split(". ")[0].rstrip(".")


def sharded_state(model: torch.nn.Module, optimizer) -> dict:
    """What Distributed Checkpoint saves of an FSDP2 run: {"model": its shards, "optimizer": the optimizer's}, or
    the model's alone when there is no optimizer (expert iteration starts a fresh one each round)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}
