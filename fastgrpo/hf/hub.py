"""Whether a model or dataset name that is no local path can come from the Hugging Face Hub, answered at once:
transformers and datasets retry an unreachable Hub (5 times, 23 s of waits on top of each request's timeout) before
their error."""
from __future__ import annotations

import glob
import os

from huggingface_hub import HfApi, constants, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError, HFValidationError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

# what ask_hub's request found: the repo (or an answer the loader's own request reports), no such repo, no answer
FOUND, MISSING, UNREACHABLE = "found", "missing", "unreachable"


def _unreachable(err: Exception) -> bool:
    # no answer from the Hub: httpx's (huggingface_hub 1.x) or httpx2's (2.x) TransportError, or an OSError's
    return isinstance(err, (OfflineModeIsEnabled, ConnectionError)) or any(
        cls.__name__ == "TransportError" for cls in type(err).__mro__)


def valid_repo_id(repo_id: str) -> bool:
    """Whether `repo_id` is written as a Hub repo id can be (name or namespace/name)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def ask_hub(repo_id: str, repo_type: str) -> tuple[str, str]:
    """(FOUND | MISSING | UNREACHABLE, why unreachable) for a "model" or "dataset" repo, in one metadata request
    without retries, under huggingface_hub's timeout for such requests (HF_HUB_ETAG_TIMEOUT, 10 s by default)."""
    api = HfApi()
    info = api.model_info if repo_type == "model" else api.dataset_info
    try:
        info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:  # a RepositoryNotFoundError: the loader says what access it needs
        return FOUND, ""
    except RepositoryNotFoundError:
        return MISSING, ""
    except HfHubHTTPError:
        return FOUND, ""
    except Exception as err:  # the transport errors of whichever HTTP client huggingface_hub uses
        if not _unreachable(err):
            return FOUND, ""
        return UNREACHABLE, (str(err).strip().splitlines() or [type(err).__name__])[0]
    return FOUND, ""


def hub_model_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot load from the Hub (None: it may, or the Hub's answer is left to transformers): not a
    valid repo id, not cached while HF_HUB_OFFLINE is set, the Hub unreachable, or no such repo. A cached model
    is taken as it is; otherwise one metadata request, without retries."""
    if not valid_repo_id(repo_id):
        return "not a Hugging Face Hub repo id (namespace/name)"
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "not in the Hugging Face cache, and HF_HUB_OFFLINE is set"
    answer, reason = ask_hub(repo_id, "model")
    if answer == MISSING:
        return "no such Hugging Face Hub repo (or a private one: log in with `hf auth login`)"
    if answer == UNREACHABLE:
        return (f"not in the Hugging Face cache, and the Hub cannot be reached ({reason}); with the model cached, "
                "HF_HUB_OFFLINE=1 loads it from there")
    return None


def datasets_offline() -> str | None:
    """The variable that keeps `datasets` off the Hub, where one does: HF_DATASETS_OFFLINE (datasets' own), else
    HF_HUB_OFFLINE (datasets' default of it, and huggingface_hub's, whose requests it refuses)."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE and os.environ.get("HF_DATASETS_OFFLINE") is not None:
        return "HF_DATASETS_OFFLINE"
    return "HF_HUB_OFFLINE" if datasets.config.HF_HUB_OFFLINE or constants.HF_HUB_OFFLINE else None


def datasets_cache() -> str:
    """The folder datasets keeps the Hub datasets it loaded in (HF_DATASETS_CACHE)."""
    import datasets

    return os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE))


def dataset_cached(repo_id: str) -> bool:
    """Whether a cache holds the Hub dataset `repo_id`, which load_dataset may read where the Hub cannot be asked:
    datasets' own (the namespace___snake_name/config/version/hash/ folder its CachedDatasetModuleFactory looks for; not
    called: it logs that it is using the cache), or huggingface_hub's files of the repo (`hf download --repo-type
    dataset`): a dataset the user downloaded is not refused here; what datasets cannot read of it, it says."""
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub.file_download import repo_folder_name

    parts = repo_id.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    # unescaped, as datasets globs it: a cache path holding [, * or ? is then missed by both alike
    root = os.path.join(datasets_cache(), "___".join(parts))
    if any(os.path.isdir(found) for found in glob.glob(os.path.join(root, "*", "*", "*"))):
        return True
    snapshots = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="dataset"), "snapshots")
    return os.path.isdir(snapshots) and bool(os.listdir(snapshots))
