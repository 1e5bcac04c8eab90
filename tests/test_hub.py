"""fastgrpo.hf.hub against a local socket answering as the Hugging Face Hub's API does: ask_hub's reading of each
answer (the repo, no such repo, a gated one, a server error, an answer it cannot parse), models and datasets asked at
their own endpoints, and the caches and offline flags that decide whether the Hub is asked at all."""
from __future__ import annotations

import json

import pytest
import test_dataset_source as stand_ins

from fastgrpo.hf.hub import FOUND, MISSING, UNREACHABLE, ask_hub, dataset_cached, datasets_offline, hub_model_problem

datasets = pytest.importorskip("datasets")
# the Hub stand-ins (local sockets) as this module's fixtures
hub_at, hub, refusing_hub = stand_ins.hub_at, stand_ins.hub, stand_ins.refusing_hub
NOT_FOUND = stand_ins.NOT_FOUND

# what a Hub answers (status, X-Error-Code, body) -> what ask_hub reads in it
ANSWERS = {
    "the repo": ((200, None, json.dumps({"id": "owner/x"}).encode()), FOUND),
    "no such repo": (NOT_FOUND, MISSING),
    "a gated repo": ((403, "GatedRepo", b""), FOUND),  # a RepositoryNotFoundError: the loader says what access it needs
    "a server error": ((500, None, b""), FOUND),  # the loader's own request reports it
    "no JSON": ((200, None, b"<html>a captive portal</html>"), FOUND),  # neither a repo's absence nor no answer
}


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("repo_type", ["model", "dataset"])
def test_ask_hub_reads_each_answer_at_the_repo_types_endpoint(hub, answer, repo_type):
    served, read = ANSWERS[answer]
    hub[f"/api/{repo_type}s/owner/x"] = served
    assert ask_hub("owner/x", repo_type) == (read, "")
    other = "dataset" if repo_type == "model" else "model"  # the other type's endpoint has no such repo
    assert ask_hub("owner/x", other) == (MISSING, "")


def test_ask_hub_without_an_answer_says_why(refusing_hub):
    answer, reason = ask_hub("owner/x", "model")
    assert answer == UNREACHABLE and reason and "\n" not in reason, (answer, reason)


def test_hub_model_problem_names_what_the_hub_answered(hub):
    assert hub_model_problem("owner/x") == ("no such Hugging Face Hub repo (or a private one: log in with `hf auth "
                                           "login`)")
    for answer in ("the repo", "a gated repo", "a server error"):
        hub["/api/models/owner/x"] = ANSWERS[answer][0]
        assert hub_model_problem("owner/x") is None, answer


def test_a_cached_model_is_not_asked_for(refusing_hub, tmp_path):
    problem = hub_model_problem("owner/m")
    assert problem.startswith("not in the Hugging Face cache, and the Hub cannot be reached ("), problem
    assert problem.endswith("); with the model cached, HF_HUB_OFFLINE=1 loads it from there"), problem
    # huggingface_hub's cache of the repo, as `hf download owner/m` leaves it (hub_at points HF_HUB_CACHE here)
    repo = tmp_path / "hub_cache" / "models--owner--m"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    assert hub_model_problem("owner/m") is None


@pytest.mark.parametrize("datasets_env, datasets_offline_flag, hub_offline_flag, named", [
    (None, False, False, None),
    ("0", False, False, None),  # HF_DATASETS_OFFLINE=0: set, and datasets is online
    ("1", True, False, "HF_DATASETS_OFFLINE"),
    (None, True, False, "HF_HUB_OFFLINE"),  # datasets' default of its flag
    ("0", False, True, "HF_HUB_OFFLINE"),  # datasets online, huggingface_hub refusing every request
])
def test_datasets_offline_names_the_variable_that_keeps_it_off_the_hub(
        refusing_hub, monkeypatch, datasets_env, datasets_offline_flag, hub_offline_flag, named):
    from huggingface_hub import constants

    if datasets_env is not None:
        monkeypatch.setenv("HF_DATASETS_OFFLINE", datasets_env)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets_offline_flag)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", hub_offline_flag)
    assert datasets_offline() == named


def _datasets_finds(repo_id: str, cache) -> bool:
    """Whether datasets' own lookup of a Hub dataset in its cache (load_dataset's, where the Hub cannot answer) finds
    repo_id."""
    from datasets.load import CachedDatasetModuleFactory

    try:
        CachedDatasetModuleFactory(repo_id, cache_dir=str(cache)).get_module()
    except FileNotFoundError:
        return False
    return True


@pytest.mark.parametrize("repo_id, made, cached", [
    ("owner/rows", "owner___rows/default/0.0.0/0123abc/", True),
    ("owner/MyRows", "owner___my_rows/default/0.0.0/0123abc/", True),  # datasets snake-cases the name
    ("owner/rows", "owner___rows/default/0.0.0/", False),  # no dataset's folder in it
    ("owner/rows", "owner___rows/default/0.0.0/0123abc.lock", False),  # a file, not a folder
    ("owner/rows", "owner___other/default/0.0.0/0123abc/", False),
])
def test_dataset_cached_finds_what_datasets_finds(refusing_hub, tmp_path, repo_id, made, cached):
    cache = tmp_path / "datasets_cache"  # hub_at's HF_DATASETS_CACHE
    path = cache / made
    if made.endswith("/"):
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True)
        path.write_text("")
    assert dataset_cached(repo_id) == _datasets_finds(repo_id, cache) == cached


def test_dataset_cached_reads_a_cache_under_home_and_the_hubs_downloaded_files(refusing_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", "~/ds")  # HF_DATASETS_CACHE=~/ds: unexpanded
    (tmp_path / "ds" / "owner___rows" / "default" / "0.0.0" / "0123abc").mkdir(parents=True)
    assert dataset_cached("owner/rows")
    snapshots = tmp_path / "hub_cache" / "datasets--owner--files" / "snapshots"
    snapshots.mkdir(parents=True)  # `hf download` interrupted before its first file: nothing to read
    assert not dataset_cached("owner/files")
    (snapshots / "0123abc").mkdir()
    assert dataset_cached("owner/files")
