"""The versions fastgrpo reports: `fastgrpo --version` prints them, an evaluation's summary records them."""
from importlib.metadata import PackageNotFoundError, version

LIBRARIES = ("torch", "triton", "transformers", "peft")  # the ones that generate, train and score


def library_versions() -> dict:
    """{"fastgrpo": its version, then each of LIBRARIES installed: its version}."""
    from fastgrpo import __version__

    found = {"fastgrpo": __version__}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
