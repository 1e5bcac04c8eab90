"""Which command wrote a checkpoint: `--resume` continues a run of its own kind only.

A checkpoint's run config holds its config's fields, and each command's config has fields the others lack: MARKERS
names one per command (tests/test_config.py checks that each is its own config's field and no other's)."""
from __future__ import annotations

from fastgrpo.train.naming import continuing, setting

MARKERS = {"train": "beta", "sft": "max_seq_length", "ei": "correct_threshold"}


def written_by(saved: dict) -> str | None:
    """The command whose marker field `saved` (a checkpoint's run config) holds; None when not exactly one does."""
    found = [command for command, field in MARKERS.items() if field in saved]
    return found[0] if len(found) == 1 else None


def check_same_command(saved: dict, config, checkpoint: str) -> None:
    """A ValueError when `saved` is another command's run than `config`'s."""
    theirs, ours = written_by(saved), config.COMMAND
    if theirs is not None and theirs != ours:
        raise ValueError(f"resume: {checkpoint} is a `fastgrpo {theirs}` run, not a `fastgrpo {ours}` run; continue "
                         f"it with {continuing(theirs)}, or pick another {setting('output_dir')}")
