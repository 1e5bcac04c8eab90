"""Version guards for the libraries whose internals fastgrpo mirrors (transformers, peft): the supported ranges are
the ones fastgrpo's own package metadata requires (pyproject.toml), so they are written down once."""
from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

GUARDED = ("transformers", "peft")


@functools.cache
def _required() -> dict[str, Requirement]:
    try:
        specs = requires("fastgrpo") or []
    except PackageNotFoundError:  # run from a source tree that was never installed: nothing to compare against
        return {}
    found = {}
    for spec in specs:
        req = Requirement(spec)
        if req.name in GUARDED and req.marker is None:
            found[req.name] = req
    return found


def check_supported(name: str) -> None:
    """Raise RuntimeError naming the installed version when `name` is outside the range fastgrpo supports."""
    req = _required().get(name)
    if req is None:
        return
    try:
        installed = version(name)
    except PackageNotFoundError:
        raise RuntimeError(f"fastgrpo needs {req} ({name} is not installed)") from None
    if not req.specifier.contains(installed, prereleases=True):
        raise RuntimeError(
            f"fastgrpo supports {req} (it binds code that mirrors {name}'s internals); {name} {installed} is "
            f"installed: `pip install \"{req}\"`"
        )
