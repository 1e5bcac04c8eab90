"""Whether a model name that is no local folder can come from the Hugging Face Hub, answered at once: transformers
would retry an unreachable Hub for 20 s or more before its error."""
from __future__ import annotations

from huggingface_hub import HfApi, constants, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

PROBE_TIMEOUT_S = 10


def _unreachable(err: Exception) -> bool:
    # no answer from the Hub: httpx's (huggingface_hub 1.x) or httpx2's (2.x) TransportError, or an OSError's
    return isinstance(err, (OfflineModeIsEnabled, ConnectionError)) or any(
        cls.__name__ == "TransportError" for cls in type(err).__mro__)


def hub_model_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot load from the Hub (None: it may, or the Hub's answer is left to transformers): not a
    valid repo id, not cached while HF_HUB_OFFLINE is set, the Hub unreachable, or no such repo. A cached model
    is taken as it is; otherwise one metadata request, without retries."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return "not a Hugging Face Hub repo id (namespace/name)"
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "not in the Hugging Face cache, and HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo_id, timeout=PROBE_TIMEOUT_S)
    except RepositoryNotFoundError:
        return "no such Hugging Face Hub repo (or a private one: log in with `hf auth login`)"
    except HfHubHTTPError:
        return None
    except Exception as err:  # the transport errors of whichever HTTP client huggingface_hub uses
        if not _unreachable(err):
            return None
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return (f"not in the Hugging Face cache, and the Hub cannot be reached ({reason}); with the model cached, "
                "HF_HUB_OFFLINE=1 loads it from there")
    return None
