"""Folders written whole or not at all, and deleted so that a kill leaves no part of one in place.

atomic_directory fills a hidden sibling `.<name>.tmp-<pid>`, fsyncs it and renames it into place; delete_folder
renames a folder to a hidden `.<name>.old-<pid>` before its rmtree. A kill leaves the whole folder (old or new) and,
at most, a hidden leftover, which is no checkpoint or export (fastgrpo.train.run_dir deletes it on a resume; the
next atomic_directory of the same name deletes those of processes no longer running, e.g. a killed export's).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from fastgrpo.train.interrupts import stop_if_interrupted
from fastgrpo.train.naming import setting

logger = logging.getLogger(__name__)
_NEARLY_FULL = 2**20  # bytes free on a disk where a write failed: it failed for want of space


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a hidden temporary sibling of `path` to fill; once the block ends without an error (or an interrupt a
    library swallowed: stop_if_interrupted) it is fsynced and renamed to `path` (replacing a previous one), so readers
    see the whole folder or the old one. A write that fails as the disk fills up is an OSError saying so
    (_raise_if_disk_full)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _delete_dead_leftovers(path)
    tmp.mkdir(parents=True)
    try:
        try:
            yield tmp
        except Exception as err:
            _raise_if_disk_full(path, err)
            raise
        # a Ctrl-C (or `fastgrpo export`'s SIGTERM) that a library swallowed as the folder was filled: not put in
        # place, as one it let through would not be
        stop_if_interrupted()
        for entry in tmp.rglob("*"):  # a subfolder too (an FSDP2 run's shards/): its entries name its files
            if entry.is_file() or entry.is_dir():
                fsync_path(entry)
        fsync_path(tmp)
        if path.exists():
            # Two renames, not rmtree first: the old folder stays whole until the new one is in place.
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:  # a second Ctrl-C, say: the old one back, not left at a name a resume deletes
                os.replace(old, path)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _delete_dead_leftovers(path: Path) -> None:
    """Clean up after processes that no longer run and were writing `path` (a killed export, which no run folder's
    resume cleans up after, left a whole model's partial copy beside the user's path for good): a kill between the
    two renames left no `path` (the old version at .<name>.old-<pid>, the new one, whole, at .<name>.tmp-<pid>):
    the rename is finished (or, without the new one, the old one put back); then their partial writes are deleted."""
    dead = {}
    for leftover in sorted(path.parent.glob(f".{glob.escape(path.name)}.*-*")):
        kind, _, pid = leftover.name[len(path.name) + 2:].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _running(int(pid)):
            dead[kind, pid] = leftover
    for (kind, pid), old in dead.items():
        if kind == "old" and not path.exists():
            if not finish_replacement(path, pid):
                os.replace(old, path)
            logger.warning("%s: put back the whole copy a stopped process left as it replaced it", path)
    for (kind, _), leftover in dead.items():  # an old version that is the last whole copy stays
        if leftover.is_dir() and (kind == "tmp" or path.exists()):
            shutil.rmtree(leftover, ignore_errors=True)


def finish_replacement(path: Path, pid: str) -> bool:
    """A kill between atomic_directory's two renames left no `path`, its old version at .<name>.old-<pid> and the new
    one, filled and fsynced, at .<name>.tmp-<pid>: do the second rename. True where it did."""
    new = path.with_name(f".{path.name}.tmp-{pid}")
    if path.exists() or not new.is_dir():
        return False
    os.replace(new, path)
    return True


def _running(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (another user's counts: its files are not ours to delete)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _raise_if_disk_full(path: Path, err: Exception) -> None:
    """A one-line OSError for a write into `path` that failed as its disk filled up, which torch.save reports as
    "unexpected pos 573632 vs 573524" and safetensors as "Error while serializing" (a traceback at the command line)."""
    if shutil.disk_usage(path.parent).free < _NEARLY_FULL:
        full = OSError(f"{path.name}: not written, the disk of {path.parent} is full; make room and run again "
                       f"({setting('resume', True)} continues from the last checkpoint)")
        full.errno = errno.ENOSPC
        raise full from err


def delete_folder(path: Path) -> None:
    """rmtree, after a rename to a partial write's hidden name: a kill in the middle of it leaves no checkpoint-<step>
    lacking files (one without its state, which no prune deletes again), but a leftover that a resume deletes."""
    hidden = path.with_name(f".{path.name}.old-{os.getpid()}")
    os.replace(path, hidden)
    shutil.rmtree(hidden)


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk: after a power loss a name renamed over it afterwards
    holds it, not an empty file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
