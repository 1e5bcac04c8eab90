"""`fastgrpo export`: a run's checkpoint as the model folder its final/ would be at that step (only the last step
became one, and anything else took Python: load_checkpoint + export_model); the folder starts a run and is
evaluated as a model; its output folder follows the run folders' rules."""
import json

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.train.checkpoint import load_checkpoint, read_run_config
from fastgrpo.train.final_export import export_model
from fastgrpo.train.cli import main
from fastgrpo.train.commands import CONFIGS
from fastgrpo.train.loading import load_model_and_tokenizer

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
RUNS = {"train-full": ["train"], "sft-lora": ["sft", "--lora-rank", "4"]}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, tmp_path_factory):
    """A built-in run of 2 steps with a checkpoint each, and its final/."""
    folder = tmp_path_factory.mktemp(request.param) / "run"
    command, *flags = RUNS[request.param]
    assert main([command, *flags, "--max-steps", "2", "--save-steps", "1", "--output-dir", str(folder), *QUIET]) == 0
    return folder


def _files(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _python_export(checkpoint, path, step):
    """What a user wrote without the command: the run's model rebuilt from its config (sft's has max_seq_length),
    the checkpoint loaded, the model exported."""
    saved = read_run_config(checkpoint)
    config = CONFIGS["sft" if "max_seq_length" in saved else "train"].from_dict({**saved, "device": "cpu"})
    model, tokenizer = load_model_and_tokenizer(config)
    load_checkpoint(checkpoint, model)
    return export_model(model, tokenizer, path, run_config=saved, step=step)


def test_an_export_of_a_checkpoint_equals_load_checkpoint_and_export_model(run, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["export", "--checkpoint", str(run / "checkpoint-1"), "--output-dir", str(out)]) == 0
    assert capsys.readouterr().out == f"exported {run / 'checkpoint-1'} (step 1) to {out}\n"
    want = _python_export(run / "checkpoint-1", tmp_path / "python", step=1)
    got, expected = load_file(out / "model.safetensors"), load_file(want / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name  # bit for bit
    assert _files(out) == _files(want)  # config, generation_config, tokenizer, run_config.json, export.json too
    assert json.loads((out / "export.json").read_text())["step"] == 1
    assert _files(out)["model.safetensors"] != _files(run / "final")["model.safetensors"]  # step 1's, not final/'s


def test_the_export_of_a_runs_newest_checkpoint_is_its_final(run, tmp_path):
    out = tmp_path / "model"
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(out)]) == 0
    assert _files(out) == _files(run / "final")


def test_an_export_starts_a_run_and_is_evaluated_as_its_checkpoint(tmp_path, capsys):
    """SFT's checkpoint-1 as GRPO's --model, and as eval's: the completions of its checkpoint; a run on the export
    cannot export over it (its checkpoints load over that base)."""
    run, out, then = tmp_path / "sft", tmp_path / "sft-1", tmp_path / "grpo"
    assert main(["sft", "--max-steps", "2", "--save-steps", "1", "--output-dir", str(run), *QUIET]) == 0
    assert main(["export", "--checkpoint", str(run / "checkpoint-1"), "--output-dir", str(out)]) == 0
    common = ["--max-examples", "8"]
    assert main(["eval", "--model", str(out), "--output-dir", str(tmp_path / "m"), *common]) == 0
    assert main(["eval", "--checkpoint", str(run / "checkpoint-1"), "--output-dir", str(tmp_path / "c"), *common]) == 0
    read = [[(r["prompt"], r["completion"]) for r in map(json.loads, (tmp_path / o / "results.jsonl").read_text()
                                                            .splitlines())] for o in ("m", "c")]
    assert read[0] == read[1]
    assert main(["train", "--model", str(out), "--max-steps", "1", "--max-prompt-length", "16",
                 "--max-completion-length", "8", "--output-dir", str(then), *QUIET]) == 0
    before = _files(out)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(then), "--output-dir", str(out), "--overwrite-output-dir"]) == 2
    assert capsys.readouterr().err == (
        f"fastgrpo export: error: output_dir: {out} is the base model of {then / 'checkpoint-1'}'s run, which its "
        "checkpoints load over; pick another --output-dir\n")
    assert _files(out) == before


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    assert main(["export", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    return out.err.removeprefix("fastgrpo export: error: ").rstrip("\n")


def test_what_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "1", "--output-dir", str(run), *QUIET]) == 0
    out = ["--output-dir", str(tmp_path / "model")]
    assert _refused(["--checkpoint", str(run / "final"), *out], capsys) == (
        f"checkpoint: {run / 'final'} is a model folder already, which transformers and --model load as it is; pass "
        "a run's checkpoint-<step>/ folder or its output_dir")
    assert _refused(["--checkpoint", str(tmp_path), *out], capsys) == (
        f"checkpoint: {tmp_path} is neither a checkpoint-<step>/ folder (with trainer_state.pt) nor an output_dir "
        "holding one")
    assert _refused(out, capsys) == ("checkpoint: expected a run's checkpoint-<step>/ folder or its output_dir; pass "
                                     "--checkpoint")
    assert _refused(["--checkpoint", str(run)], capsys) == "output_dir: expected the folder to write the model to; " \
                                                           "pass --output-dir"
    assert not (tmp_path / "model").exists()


def test_an_output_folder_is_new_or_empty_and_overwriting_replaces_an_export_only(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "model"
    assert main(["train", "--max-steps", "2", "--save-steps", "1", "--output-dir", str(run), *QUIET]) == 0
    out.mkdir()  # an empty folder takes it
    assert main(["export", "--checkpoint", str(run / "checkpoint-1"), "--output-dir", str(out)]) == 0
    first = _files(out)
    again = ["--checkpoint", str(run), "--output-dir", str(out)]
    assert _refused(again, capsys) == (
        f"output_dir: {out} is not empty (config.json, export.json, generation_config.json, model.safetensors, ...); "
        "pick another --output-dir, or replace that export with --overwrite-output-dir")
    assert _files(out) == first
    assert main(["export", *again, "--overwrite-output-dir"]) == 0
    assert _files(out) == _files(run / "final")
    (out / "notes.txt").write_text("mine")
    assert _refused([*again, "--overwrite-output-dir"], capsys) == (
        f"overwrite_output_dir: {out} holds files the export did not write (notes.txt), which exporting "
        "checkpoint-2 there would delete; move them out of it, then export again with --overwrite-output-dir")
    assert (out / "notes.txt").read_text() == "mine"
    assert _refused(["--checkpoint", str(run), "--output-dir", str(run)], capsys) == (
        f"output_dir: {run} is not empty (checkpoint-1, checkpoint-2, final, metrics.jsonl); pick another "
        "--output-dir")
    assert _refused(["--checkpoint", str(run), "--output-dir", str(run / "checkpoint-1" / "model")], capsys) == (
        f"output_dir: {run / 'checkpoint-1'} is a checkpoint of the run in {run}, which deletes it when it prunes "
        "checkpoints (and what is written in it); pick a folder outside it")
    assert not (run / "checkpoint-1" / "model").exists()


def test_an_output_dir_through_a_symlink_fills_the_folder_it_names(tmp_path):
    """The export replaces its folder whole (a rename): the folder the link names, the link kept."""
    run, target, link = tmp_path / "run", tmp_path / "disk" / "model", tmp_path / "model"
    assert main(["train", "--max-steps", "1", "--output-dir", str(run), *QUIET]) == 0
    target.mkdir(parents=True)
    link.symlink_to(target)
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(link)]) == 0
    assert link.is_symlink() and _files(target) == _files(run / "final")


def test_export_under_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    """Every process would load the checkpoint and replace the same folder: export runs in one process."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _refused(["--checkpoint", str(tmp_path / "run"), "--output-dir", str(tmp_path / "model")], capsys) == (
        "export: runs in one process (torchrun launched 2); run `fastgrpo export` without torchrun")
    assert not (tmp_path / "model").exists()
