"""What every process of a torchrun launch must resolve alike, checked across them: each process reads the flags, the
config file and the output folder itself (a --resume's settings and checkpoint: resumed_settings, the trainers'
resume), so a folder that changes as they read it (a previous launch's process still saving its checkpoint) or that
each sees alone (a file system local to each machine) would have them train different runs into one folder, or wait
in collectives the others never join."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from fastgrpo.train.ranks import raised_on_every_process


def check_same_settings(dist, config) -> None:
    """The resolved config is the same on every process of `dist` (a Distributed); else a ValueError on every
    process naming the first setting that differs and its value on each."""
    if not dist.active:
        return
    # the fields as resolved (to_dict would fingerprint the model folder now, before it loads); repr: nan == nan
    found = dist.gather_objects({name: repr(value) for name, value in dataclasses.asdict(config).items()})
    differ = [name for name in found[0] if any(other.get(name) != found[0][name] for other in found[1:])]
    if differ:
        values = ", ".join(f"{other.get(differ[0])} on process {rank}" for rank, other in enumerate(found))
        raise raised_on_every_process(ValueError(
            f"{differ[0]}: expected the same value on every process, got {values}; each reads the flags, config file "
            "and output folder itself: start them again on one folder they all see as it stands"))


def check_same_checkpoint(dist, path: Path) -> None:
    """Every process of `dist` resumes from checkpoint `path` (each found it the newest that reads back); else a
    ValueError on every process naming what each found."""
    if not dist.active:
        return
    found = dist.gather_objects(str(path))
    if len(set(found)) > 1:
        each = ", ".join(f"{name} on process {rank}" for rank, name in enumerate(found))
        raise raised_on_every_process(ValueError(
            f"resume: expected one checkpoint on every process, got {each}; start them again on one folder they all "
            "see as it stands"))
