"""The weights and optimizer state of an FSDP2 run in Distributed Checkpoint's format: checkpoint-<step>/shards,
written by every process of the run (each its shard) and read back by any number of processes, or by one process
without a process group (`fastgrpo eval --checkpoint`), which loads them whole."""
from __future__ import annotations

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
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    saved = sharded_state(model, optimizer)
    stored = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    for fqn, param_state in saved.get("optimizer", {}).get("state", {}).items():
        for key in [k for k in param_state if f"optimizer.state.{fqn}.{k}" not in stored]:
            del param_state[key]
    with warnings.catch_warnings():  # without a process group: whole, into one process (`fastgrpo eval`), as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(saved, checkpoint_id=shards)
    if optimizer is None:
        set_model_state_dict(model, saved["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])


def sharded_state(model: torch.nn.Module, optimizer) -> dict:
    """What Distributed Checkpoint saves of an FSDP2 run: {"model": its shards, "optimizer": the optimizer's}, or
    the model's alone when there is no optimizer (expert iteration starts a fresh one each round)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}
