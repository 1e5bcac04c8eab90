"""A mistyped --dataset / --eval-dataset fails in one line, at once: a name written as a local path is never sent to
the Hub (datasets retried an unreachable Hub for half a minute with a refused connection, minutes where requests hang,
then named neither the setting nor the path); a Hub id is asked once, without retries. The Hubs here are local
sockets: one refusing connections (no network, DNS failing), one never answering (a firewall dropping packets, a hung
proxy), one answering 404 RepoNotFound as the Hub does."""
from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.train.cli import main
from fastgrpo.train.dataset_source import FILE_SUFFIXES, check_dataset_source, looks_local
from fastgrpo.train.loading import load_rows
from fastgrpo.train.sources import DATA_FILE_FORMS

datasets = pytest.importorskip("datasets")

ROW = {"prompt": "what is 1 plus 1", "answer": "2"}
COMMANDS = ["train", "sft", "ei", "eval"]
# the silent Hub's requests time out after HF_HUB_ETAG_TIMEOUT; huggingface_hub's first request of a process also
# fetches its agent registry, under a 3 s timeout of its own; the rest is the command's start (the built-in tokenizer)
PROBE_TIMEOUT_S = 1
AT_ONCE_S = PROBE_TIMEOUT_S + 3 + 4  # datasets' retries alone wait 23 s, on top of 6 requests' timeouts


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def hub_at(monkeypatch, tmp_path):
    """Point huggingface_hub and datasets at `url`, online, with nothing in datasets' cache."""
    def point(url: str) -> None:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
        # the file URLs, built from the endpoint at import (a load_dataset reached huggingface.co past the two above)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", url + "/datasets/{repo_id}/resolve/{revision}/{path}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", PROBE_TIMEOUT_S)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    return point


@pytest.fixture
def refusing_hub(hub_at):
    hub_at(f"http://127.0.0.1:{_free_port()}")  # nothing listens there


@pytest.fixture
def silent_hub(hub_at):
    """A Hub that takes connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the kernel completes the connections; no one reads them
    hub_at(f"http://127.0.0.1:{server.getsockname()[1]}")
    yield
    server.close()


NOT_FOUND = (404, "RepoNotFound", b"")  # what the Hub answers for a repo it has not (or a private one)


class _Hub(http.server.BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, str | None, bytes]] = {}  # API path -> (status, X-Error-Code, body)

    def _answer(self):
        status, code, body = self.answers.get(self.path.partition("?")[0], NOT_FOUND)
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(hub_at):
    """A Hub answering what the test puts in the dict it gets (API path -> answer); 404 RepoNotFound elsewhere."""
    answers = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Hub", (_Hub,), {"answers": answers}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub_at(f"http://127.0.0.1:{server.server_address[1]}")
    yield answers
    server.shutdown()
    server.server_close()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The user's folder: data/train.jsonl, my_data/ and a run's output folder name."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps(ROW) + "\n")
    (tmp_path / "my_data").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(argv: list[str], capsys) -> tuple[int, str, float]:
    start = time.perf_counter()
    code = main(argv)
    return code, capsys.readouterr().err, time.perf_counter() - start


@pytest.mark.parametrize("command", COMMANDS)
def test_a_mistyped_data_path_is_one_line_before_the_model_or_the_hub(command, project, refusing_hub, capsys):
    # data/train.jsnl went to the Hub as a dataset id: 23 s of datasets' retries (twice: "train" in its error was
    # taken for the split), then "no such file or folder data/train.jsnl, and datasets could not load it from the
    # Hub: Couldn't reach ..."; now said before --model's Hub request (a model no Hub has: its error came first)
    code, err, seconds = _run([command, "--dataset", "data/train.jsnl", "--model", "nowhere/model",
                               "--output-dir", "out"], capsys)
    assert (code, err) == (2, f"fastgrpo {command}: error: dataset: no such file or folder data/train.jsnl (resolved: "
                              f"{project / 'data' / 'train.jsnl'}; did you mean data/train.jsonl?); --dataset takes a "
                              f"{DATA_FILE_FORMS}\n")
    assert seconds < AT_ONCE_S, seconds
    assert not (project / "out").exists()


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_mistyped_eval_dataset_path_is_one_line_before_the_model(command, project, refusing_hub, capsys):
    code, err, _ = _run([command, "--dataset", "data/train.jsonl", "--eval-dataset", "data/tset.jsonl",
                         "--eval-steps", "1", "--model", "nowhere/model", "--output-dir", "out"], capsys)
    assert (code, err) == (2, f"fastgrpo {command}: error: eval_dataset: no such file or folder data/tset.jsonl "
                              f"(resolved: {project / 'data' / 'tset.jsonl'}); --eval-dataset takes a "
                              f"{DATA_FILE_FORMS}\n")


def test_a_yaml_files_data_path_names_the_file(project, refusing_hub, capsys):
    (project / "run.yaml").write_text("dataset: data/train.jsnl\n")
    code, err, _ = _run(["train", "--config", "run.yaml", "--output-dir", "out"], capsys)
    assert code == 2
    assert err.startswith(f"fastgrpo train: error: dataset (from run.yaml): no such file or folder data/train.jsnl "
                          f"(resolved: {project / 'data' / 'train.jsnl'}; did you mean data/train.jsonl?); --dataset "
                          "takes a "), err


@pytest.mark.parametrize("typed, meant", [
    ("./mydata", "my_data"),  # was datasets' "Repo id must use alphanumeric chars ...", naming no setting
    ("my_dat/", "my_data"),
    ("dat/train.jsonl", "data/train.jsonl"),  # a folder mistyped: was sent to the Hub as dat/train.jsonl
    ("data/trian.jsonl", "data/train.jsonl"),
    ("trian.jsonl", None),  # nothing close in the current folder
    ("data/train.parqet", None),
    ("dat/nope.jsonl", "data/"),  # the folder meant, where the file is missing too
])
def test_a_name_written_as_a_path_is_never_a_hub_id(typed, meant, project, refusing_hub):
    with pytest.raises(ValueError) as err:
        load_rows(typed)
    close = f"; did you mean {meant}?" if meant else ""
    assert str(err.value) == (f"dataset: no such file or folder {typed} (resolved: {os.path.abspath(typed)}{close}); "
                              f"dataset takes a {DATA_FILE_FORMS}")


def test_a_home_path_is_said_as_resolved(project, refusing_hub, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(project))
    code, err, _ = _run(["train", "--dataset", "~/x.parquet", "--output-dir", "out"], capsys)
    assert (code, err) == (2, f"fastgrpo train: error: dataset: no such file or folder {project / 'x.parquet'}; "
                              f"--dataset takes a {DATA_FILE_FORMS}\n")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("hub", ["refusing_hub", "silent_hub"])
def test_a_hub_id_the_hub_cannot_answer_for_is_one_line_at_once(command, hub, project, request, capsys):
    # refused: 23 s of datasets' retries, twice; silent: each of those 6 requests waited out its timeout too (minutes)
    request.getfixturevalue(hub)
    code, err, seconds = _run([command, "--dataset", "owner/rows", "--output-dir", "out"], capsys)
    assert seconds < AT_ONCE_S, seconds
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fastgrpo {command}: error: dataset: no such file or folder owner/rows, and the Hub dataset "
                          f"owner/rows is not in datasets' cache ({project / 'datasets_cache'}) while the Hugging Face "
                          "Hub cannot be reached ("), err


def test_a_name_the_hub_has_not_is_one_line_offering_the_folder_meant(project, hub, capsys):
    # was "dataset: no such file or folder mydata, and datasets could not load it from the Hub: Dataset 'mydata'
    # doesn't exist on the Hub or cannot be accessed."
    code, err, _ = _run(["train", "--dataset", "mydata", "--output-dir", "out"], capsys)
    assert (code, err) == (2, f"fastgrpo train: error: dataset: no such file or folder mydata (resolved: "
                              f"{project / 'mydata'}; did you mean my_data?), nor a dataset on the Hugging Face Hub "
                              "(or a private one: log in with `hf auth login`)\n")


def test_an_offline_flag_is_named(project, refusing_hub, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError) as err:
        check_dataset_source("owner/rows")
    assert str(err.value) == (f"dataset: no such file or folder owner/rows, and the Hub dataset owner/rows is not in "
                              f"datasets' cache ({project / 'datasets_cache'}) while HF_DATASETS_OFFLINE is set")
    # its files downloaded (`hf download --repo-type dataset owner/rows`): not refused, datasets says what it reads
    (project / "hub_cache" / "datasets--owner--rows" / "snapshots" / "0123abc").mkdir(parents=True)
    check_dataset_source("owner/rows")


def _cache_as_hub_dataset(cache: Path, repo_id: str, data: Path) -> None:
    """datasets' cache of the Hub dataset repo_id holding data's rows, as load_dataset(repo_id) leaves it: the json
    builder's cache of them, moved to namespace___name/default/0.0.0/<hash>/ under the dataset's name."""
    datasets.load_dataset("json", data_files=str(data), cache_dir=str(cache / "build"))
    built = next((cache / "build" / "json").glob("*/0.0.0/*/"))
    namespace, name = repo_id.split("/")
    kept = cache / f"{namespace}___{name}" / "default" / "0.0.0" / built.name
    shutil.copytree(built, kept)
    info = json.loads((kept / "dataset_info.json").read_text())
    (kept / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default", "dataset_name": name}))
    (kept / "json-train.arrow").rename(kept / f"{name}-train.arrow")


def test_a_cached_hub_dataset_loads_offline_and_is_not_refused_while_the_hub_is_unreachable(
        project, refusing_hub, monkeypatch, caplog):
    # datasets reads its cache where the Hub cannot answer: the check must not refuse what would load
    _cache_as_hub_dataset(project / "datasets_cache", "owner/my_rows", project / "data" / "train.jsonl")
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        check_dataset_source("owner/my_rows")  # datasets would retry, then read the cache: said, not refused
    [said] = [record.getMessage() for record in caplog.records]
    assert said.startswith("dataset: the Hugging Face Hub cannot be reached ("), said
    assert said.endswith("): datasets retries it (half a minute or more) before it reads owner/my_rows from its "
                         "cache; HF_HUB_OFFLINE=1 skips that"), said
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert [dict(row) for row in load_rows("owner/my_rows")] == [ROW]


def test_a_name_that_is_no_hub_id_says_so(project, refusing_hub):
    with pytest.raises(ValueError) as err:
        check_dataset_source("my data")
    assert str(err.value) == (f"dataset: no such file or folder my data (resolved: {project / 'my data'}; did you "
                              f"mean my_data?), nor a Hugging Face dataset id (namespace/name); dataset takes a "
                              f"{DATA_FILE_FORMS}")


def test_a_dataset_the_hub_has_is_let_through(project, hub):
    hub["/api/datasets/owner/rows"] = (200, None, json.dumps({"id": "owner/rows"}).encode())
    check_dataset_source("owner/rows")


def test_a_cached_dataset_the_hub_has_not_loads_from_the_cache_without_a_warning(project, hub, caplog):
    # datasets reads its cache where the Hub answers it has no such dataset (deleted, or private and logged out), at
    # once: nothing to refuse, and no retries to warn of
    _cache_as_hub_dataset(project / "datasets_cache", "owner/my_rows", project / "data" / "train.jsonl")
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        assert [dict(row) for row in load_rows("owner/my_rows")] == [ROW]
    assert not [record for record in caplog.records if record.name.startswith("fastgrpo")], caplog.text


def test_an_eval_dataset_the_run_does_not_evaluate_on_is_left_alone(project, refusing_hub, capsys):
    # no --eval-steps: the run never reads it, so a typo in it stops nothing (the model's error is the error here);
    # a warning says it is not evaluated on
    code, err, _ = _run(["train", "--dataset", "data/train.jsonl", "--eval-dataset", "data/tset.jsonl", "--model",
                         "nowhere/model", "--output-dir", "out"], capsys)
    warning, error = err.splitlines()
    assert warning.startswith("fastgrpo train: warning: eval_dataset: data/tset.jsonl is not evaluated on"), err
    assert code == 2 and error.startswith("fastgrpo train: error: model: no such folder nowhere/model, "), err


def test_datasets_remote_forms_are_left_to_datasets(project, refusing_hub):
    for name in ("hf://datasets/owner/rows", "buckets/owner/bucket/rows"):
        assert not looks_local(name)
        check_dataset_source(name)  # no refusal: datasets reads these itself


@contextlib.contextmanager
def _in_folder(folder: Path):  # contextlib.chdir, which Python 3.10 lacks; monkeypatch is per test, not per example
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


_ID_PART = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)


@pytest.fixture(scope="module")
def empty_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("empty")


@given(namespace=_ID_PART, name=_ID_PART, suffix=st.sampled_from(FILE_SUFFIXES))
def test_a_hub_id_is_no_path_and_a_data_files_name_is(empty_folder, namespace, name, suffix):
    with _in_folder(empty_folder):  # no folder here is named like a namespace
        assert not looks_local(name) and not looks_local(f"{namespace}/{name}")
        assert looks_local(f"{name}{suffix}") and looks_local(f"{namespace}/{name}{suffix}")


@pytest.mark.parametrize("name, local", [
    ("data\\train", True),  # a Windows path
    ("owner/name/extra", True),  # two slashes: no Hub id has them
    ("rows.cvs", True), ("rows.tx", True), ("ROWS.JSONL", True),  # a data file's suffix mistyped, or in capitals
    ("owner/model.v2", False), ("owner/gpt-3.5", False),  # Hub ids with a dot
])
def test_a_name_is_read_as_a_local_path(empty_folder, name, local):
    with _in_folder(empty_folder):
        assert looks_local(name) == local, name


RUN_FLAGS = {  # one short step (round) of each command on project's row, the built-in model, evaluating at it
    "train": ["--reward-funcs", "length", "--max-steps", "1", "--batch-size", "8", "--micro-batch-size", "8"],
    "sft": ["--response-column", "answer", "--max-steps", "1", "--batch-size", "1", "--max-seq-length", "64"],
    "ei": ["--reward-funcs", "length", "--prompt-format", "raw", "--ei-steps", "1"],
}


def _counted(monkeypatch, module, name: str) -> list:
    """The first argument of each call of module.name from now on."""
    calls, original = [], getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def _run_evaluating(command: str, eval_flags: list[str], capsys) -> None:
    code, err, _ = _run([command, "--dataset", "data/train.jsonl", *eval_flags, "--eval-steps", "1",
                         "--eval-max-examples", "1", "--output-dir", "out", "--no-export", "--no-progress-bar",
                         "--logging-steps", "0", *RUN_FLAGS[command]], capsys)
    assert code == 0, err
    assert (Path("out") / "eval" / "step-1_summary.json").is_file()  # it evaluated


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_runs_eval_dataset_is_read_once(command, project, refusing_hub, monkeypatch, capsys):
    # read before the model loads (its mistakes said then), and again by the trainer for its evaluation
    import fastgrpo.train.dataset_rows as dataset_rows

    (project / "data" / "test.jsonl").write_text(json.dumps(ROW) + "\n")
    reads = _counted(monkeypatch, dataset_rows, "read_json_rows")
    _run_evaluating(command, ["--eval-dataset", "data/test.jsonl"], capsys)
    assert sorted(map(str, reads)) == ["data/test.jsonl", "data/train.jsonl"], reads


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_hub_eval_dataset_is_asked_of_the_hub_and_loaded_once(command, project, hub, monkeypatch, capsys):
    # train asked the Hub (and datasets loaded it) before the model loaded and again for the trainer's evaluation
    import fastgrpo.train.dataset_source as dataset_source

    _cache_as_hub_dataset(project / "datasets_cache", "owner/my_rows", project / "data" / "train.jsonl")
    asked = _counted(monkeypatch, dataset_source, "ask_hub")
    # each load of a Hub dataset resolves it first (load_dataset_builder): a Hub round trip, or its cache looked up
    loads = _counted(monkeypatch, datasets.load, "dataset_module_factory")
    if command == "eval":
        code, err, _ = _run(["eval", "--dataset", "owner/my_rows", "--dataset-split", "train", "--prompt-format",
                             "raw", "--reward-funcs", "length", "--output-dir", "out"], capsys)
        assert code == 0, err
    else:
        _run_evaluating(command, ["--eval-dataset", "owner/my_rows", "--eval-dataset-split", "train"], capsys)
    assert (asked, loads) == (["owner/my_rows"], ["owner/my_rows"])
