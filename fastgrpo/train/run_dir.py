"""The output folder of a run: one run at a time, and never the files of two runs mixed.

RunLock: `<output_dir>/.fastgrpo.lock` holds the PID and host of the run using the folder, under an flock, so a
second run into the same folder stops with a message naming that PID. The OS drops an flock when its process
dies, so a lock file left by a killed run is known to be stale: it is taken over with a warning. Where the file
system has no flock (some Lustre / FUSE mounts) the PID alone decides, on the same host.

RunDirectory: the lock, plus the check that a fresh run does not start in a folder that holds another run's
checkpoints, metrics or export (a one-line error suggesting --resume or --overwrite-output-dir); overwriting
deletes those files first (refused while final/ holds files the user put beside the export, as an export refuses
it), or, for a command that writes its files only once it is done (eval: replace_at_end), once its own are written:
one that stops before leaves them as they were. A folder inside another run's checkpoint-<step>/ or final/ is
refused: that run deletes them. A resume deletes the hidden partial writes a killed run left, once it has finished a
folder's replacement cut short between its two renames. A folder at a name a run writes a file at (metrics.jsonl,
results.jsonl, summary.json) is the user's: a fresh run refuses it, never deletes it. Any command that writes a run
folder uses it the same way:

    with RunDirectory(config.output_dir) as run_dir:         # ValueError if another run holds the lock
        run_dir.prepare(resume=config.resume, overwrite=config.overwrite_output_dir, command=config.COMMAND)
        ...                                                 # the lock is held until the block ends
        run_dir.replace_previous(written)                   # with prepare(..., replace_at_end=True) only

`artifacts` names what a run leaves in the folder (glob patterns); the default is what `fastgrpo train` writes.
write_whole writes one of a run's files so that a kill leaves the old file or the new one, never part of either.
"""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from fastgrpo.train.atomic_folder import finish_replacement, fsync_path
from fastgrpo.train.naming import continuing, setting

try:
    import fcntl
except ImportError:  # not on Windows: the PID check alone
    fcntl = None

logger = logging.getLogger(__name__)
LOCK_FILE = ".fastgrpo.lock"
EVAL_ARTIFACTS = ("results.jsonl", "summary.json")  # what `fastgrpo eval` writes
# write_whole's partial writes in a run's folder itself (a kill as the metrics log was cut back on a resume, or as an
# eval wrote its results there)
_PARTIAL_FILES = tuple(f".{name}.tmp" for name in ("metrics.jsonl", *EVAL_ARTIFACTS))
# What `fastgrpo train`, `sft` and `ei` leave in their folder (eval/: --eval-steps); hidden .checkpoint-* / .final.*
# and _PARTIAL_FILES are partial writes of a killed run. An eval's results written into a run's folder describe that
# run's checkpoints: they count as its files (a fresh run refuses them, overwriting deletes them with the checkpoints).
TRAIN_ARTIFACTS = ("metrics.jsonl", "checkpoint-*", "final", "tensorboard", "eval", ".checkpoint-*", ".final.*",
                   *EVAL_ARTIFACTS, *_PARTIAL_FILES)
# Of what the checkpoint patterns match, the names a run writes (checkpoint-<step>, and atomic_directory's hidden
# partial writes): a user's checkpoint-notes/ beside them is not run data, so it is neither refused nor deleted.
_WRITTEN = re.compile(r"checkpoint-\d+|\.(checkpoint-\d+|final)\.(tmp|old)-\d+")
_REPLACED = re.compile(r"\.(checkpoint-\d+|final)\.old-(\d+)")  # atomic_directory's old version, as it replaces it
# The files a run writes in its eval/ (--eval-steps, a `fastgrpo eval` into it; write_whole's partial writes) and
# tensorboard/: anything else there is the user's. A folder of those names holding none of a run's files is not run
# data (neither refused nor deleted); overwriting refuses one that holds the user's files beside the run's.
_EVAL_FILES = ("step-*.jsonl", "step-*_summary.json", *EVAL_ARTIFACTS)
_RUN_FOLDER_FILES = {"eval": (*_EVAL_FILES, *(f".{name}.tmp" for name in _EVAL_FILES)),
                     "tensorboard": ("events.out.tfevents.*",)}
_FILE_ARTIFACTS = ("metrics.jsonl", *EVAL_ARTIFACTS, *_PARTIAL_FILES)  # a run's files; its other artifacts are folders
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunLock:
    """An exclusive lock on a run folder, held by this process from acquire() to release()."""

    def __init__(self, directory: str | Path, *, use_flock: bool = True):
        self.path = Path(directory) / LOCK_FILE
        self.use_flock = use_flock and fcntl is not None
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ValueError naming the run that holds it; a stale lock is taken over (warning)."""
        if self._fd is not None:
            return
        if self.use_flock:
            try:
                self._acquire_flock()
                return
            except OSError as err:
                if err.errno not in _NO_FLOCK:
                    raise
                self.use_flock = False
        self._acquire_by_pid()

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing drops the flock; unlinking first means no later run finds a used file
        self._fd = None

    def _acquire_flock(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise ValueError(self._in_use(holder)) from None
            except OSError:
                os.close(fd)
                raise
            # The holder we waited on may have unlinked this file as it released it: lock the file at the path.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        stale = _read_holder(fd)
        if stale:
            logger.warning("output_dir: took over the lock of a run that ended without releasing it (%s)",
                           _describe(stale))
        self._write_holder(fd)

    def _acquire_by_pid(self) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                holder = _read_holder_at(self.path)
                same_host = holder.get("host") == socket.gethostname()
                if not (same_host and not _alive(holder.get("pid"))):
                    raise ValueError(self._in_use(holder)) from None
                if self._remove_stale(holder):
                    logger.warning("output_dir: removed the stale lock of %s, which no longer runs", _describe(holder))
        self._write_holder(fd)

    def _remove_stale(self, holder: dict) -> bool:
        """Delete the lock file found to be the stale one of `holder`, unless it is another's by now: a run starting
        at once found it stale too, deleted it and made its own, which an unlink here deleted (both runs then held the
        lock). The file is moved aside first (one rename wins) and put back unless it is `holder`'s; True where it
        was deleted. Left: a third run making a lock in the instant the file is aside."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return False
        data = aside.read_bytes()
        if _parse_holder(data) == holder:
            aside.unlink()
            return True
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
        aside.unlink()
        return False

    def _write_holder(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _in_use(self, holder: dict) -> str:
        return (f"output_dir: {self.path.parent} is in use by another run ({_describe(holder)}); wait for it to "
                f"end or pick another {setting('output_dir')} (if that run is gone, delete {self.path})")


class RunDirectory:
    """A run folder under a RunLock, checked for another run's files; see the module docstring."""

    def __init__(self, path: str | Path, *, artifacts: tuple[str, ...] = TRAIN_ARTIFACTS, resumable: bool = True):
        """resumable: the command has --resume (the refusal suggests it only then)."""
        if not str(path).strip():  # Path("") is the current folder: a run would write among the user's files
            raise ValueError(f"output_dir: expected a folder path, got {str(path)!r}")
        self.path = Path(path)
        self.artifacts, self.resumable = artifacts, resumable
        self.lock = RunLock(self.path)
        self.replaced: list[Path] = []  # the previous run's files, kept until replace_previous (replace_at_end)

    def __enter__(self) -> RunDirectory:
        check_outside_run_folders(self.path, resumable=self.resumable)
        self.created = make_output_folder(self.path)
        try:
            self.lock.acquire()
        except OSError as err:  # no permission, a read-only file system (root's runs too), a full disk
            raise ValueError(f"output_dir: {self.path} is not writable (its lock file cannot be created: "
                             f"{err.strerror})") from None
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()
        if self.created:  # a run that stopped before writing anything leaves no empty folder behind
            with contextlib.suppress(OSError):  # not empty: the run wrote there
                self.path.rmdir()

    def previous_run(self) -> list[Path]:
        """The files and folders another run left here (an empty metrics.jsonl holds nothing and does not count)."""
        return [p for p in self._found(self.artifacts) if not (p.is_file() and p.stat().st_size == 0)
                and not (p.is_dir() and p.name in _RUN_FOLDER_FILES and not _run_and_user_files(p)[0])]

    def _command_of_run(self) -> str | None:
        """The command that wrote the newest checkpoint here (fastgrpo.train.run_kind), or None where unknown."""
        from fastgrpo.train.checkpoint import latest_checkpoint, read_run_config
        from fastgrpo.train.run_kind import written_by

        newest = latest_checkpoint(self.path)
        try:
            return written_by(read_run_config(newest)) if newest is not None else None
        except (ValueError, OSError):  # a damaged checkpoint: the plain refusal still holds
            return None

    def _found(self, patterns) -> list[Path]:
        found = {p for pattern in patterns for p in self.path.glob(pattern)}
        return sorted(p for p in found if not p.name.startswith(("checkpoint-", ".checkpoint-", ".final."))
                      or _WRITTEN.fullmatch(p.name))

    def prepare(self, *, resume: bool, overwrite: bool, command: str | None = None,
                replace_at_end: bool = False) -> None:
        """A fresh run needs a folder without another run's files (overwrite: delete them); resume keeps them.
        command: the run's (`train`, `sft`, `ei`, `eval`), so that a refusal suggests --resume only for a run of it.
        replace_at_end: overwrite keeps the previous run's files until replace_previous(), for a command that writes
        its files only once it is done (eval), so that one stopped before (an error, Ctrl-C) leaves them as they
        were."""
        if resume and overwrite:
            raise ValueError("overwrite_output_dir: deletes the checkpoints that resume continues from; pass one "
                             f"of {setting('resume', True)} and {setting('overwrite_output_dir', True)}")
        self._check_no_file_at_a_folder()
        if resume:  # keep the run; only the partial writes of a kill go (never checkpoints: atomic renames)
            self._check_no_folder_at_a_file(self._found(self.artifacts))  # the user's: not a partial write to delete
            self._finish_replacements()
            for path in self._found(pattern for pattern in self.artifacts if pattern.startswith(".")):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                logger.info("output_dir: deleted %s, a partial write of a stopped run", path.name)
            return
        found = self.previous_run()
        self._check_no_folder_at_a_file(found)  # before the refusal below offers overwriting, which would delete them
        if found and not overwrite:
            names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
            # a run stopped before its first checkpoint left files but nothing --resume could continue
            resumable = self.resumable and any(p.name.startswith("checkpoint-") for p in found)
            fresh = setting("overwrite_output_dir", True)
            if command is not None and {p.name for p in found} <= set(EVAL_ARTIFACTS):
                effect = "replaces them once it is done" if replace_at_end else "deletes them"
                raise ValueError(f"output_dir: {self.path} holds the results of a `fastgrpo eval` ({names}); pick "
                                 f"another {setting('output_dir')}, or start afresh with {fresh} ({effect})")
            theirs = self._command_of_run() if resumable else None
            if theirs is not None and command is not None and theirs != command:
                raise ValueError(f"output_dir: {self.path} holds a `fastgrpo {theirs}` run ({names}); continue it "
                                 f"with {continuing(theirs)}, pick another {setting('output_dir')}, or start afresh "
                                 f"with {fresh} (deletes those files)")
            resume = f"continue it with {setting('resume', True)}, or " if resumable else ""
            raise ValueError(f"output_dir: {self.path} holds another run ({names}); {resume}start afresh with "
                             f"{fresh} (deletes those files)")
        self._check_overwritable(found)
        if replace_at_end:
            self.replaced = found
            if found:
                logger.info("output_dir: the previous run's %s stay until this run replaces them", _names(found))
        else:
            _delete(found)
            if found:
                logger.info("output_dir: deleted the previous run's %s", _names(found))
        # an empty log of a run of this command that never finished a step, from a fastgrpo that created it before
        # the first line (another command's log is not ours)
        log = self.path / "metrics.jsonl"
        if "metrics.jsonl" in self.artifacts and log.is_file() and log.stat().st_size == 0:
            log.unlink()

    def replace_previous(self, written: Sequence[str | Path]) -> None:
        """Once this run's files are `written` (each renamed over the previous run's file of its name, if any): the
        previous run's files that prepare(replace_at_end=True) kept and none of them replaced are deleted."""
        written = {Path(path).absolute() for path in written}
        _delete([path for path in self.replaced if path.absolute() not in written])
        if self.replaced:
            logger.info("output_dir: replaced the previous run's %s", _names(self.replaced))
        self.replaced = []

    def _finish_replacements(self) -> None:
        """A kill between atomic_directory's two renames (a checkpoint or final/ written again) left no <name>/, its
        old version at .<name>.old-<pid> and the new one, filled and fsynced, at .<name>.tmp-<pid>: the second rename
        is done now, where the leftovers' deletion lost both."""
        for old in self.path.glob(".*.old-*"):
            match = _REPLACED.fullmatch(old.name)
            if match and finish_replacement(self.path / match.group(1), match.group(2)):
                logger.warning("output_dir: finished writing %s, which a run stopped as it replaced it", match.group(1))

    def _check_no_file_at_a_folder(self) -> None:
        """A ValueError for a file at a name the run writes a folder at (final, eval, tensorboard, checkpoint-<step>):
        the user's (a script named eval), which a refusal named as another run's and overwriting deleted, and an
        export moved aside. Or for a symlink at one the run replaces or deletes whole (final, checkpoint-<step>): its
        rename and rmtree act on the link, not the folder it points to (an export went on beside the link's target,
        then failed with 'Cannot call rmtree on a symbolic link')."""
        for path in self._found(pattern for pattern in self.artifacts if pattern not in _FILE_ARTIFACTS):
            if not path.is_dir():
                raise ValueError(f"output_dir: {path} is a file, where a run writes a folder; move it out of "
                                 f"{self.path}, or pick another {setting('output_dir')}")
            if path.is_symlink() and path.name not in _RUN_FOLDER_FILES:
                raise ValueError(f"output_dir: {path} is a symlink, where a run writes a folder it replaces or "
                                 f"deletes whole; make it a folder (or link the whole {setting('output_dir')} to put "
                                 "the run on another disk)")

    def _check_no_folder_at_a_file(self, found: list[Path]) -> None:
        """A ValueError for a folder (the user's) at a name a run writes a file at (metrics.jsonl, results.jsonl,
        summary.json, their partial writes): overwriting would delete it with what the user put in it (train, sft, ei
        delete at their start), a resume deleted one at a partial write's name and failed on the log's with the OS's
        "Is a directory", and an eval's file cannot be renamed over it once the eval is done."""
        for path in found:
            if path.is_dir() and any(fnmatch.fnmatchcase(path.name, name) for name in _FILE_ARTIFACTS):
                raise ValueError(f"output_dir: {path} is a folder, where the run writes a file; move it out of "
                                 f"{self.path}, or pick another {setting('output_dir')}")

    def _check_overwritable(self, found: list[Path]) -> None:
        """A ValueError where deleting the previous run's `found` would delete files the user put among them (in
        final/, eval/, tensorboard/)."""
        from fastgrpo.train.final_export import check_final_overwritable

        if any(path.name == "final" for path in found):
            check_final_overwritable(self.path)
        for folder in (path for path in found if path.is_dir() and path.name in _RUN_FOLDER_FILES):
            users = _run_and_user_files(folder)[1]
            if users:
                listed = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
                raise ValueError(f"overwrite_output_dir: {folder} holds files the run did not write ({listed}), which "
                                 "starting afresh would delete; move them out of it, then start afresh with "
                                 f"{setting('overwrite_output_dir', True)}")


def _delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _names(paths: list[Path]) -> str:
    return ", ".join(path.name for path in paths)


def make_output_folder(path: Path) -> bool:
    """Create the folder `path` (and those above it) where it is missing; True where it was. A file or a broken
    symlink on the way, or no permission, is a one-line ValueError naming output_dir."""
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the path, or a folder on it, is a file or a broken symlink
        link = _broken_symlink(path)
        if link is not None:
            raise ValueError(f"output_dir: {link} is a symlink to {os.readlink(link)}, which does not exist; create "
                             f"that folder (is its disk mounted?), or pick another {setting('output_dir')}") from None
        raise ValueError(f"output_dir: expected a folder (or a path to create one at), but {path} or a folder above "
                         "it is a file") from None
    except OSError as err:  # no permission, a read-only or missing file system
        raise ValueError(f"output_dir: cannot create {path} ({err.strerror})") from None
    return created


def _run_and_user_files(folder: Path) -> tuple[list[str], list[str]]:
    """(the run's, the user's) files under one of _RUN_FOLDER_FILES' folders, as sorted paths relative to it."""
    files = sorted(file.relative_to(folder).as_posix() for file in folder.rglob("*") if file.is_file())
    runs = [name for name in files if any(fnmatch.fnmatchcase(name, p) for p in _RUN_FOLDER_FILES[folder.name])]
    return runs, [name for name in files if name not in runs]


def _broken_symlink(path: Path) -> Path | None:
    """The symlink on `path` (it, or a folder above it) whose target does not exist (a disk not mounted), if any."""
    return next((folder for folder in (path, *path.parents) if folder.is_symlink() and not folder.exists()), None)


def check_outside_run_folders(path: Path, resumable: bool = False) -> None:
    """A ValueError for a folder inside a run's checkpoint-<step>/ or final/: the run deletes those folders, and
    what is in them, when it prunes checkpoints or exports again (and --overwrite-output-dir deletes them). The
    folders are those above the path as written and above the one it resolves to (a symlink to a run's final/).
    resumable: the command has --resume, which a checkpoint given as the folder itself likely meant."""
    from fastgrpo.train.checkpoint import CONFIG_FILE, STATE_FILE, list_checkpoints

    path, real = Path(path).absolute(), Path(path).resolve()
    for folder in dict.fromkeys((path, *path.parents, real, *real.parents)):
        hint = ""
        if (folder / STATE_FILE).is_file():
            what = f"a checkpoint of the run in {folder.parent}, which deletes it when it prunes checkpoints"
            if resumable and folder == path:
                hint = f"; to continue that run: {setting('output_dir')} {folder.parent} {setting('resume', True)}"
        elif folder.name == "final" and (folder / CONFIG_FILE).is_file() and list_checkpoints(folder.parent):
            what = f"the exported model of the run in {folder.parent}, which replaces it when it exports again"
        else:
            continue
        raise ValueError(f"output_dir: {folder} is {what} (and what is written in it); pick a folder outside it{hint}")


def _read_holder(fd: int) -> dict:
    data = os.pread(fd, 4096, 0)
    return _parse_holder(data)


def _read_holder_at(path: Path) -> dict:
    try:
        return _parse_holder(path.read_bytes())
    except FileNotFoundError:
        return {}


def _parse_holder(data: bytes) -> dict:
    if not data.strip():
        return {}
    try:
        holder = json.loads(data)
    except ValueError:
        return {"unreadable": data[:80].decode(errors="replace")}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if "pid" in holder:
        return f"PID {holder['pid']} on {holder.get('host', '?')}"
    return f"lock file content {holder.get('unreadable', '')!r}"


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_whole(path: Path, text: str) -> None:
    """`text` into the file `path` (its folder made), whole or not at all: written beside it and flushed to the disk,
    then renamed over it (after a power loss the name holds the old text or the new, not an empty file)."""
    os.replace(write_beside(path, text), path)
    fsync_path(path.parent)


def write_beside(path: Path, text: str) -> Path:
    """`text` into the hidden file beside `path` (its folder made) that write_whole renames over it, flushed to the
    disk (a name renamed over it then holds it after a power loss); that file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_write(path)
    tmp.write_text(text)
    fsync_path(tmp)
    return tmp


def partial_write(path: Path) -> Path:
    """The hidden file write_beside writes before it is renamed over `path`."""
    return path.with_name(f".{path.name}.tmp")
