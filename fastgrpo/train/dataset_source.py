"""Whether a dataset or eval_dataset name can load, answered before anything loads: a name written as a local path
must exist (a mistyped one was sent to the Hub, where datasets retried an unreachable Hub for half a minute to minutes
and then named neither the setting nor the path); another must be a Hub dataset id that datasets' cache holds or that
the Hub answers for, asked in one request without retries (fastgrpo.hf.hub). Each refusal is one line naming the
setting and what it takes; a name close to one in the folder is offered."""
from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path

from fastgrpo.hf.hub import FOUND, MISSING, UNREACHABLE, ask_hub, dataset_cached, datasets_cache, datasets_offline
from fastgrpo.hf.hub import valid_repo_id
from fastgrpo.train.naming import setting
from fastgrpo.train.sources import DATA_FILE_FORMS, JSON_SUFFIXES, TABLE_BUILDERS

logger = logging.getLogger(__name__)

# what a data file's name ends in (those read, and others a user may hold data in): a name ending in one, or in one
# mistyped (.jsnl, .parqet), is a file's, never a Hub dataset's
FILE_SUFFIXES = (*JSON_SUFFIXES, *TABLE_BUILDERS, ".txt", ".arrow", ".gz", ".zip")
_SUFFIX_TYPO = 0.75  # difflib ratio: .jsnl, .parqet, .cvs, .tx are typos of a data suffix; .v2, .5 of none
# difflib ratio for "did you mean": trian.jsonl ~ train.jsonl (0.91), dat ~ data (0.86); not nope.jsonl ~ train.jsonl
# (0.67), whose shared .jsonl passes difflib's default 0.6
_CLOSE_NAME = 0.8


def check_dataset_source(dataset: str, field: str = "dataset") -> None:
    """A ValueError for a `field` name that is no file or folder here and cannot be a Hub dataset either (see the
    module's docstring). A Hub dataset in a cache is let through where the Hub has none or cannot answer (datasets
    reads the cache then: after its retries where the Hub cannot be reached, which a warning says how to skip)."""
    if os.path.exists(dataset) or _remote(dataset):
        return
    problem = local_path_problem(dataset, field)
    if problem is None:
        problem = _hub_problem(dataset, field)
    if problem is not None:
        raise ValueError(problem)


def check_local_dataset_sources(config) -> None:
    """The commands' first look at config's dataset and eval_dataset (where the run evaluates on it): a name written
    as a local path must exist (local_path_problem), before the tokenizer or anything from the Hub loads."""
    fields = ["dataset"] + (["eval_dataset"] if getattr(config, "eval_steps", 0) else [])
    for field in fields:
        name = getattr(config, field, None)
        if name is not None and not os.path.exists(name):
            problem = local_path_problem(name, field)
            if problem is not None:
                raise ValueError(problem)


def looks_local(dataset: str) -> bool:
    """Whether a name was written as a local path: absolute, starting with . or ~, ending in a slash, with a backslash or
    two slashes (a Hub id has at most one: namespace/name), ending in a data file's suffix or a typo of one, or in a
    folder that is here (data/trian.jsonl). datasets' remote forms (_remote) are not."""
    if _remote(dataset):
        return False
    path = Path(dataset)
    if any((path.is_absolute(), dataset.startswith((".", "~")), dataset.endswith("/"), "\\" in dataset,
            dataset.count("/") > 1)):
        return True
    suffix = path.suffix.lower()
    if suffix and difflib.get_close_matches(suffix, FILE_SUFFIXES, n=1, cutoff=_SUFFIX_TYPO):
        return True
    return path.parent != Path(".") and path.parent.is_dir()


def local_path_problem(dataset: str, field: str) -> str | None:
    """The line for a name written as a local path (looks_local) that is no file or folder here; None otherwise."""
    if not looks_local(dataset):
        return None
    return f"{field}: no such file or folder {_where(dataset)}; {setting(field)} takes a {DATA_FILE_FORMS}"


def _hub_problem(dataset: str, field: str) -> str | None:
    """The line for a name that may be a Hub dataset id but cannot load from the Hub or datasets' cache; None where it
    may."""
    # where the local folder a bare name would be is said; namespace/name is more likely meant for the Hub
    missing = f"{field}: no such file or folder {_where(dataset, resolved='/' not in dataset)}"
    if not valid_repo_id(dataset):
        return f"{missing}, nor a Hugging Face dataset id (namespace/name); {setting(field)} takes a {DATA_FILE_FORMS}"
    try:
        cached = dataset_cached(dataset)
    except ImportError:  # no datasets: loading the rows says to install it
        return None
    offline = datasets_offline()
    if offline is not None:
        return None if cached else (f"{missing}, and the Hub dataset {dataset} is not in datasets' cache "
                                    f"({datasets_cache()}) while {offline} is set")
    answer, reason = ask_hub(dataset, "dataset")
    if answer == FOUND:
        return None
    if cached:  # datasets reads its cache where the Hub has none or cannot answer
        if answer == UNREACHABLE:
            logger.warning("%s: the Hugging Face Hub cannot be reached (%s): datasets retries it (half a minute or "
                           "more) before it reads %s from its cache; HF_HUB_OFFLINE=1 skips that", field, reason, dataset)
        return None
    if answer == MISSING:
        return f"{missing}, nor a dataset on the Hugging Face Hub (or a private one: log in with `hf auth login`)"
    return (f"{missing}, and the Hub dataset {dataset} is not in datasets' cache ({datasets_cache()}) while the "
            f"Hugging Face Hub cannot be reached ({reason})")


def _where(dataset: str, resolved: bool = True) -> str:
    """`dataset` as typed, with the path it resolves to where that differs (resolved) and a close name its folder
    has."""
    path = os.path.abspath(dataset)
    close = close_path(dataset)
    notes = [f"resolved: {path}"] if resolved and path != dataset else []
    notes += [f"did you mean {close}?"] if close else []
    return f"{dataset} ({'; '.join(notes)})" if notes else dataset


def close_path(dataset: str) -> str | None:
    """The path the user may have meant: the first part of `dataset` that does not exist replaced by the closest name
    in its folder (the path up to it where the rest is missing too); None where no name is close."""
    parts = Path(dataset).parts
    for i, part in enumerate(parts):
        here = Path(*parts[:i]) if i else Path(".")
        if (here / part).exists():
            continue
        try:
            names = [entry.name for entry in here.iterdir()] if here.is_dir() else []
        except OSError:
            return None
        found = difflib.get_close_matches(part, names, n=1, cutoff=_CLOSE_NAME)
        if not found:
            return None
        meant = Path(*parts[:i], found[0])
        whole = Path(meant, *parts[i + 1:])
        return str(whole) if whole.exists() else f"{meant}{os.sep if meant.is_dir() else ''}"
    return None


def _remote(dataset: str) -> bool:
    """datasets' remote forms, which it reads as they are: hf://datasets/..., hf://buckets/..., buckets/..."""
    return "://" in dataset or dataset.startswith("buckets/")
