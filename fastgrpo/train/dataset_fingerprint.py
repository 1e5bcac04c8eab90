"""A fingerprint of a run's local dataset (and eval_dataset, where it evaluates), kept in the run's record
(ConfigFile.to_dict: FINGERPRINT_KEY), so that `--resume` after the file was edited says that the resumed steps draw
from other rows than the checkpoint's steps did: one run mixing two datasets is not gone on with in silence. A
warning, not a refusal: fixing a typo in a row and resuming is a user's call.

What is hashed: the bytes of the file, or of every file in the folder (a folder of data files, or one save_to_disk
wrote), not the rows read: the record is written from the config, which holds no rows; the bytes cover every column
(the answers rewards read as well as the prompts) in every format alike; and hashing costs one more read of what the
loader reads whole anyway. Reformatting a file without changing a row is said too. A Hub dataset has none: its rows
are the revision datasets' cache holds, which this record cannot see. A file over _WHOLE_UP_TO bytes is sampled
instead (its size and _SAMPLES windows spread over it), so that a run over a large corpus does not start by reading
all of it once more: an edit that keeps such a file's size and falls between the windows is not seen.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
FINGERPRINT_KEY = "dataset_fingerprint"  # in a run's record: {field: hash} of each local dataset the run read
_CHUNK = 1 << 20
_WHOLE_UP_TO = 256 << 20  # bytes of a file hashed whole; a larger one is sampled
_SAMPLES = 64  # windows of _CHUNK bytes sampled from a larger file, its first and last among them
_READ_BY = {"dataset": "the resumed steps draw from", "eval_dataset": "the resumed evaluations read"}


def fingerprint(dataset: str | None) -> str | None:
    """A hash of the bytes of the local file or folder `dataset` (a file with its suffix, the format it is read as;
    a folder's files by relative name, hidden ones left out); None for a Hub name or no dataset (the built-in rows)."""
    if dataset is None:
        return None
    path = Path(dataset).expanduser()
    if path.is_file():  # its suffix, not its name: the same rows moved or copied under another name are the same
        files = [(path.suffix, path)]
    elif path.is_dir():
        files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for name, file in files:
        size = file.stat().st_size
        digest.update(f"{name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            if size <= _WHOLE_UP_TO:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
                continue
            for i in range(_SAMPLES):
                handle.seek((size - _CHUNK) * i // (_SAMPLES - 1))
                digest.update(handle.read(_CHUNK))
    return digest.hexdigest()


def _read_fields(config) -> tuple[str, ...]:
    """The dataset fields of `config` whose rows the run reads: eval_dataset only where it evaluates (eval_steps)."""
    return ("dataset", "eval_dataset") if getattr(config, "eval_steps", 0) else ("dataset",)


def recorded_fingerprint(config) -> dict[str, str] | None:
    """{field: fingerprint} of config's local datasets, as the run's record keeps them: taken at its first record (a
    trainer's construction, the rows read) and kept for the config's life; None where none is local."""
    names = tuple((field, getattr(config, field, None)) for field in _read_fields(config))
    taken = config.__dict__.get("_dataset_fingerprint")
    if taken is None or taken[0] != names:
        by_name = {name: fingerprint(name) for name in dict.fromkeys(name for _, name in names)}  # one read a file
        prints = {field: by_name[name] for field, name in names}
        taken = config.__dict__["_dataset_fingerprint"] = (names, {k: v for k, v in prints.items() if v})
    return taken[1] or None


def warn_changed_datasets(saved: dict, config, checkpoint: str) -> None:
    """A warning line for each dataset whose recorded fingerprint (the checkpoint's run config `saved`) differs from
    the same file's now. Silent for a record without fingerprints (written before them), a Hub dataset, and a field
    naming another file now (check_resume's: the same bytes moved are no change, others a changed setting)."""
    recorded = saved.get(FINGERPRINT_KEY) or {}
    now = recorded_fingerprint(config) or {}
    for field, before in recorded.items():
        name = getattr(config, field, None)
        if field in now and now[field] != before and _same_path(saved.get(field), name):
            logger.warning("%s: %s changed since %s was written (its contents differ); %s the new rows", field, name,
                           checkpoint, _READ_BY[field])


def _same_path(recorded, now) -> bool:
    return isinstance(recorded, str) and Path(recorded).expanduser().resolve() == Path(now).expanduser().resolve()
