"""A run's exported final/ of the built-in tiny model: its tokenizer reloads with AutoTokenizer (as fastgrpo's own
`--model` loading does) to the ids the run trained on, and `fastgrpo eval --model` on it reads the prompts as the
run did; a generation length past the model's positions is refused with the length that fits."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from fastgrpo.rewards import r1_zero_math_reward
from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import read_checkpoint
from fastgrpo.train.final_export import export_model
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.evaluate import build_eval_task
from fastgrpo.train.loading import load_inference_model
from fastgrpo.train.trainer import GRPOTrainer

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
# spaces (which a generic tokenizer in a qwen2 folder lost on reload), runs of them, every known character, specials
TEXTS = ["914 say b", "  a:b  c ", " " + default_task.CHARACTERS, "say c<eos><pad>", ""]


def _check_reloads_as_built(folder):
    built, reloaded = default_task.build_tokenizer(), AutoTokenizer.from_pretrained(folder)
    assert type(reloaded) is type(built) and len(reloaded) == len(built)
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.padding_side) == (0, 1, "left")
    for text in TEXTS:
        ids = built(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids, text
        assert reloaded.decode(ids) == text
    # a character the vocabulary lacks is dropped by both alike (Qwen2Tokenizer's BPE has no unknown token)
    assert reloaded("Say B!")["input_ids"] == built("Say B!")["input_ids"] == built("ay ")["input_ids"]


def test_an_exported_builtin_model_reloads_its_tokenizer_with_the_training_ids(tmp_path):
    tokenizer = default_task.build_tokenizer()
    assert tokenizer("914 say b")["input_ids"] == [38, 30, 33, 39, 21, 3, 27, 39, 4]  # the ids runs trained on
    folder = export_model(default_task.build_model(tokenizer), tokenizer, tmp_path / "final", run_config={})
    _check_reloads_as_built(folder)
    _, loaded = load_inference_model(model=str(folder), dtype="float32", device="cpu")  # eval/train --model
    assert loaded("914 say b")["input_ids"] == tokenizer("914 say b")["input_ids"]


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_final_of_a_builtin_run_reloads_its_tokenizer(tmp_path, command):
    assert main([command, "--max-steps", "1", "--output-dir", str(tmp_path), *QUIET]) == 0
    _check_reloads_as_built(tmp_path / "final")


def test_builtin_tokenizer_refuses_characters_outside_one_byte():
    with pytest.raises(ValueError, match=r"characters: expected ASCII characters .*got \['é'\]"):
        default_task.build_tokenizer("abé")


def test_eval_of_a_builtin_runs_final_matches_its_checkpoint(tmp_path):
    """--model run/final of a tiny-model run takes the tiny model's eval presets (its 8 new tokens, not the default
    1024 its 64 positions cannot hold) and the run's prompt format, as --checkpoint does: the same prompts (spaces
    and all) and completions."""
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "2", "--output-dir", str(run), *QUIET]) == 0
    common = ["--max-examples", "8"]
    assert main(["eval", "--model", str(run / "final"), "--output-dir", str(tmp_path / "m"), *common]) == 0
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(tmp_path / "c"), *common]) == 0
    read = [[json.loads(line) for line in (tmp_path / out / "results.jsonl").read_text().splitlines()]
            for out in ("m", "c")]
    rows = default_task.build_held_out_dataset(num_rows=8, seed=0)  # eval's built-in rows (the run's seed 0)
    assert [r["prompt"] for r in read[0]] == [row["prompt"] for row in rows]  # spaces and all
    assert [(r["prompt"], r["completion"]) for r in read[0]] == [(r["prompt"], r["completion"]) for r in read[1]]


def test_prompts_past_the_positions_name_the_longest_and_the_length_that_fits():
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1 say a", "answer": "a"}, {"prompt": "1 say a " * 3, "answer": "a"}, {"prompt": "a",
                                                                                            "answer": "a"}]
    args = dict(prompt_column="prompt", prompt_format="raw", reward_funcs=[r1_zero_math_reward], max_positions=30)
    with pytest.raises(ValueError, match=r"row 1 has a 24-token prompt; with 8 new tokens that is 32 positions, over "
                                         r"the model's max_position_embeddings \(30\): shorten the prompts or lower "
                                         r"max_new_tokens to 6 or less$"):
        build_eval_task(rows, tokenizer, max_new_tokens=8, **args)
    assert build_eval_task(rows, tokenizer, max_new_tokens=6, **args)
    with pytest.raises(ValueError, match=r"shorten the prompts \(it leaves no position for a new token\)$"):
        build_eval_task(rows, tokenizer, max_new_tokens=1, **{**args, "max_positions": 24})


# ---- final/ of the run's last step: exported again when it is of an earlier one, kept when it is current ----
STEPS = {"train": ["--max-steps"], "sft": ["--max-steps"], "ei": ["--questions-per-step", "4", "--ei-steps"]}


def _files(folder):
    """Each file's bytes and modification time: a folder exported again differs, one left alone does not."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _exported_step(run):
    return json.loads((run / "final" / "export.json").read_text())["step"]


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_final_of_an_earlier_step_is_exported_again(tmp_path, command, capsys):
    """A run that went on with export off (or stopped before its export) left final/ of an earlier step; a resume
    with nothing left to train took it for the export and kept the older weights."""
    argv = [command, "--output-dir", str(tmp_path), *QUIET, *STEPS[command]]
    assert main([*argv, "1"]) == 0
    assert main([*argv, "2", "--no-export", "--resume"]) == 0
    assert f"export: {tmp_path / 'final'} holds the weights of an earlier point of this run" in capsys.readouterr().err
    assert main([*argv, "2", "--resume"]) == 0
    if command != "ei":  # (an ei round of the tiny model may keep no completion, and change nothing)
        final = load_file(tmp_path / "final" / "model.safetensors")
        trained = read_checkpoint(tmp_path / "checkpoint-2")["trainable"]
        assert all(torch.equal(final[name], value) for name, value in trained.items() if name in final)
    assert _exported_step(tmp_path) == 2


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_final_of_the_last_step_is_kept_as_it_is(tmp_path, command, capsys):
    argv = [command, "--output-dir", str(tmp_path), *QUIET, *STEPS[command], "1"]
    assert main(argv) == 0
    (tmp_path / "final" / "notes.txt").write_text("mine")
    kept = _files(tmp_path / "final")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0  # the user's notes.txt is not refused: nothing is exported
    assert "nothing to train" in capsys.readouterr().out
    assert main([*argv, "--resume", "--no-export"]) == 0
    assert _files(tmp_path / "final") == kept
    assert "earlier point" not in capsys.readouterr().err  # export off: final/ is the last step's, no warning


def test_files_put_in_a_final_to_be_exported_again_are_refused_not_deleted(tmp_path, capsys):
    """A resume that trains on writes final/ anew, which deleted what the user had put there; it is refused before
    the run trains, naming the files to move, and once they are moved the resume trains and exports."""
    argv = ["train", "--output-dir", str(tmp_path), *QUIET, "--max-steps"]
    final = tmp_path / "final"
    assert main([*argv, "1"]) == 0
    (final / "eval").mkdir()
    (final / "eval" / "summary.json").write_text("{}")
    capsys.readouterr()
    assert main([*argv, "2", "--resume"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(" (eval/summary.json), which exporting the run's last "
                                                             "step there would delete; move them out of it, then "
                                                             "start the run again")
    assert (final / "eval" / "summary.json").read_text() == "{}" and _exported_step(tmp_path) == 1
    (final / "eval").rename(tmp_path / "eval-step-1")
    assert main([*argv, "2", "--resume"]) == 0
    assert _exported_step(tmp_path) == 2


# the lengths of the tiny model, which a --model run does not take from the built-in presets
FITS = {"train": ["--max-prompt-length", "16", "--max-completion-length", "8"], "sft": ["--max-seq-length", "16"]}


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_run_that_will_export_into_a_final_holding_the_users_files_is_refused_before_the_model_loads(
        tmp_path, command, capsys):
    """The refusal came once the run was trained (hours, for a real one), the user then moving the files and resuming
    just to export; it comes before the model loads (its weights are gone here: loading would fail) and any step."""
    model, run = tmp_path / "model", tmp_path / "run"
    tokenizer = default_task.build_tokenizer()
    default_task.build_model(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    argv = [command, "--model", str(model), *FITS[command], "--output-dir", str(run), *QUIET, "--max-steps"]
    assert main([*argv, "1"]) == 0
    final, logged = run / "final", (run / "metrics.jsonl").read_text()
    (final / "eval").mkdir()
    (final / "eval" / "summary.json").write_text("{}")
    (model / "model.safetensors").unlink()
    capsys.readouterr()
    assert main([*argv, "2", "--resume"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"fastgrpo {command}: error: export: {final} holds files the export did not write (eval/summary.json), which "
        "exporting the run's last step there would delete; move them out of it, then start the run again")
    assert (run / "metrics.jsonl").read_text() == logged and not (run / "checkpoint-2").exists()
    assert (final / "eval" / "summary.json").read_text() == "{}" and _exported_step(run) == 1


def test_a_resumed_trainer_refuses_a_final_holding_the_users_files_before_its_first_step(tmp_path):
    """From Python too (GRPOTrainer.train with resume=True), before a step is trained."""
    config = dict(default_task.PRESET, batch_size=8, num_generations=4, micro_batch_size=4, output_dir=str(tmp_path),
                  progress_bar=False, logging_steps=0)

    def trainer(**fields):
        tokenizer = default_task.build_tokenizer()
        return GRPOTrainer(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward,
                           default_task.build_dataset(16), GRPOConfig(**{**config, **fields}))

    assert len(trainer(max_steps=1).train()) == 1
    (tmp_path / "final" / "notes.txt").write_text("mine")
    logged = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"final holds files the export did not write \(notes.txt\), which exporting "
                                         r"the run's last step there would delete; move them out of it, then start "
                                         r"the run again$"):
        trainer(max_steps=2, resume=True).train()
    assert (tmp_path / "metrics.jsonl").read_text() == logged and not (tmp_path / "checkpoint-2").exists()
    kept = _files(tmp_path / "final")
    assert trainer(max_steps=1, resume=True).train() == []  # nothing to train: final/ is current, kept
    assert _files(tmp_path / "final") == kept and kept["notes.txt"][0] == b"mine"


def test_files_put_in_a_final_while_the_run_trains_are_refused_at_its_end(tmp_path):
    """final/ checked before the first step can take files later: the export is refused once the checkpoint is
    saved, and a resume after they are moved exports it."""
    def writing_into_final(prompts, completions, letter, **kwargs):  # the user's files, put there mid-run
        (tmp_path / "final" / "notes.txt").write_text("mine")
        return default_task.repeat_letter_reward(prompts, completions, letter)

    config = dict(default_task.PRESET, batch_size=8, num_generations=4, micro_batch_size=4, output_dir=str(tmp_path),
                  progress_bar=False, logging_steps=0, max_steps=2)

    def trainer(reward, **fields):
        tokenizer = default_task.build_tokenizer()
        return GRPOTrainer(default_task.build_model(tokenizer), tokenizer, reward, default_task.build_dataset(16),
                           GRPOConfig(**{**config, **fields}))

    assert len(trainer(default_task.repeat_letter_reward, max_steps=1).train()) == 1
    with pytest.raises(ValueError, match=r"final holds files the export did not write \(notes.txt\), which exporting "
                                         r"checkpoint-2 there would delete; move them out of it, then resume "
                                         r"\(resume=True\) to export it$"):
        trainer(writing_into_final, resume=True).train()
    assert (tmp_path / "checkpoint-2").is_dir() and _exported_step(tmp_path) == 1
    (tmp_path / "final" / "notes.txt").unlink()
    assert trainer(default_task.repeat_letter_reward, resume=True).train() == []
    assert _exported_step(tmp_path) == 2


def test_a_final_exported_before_its_record_is_exported_again_keeping_the_users_files(tmp_path, capsys):
    """A final/ without export.json (exported by an earlier fastgrpo) is of an unknown step: exported again, unless
    it holds a file no model folder does, which is refused."""
    argv = ["train", "--output-dir", str(tmp_path), *QUIET, "--max-steps", "1"]
    final = tmp_path / "final"
    assert main(argv) == 0
    (final / "export.json").unlink()
    (final / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    assert "holds files the export did not write (notes.txt), which exporting checkpoint-1 " in capsys.readouterr().err
    (final / "notes.txt").unlink()
    assert main([*argv, "--resume"]) == 0
    assert _exported_step(tmp_path) == 1


# ---- eval --checkpoint with --model: the checkpoint's run trained the weights evaluated, its settings apply ----
def _completions(out):
    return [(r["prompt"], r["completion"]) for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())]


def test_eval_of_a_checkpoint_over_its_runs_final_takes_the_runs_settings(tmp_path, capsys):
    """--checkpoint run --model run/final of a tiny-model run lost the tiny model's presets (a --model was given) and
    failed on the default 1024 new tokens; the checkpoint's run trained the weights evaluated (a full fine-tune's
    checkpoint replaces every weight of the base): its presets and prompt format apply, as with --checkpoint alone."""
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "2", "--output-dir", str(run), *QUIET]) == 0
    common = ["--checkpoint", str(run), "--max-examples", "8"]
    assert main(["eval", *common, "--model", str(run / "final"), "--output-dir", str(tmp_path / "both")]) == 0
    assert main(["eval", *common, "--output-dir", str(tmp_path / "checkpoint")]) == 0
    assert _completions(tmp_path / "both") == _completions(tmp_path / "checkpoint")
    assert "warning" not in capsys.readouterr().err


def test_eval_of_a_lora_checkpoint_over_its_runs_final_is_refused(tmp_path, capsys):
    """The export has the run's adapter merged in: the checkpoint's adapter loaded over it applied it twice."""
    run, final = tmp_path / "run", tmp_path / "run" / "final"
    assert main(["train", "--max-steps", "1", "--lora-rank", "4", "--output-dir", str(run), *QUIET]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--model", str(final), "--output-dir", str(tmp_path / "o")]) == 2
    checkpoint = run / "checkpoint-1"
    assert capsys.readouterr().err == (
        f"fastgrpo eval: error: model: {final} is the export of the run of {checkpoint}, its LoRA adapter merged in: "
        f"the checkpoint's adapter loaded over it would apply twice; evaluate one of them (--model {final}, or "
        f"--checkpoint {checkpoint})\n")


def test_eval_of_a_checkpoint_over_another_runs_export_says_so(tmp_path, capsys):
    """--model of another run's export as the base of --checkpoint: one line says whose weights and settings are
    evaluated; none where the checkpoint's run trained on that export (sft, then train on its final/)."""
    first, other, then = tmp_path / "first", tmp_path / "other", tmp_path / "then"
    assert main(["train", "--max-steps", "1", "--output-dir", str(first), *QUIET]) == 0
    assert main(["train", "--max-steps", "1", "--seed", "1", "--output-dir", str(other), *QUIET]) == 0
    capsys.readouterr()
    common = ["--checkpoint", str(first), "--max-examples", "8"]
    assert main(["eval", *common, "--model", str(other / "final"), "--output-dir", str(tmp_path / "both")]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        f"fastgrpo eval: warning: model: {other / 'final'} is the export of another run than "
        f"{first / 'checkpoint-1'}'s: the weights evaluated are the checkpoint's, loaded over it as the base model, "
        "with the prompt settings of the checkpoint's run"]
    assert main(["eval", *common, "--output-dir", str(tmp_path / "checkpoint")]) == 0
    assert _completions(tmp_path / "both") == _completions(tmp_path / "checkpoint")
    assert main(["train", "--model", str(first / "final"), "--max-steps", "1", "--max-prompt-length", "16",
                 "--max-completion-length", "8", "--output-dir", str(then), *QUIET]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(then), "--model", str(first / "final"), "--max-new-tokens", "8",
                 "--max-examples", "8", "--output-dir", str(tmp_path / "then-eval")]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("command, default", [("train", "raw"), ("sft", "auto"), ("ei", "r1_zero")])
def test_a_run_from_an_export_says_when_it_prompts_unlike_the_export_learned(tmp_path, caplog, command, default):
    """The commands' default prompt formats differ, so sft -> train -> ei with the defaults prompted each export in
    a format it never saw, without a word (eval takes the export's own); a flag or YAML that sets it is not second-
    guessed."""
    import functools
    import logging

    from fastgrpo.train import commands
    from fastgrpo.train.cli import build_parser

    tokenizer = default_task.build_tokenizer()
    final = export_model(default_task.build_model(tokenizer), tokenizer, tmp_path / "final",
                         run_config={"prompt_format": "chat"})
    build = functools.partial(commands.config_from_args, command)
    argv = [command, "--model", str(final), "--dataset", "rows.jsonl"]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.commands"):
        assert build(build_parser().parse_args(argv)).prompt_format == default
        assert build(build_parser().parse_args([*argv, "--prompt-format", default])).prompt_format == default
    assert [r.getMessage() for r in caplog.records] == [
        f"prompt_format: {final} was trained on 'chat' prompts (its run_config.json), and this run prompts in "
        f"{default!r}, the default: pass prompt_format='chat' to prompt it as it learned, or "
        f"prompt_format={default!r} to keep this"]
    (final / "run_config.json").write_text("{")  # damaged: only eval needs it; this run does not stop for it
    assert build(build_parser().parse_args(argv)).prompt_format == default


def test_an_export_keeps_the_base_tokenizers_padding_side(tmp_path):
    """fastgrpo pads its own batches (left_pad), so loading a model's tokenizer leaves its padding_side as shipped:
    it used to set "left" on the tokenizer, and every export then saved "left" over a base's "right"."""
    from fastgrpo.train.loading import load_tokenizer

    tokenizer = default_task.build_tokenizer()
    tokenizer.padding_side = "right"
    model = default_task.build_model(tokenizer)
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    loaded = load_tokenizer(str(base))
    assert loaded.padding_side == "right"
    folder = export_model(model, loaded, tmp_path / "final", run_config={})
    assert AutoTokenizer.from_pretrained(folder).padding_side == "right"
