"""`fastgrpo eval` and the periodic evaluation: per-example JSONL and a summary from the rollout engine, a run's
checkpoint evaluated with its trained weights, the r1_zero format / answer split, evaluation inside `train`."""
import json
import re

import pytest

from fastgrpo.rewards import r1_zero_math_reward
from fastgrpo.rewards.answers import r1_zero_grades
from fastgrpo.rollout import BuiltinEngine, SamplingParams
from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.evaluate import build_eval_task, evaluate

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
KEYS = {"prompt", "completion", "format_reward", "answer_reward", "reward", "correct", "length", "finish_reason"}


def _results(out):
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())


def test_builtin_eval_writes_its_files_and_guards_them(tmp_path, capsys):
    assert main(["eval", "--output-dir", str(tmp_path), "--max-examples", "16"]) == 0
    records, summary = _results(tmp_path)
    assert len(records) == 16 and KEYS <= set(records[0]) and records[0]["format_reward"] is None
    assert summary["num_examples"] == 16 and summary["format_rate"] is None
    assert summary["accuracy"] == sum(r["correct"] for r in records) / 16
    assert summary["reward"] == pytest.approx(sum(r["reward"] for r in records) / 16)
    assert summary["completion_length"] == sum(r["length"] for r in records) / 16
    capsys.readouterr()
    assert main(["eval", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # eval has no --resume to suggest; its files are an evaluation's results, not "another run"
    assert "holds the results of a `fastgrpo eval` (results.jsonl, summary.json)" in err and "--resume" not in err, err
    # another command's log beside it is not eval's to delete, even when eval overwrites its own files
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["eval", "--output-dir", str(tmp_path), "--overwrite-output-dir", "--max-examples", "4"]) == 0
    assert len(_results(tmp_path)[0]) == 4
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_model_folder_without_weights_is_one_line_naming_the_model(tmp_path, capsys):
    folder = tmp_path / "no_weights"  # a config and a tokenizer: transformers raises OSError at the weights
    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(folder)
    default_task.build_model(tokenizer).config.save_pretrained(folder)
    # 8 new tokens: the model's 64 positions have no room for the default 1024, found before the load
    assert main(["eval", "--model", str(folder), "--max-new-tokens", "8", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastgrpo eval: error: model: cannot load '{folder}' from the local folder") and \
        err.count("\n") == 1, err


def test_checkpoint_of_a_run_is_evaluated_with_its_weights(tmp_path):
    run = tmp_path / "sft"
    assert main(["sft", "--output-dir", str(run), "--max-steps", "24", "--no-export", *QUIET]) == 0
    untrained, trained = tmp_path / "untrained", tmp_path / "trained"
    assert main(["eval", "--output-dir", str(untrained), "--max-examples", "32"]) == 0
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(trained), "--max-examples", "32"]) == 0
    before, after = _results(untrained)[1], _results(trained)[1]
    assert after["checkpoint"].endswith("checkpoint-24")
    assert after["accuracy"] > before["accuracy"] + 0.3, (before["accuracy"], after["accuracy"])


def test_a_checkpoint_is_evaluated_in_its_runs_prompt_format_unless_told_otherwise(tmp_path, capsys):
    """eval's own default is r1_zero; a run trained on raw prompts (train's default) with its own stop strings is
    evaluated with both, from its checkpoint or its exported final/ (which carries run_config.json), said in the
    log, and a flag still wins."""
    run, data = tmp_path / "run", tmp_path / "rows.jsonl"
    assert main(["train", "--output-dir", str(run), "--max-steps", "1", "--stop", "b", *QUIET]) == 0
    data.write_text("".join(json.dumps(row) + "\n" for row in default_task.build_dataset(4, seed=1)))
    scoring = ["--dataset", str(data), "--reward-funcs", *default_task.REWARD_FUNCS]
    common = ["eval", "--checkpoint", str(run), *scoring]
    capsys.readouterr()
    assert main([*common, "--output-dir", str(tmp_path / "taken")]) == 0
    assert "eval: prompt_format 'raw', stop ['b'] as the checkpoint's run trained" in capsys.readouterr().err
    config = _results(tmp_path / "taken")[1]["config"]
    assert (config["prompt_format"], config["stop"]) == ("raw", ["b"])
    assert main(["eval", "--model", str(run / "final"), *scoring, "--output-dir", str(tmp_path / "final"),
                 "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert f"eval: prompt_format 'raw', stop ['b'] as the run that exported {run / 'final'} trained" in err, err
    config = _results(tmp_path / "final")[1]["config"]
    assert (config["prompt_format"], config["stop"]) == ("raw", ["b"])
    # a damaged or foreign run_config.json beside the model: one line naming it, not a traceback
    flags = [*scoring, "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "8"]
    for text, problem in (("[1, 2]", "a JSON list, not an object"), ("{broken", "Expecting property name")):
        (run / "final" / "run_config.json").write_text(text)
        assert main(["eval", "--model", str(run / "final"), *flags, "--output-dir", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert f"error: model: {run / 'final' / 'run_config.json'} is damaged ({problem}" in err, err
        assert err.count("\n") == 1 and "delete it (it only tells `fastgrpo eval` how the run prompted" in err, err
    # the flag's r1_zero: its template is longer than the tiny model's 64 positions, which says which format ran
    assert main([*common, "--output-dir", str(tmp_path / "told"), "--prompt-format", "r1_zero"]) == 2
    err = capsys.readouterr().err
    assert "eval: stop ['b'] as the checkpoint's run trained" in err and "as --prompt-format r1_zero wraps it" in err


def test_a_row_without_a_column_the_reward_reads_is_named():
    """A JSONL file's rows arrive as a list and may differ: the row lacking the reward's column is named before
    anything runs (it reached the reward as None, whose TypeError named no row)."""
    rows = [{"prompt": "1 say a", "letter": "a"}, {"prompt": "2 say b"}]
    with pytest.raises(ValueError, match=r"dataset: row 1 has no column 'letter'; row 0 has \['prompt', 'letter'\]"):
        build_eval_task(rows, default_task.build_tokenizer(), prompt_column="prompt", prompt_format="raw",
                        reward_funcs=[default_task.repeat_letter_reward], field="dataset")


@pytest.mark.parametrize("answer, problem", [(None, "null"), ("", "empty")])
def test_a_row_without_an_answer_is_named_before_anything_runs(tmp_path, capsys, answer, problem):
    """`"answer": null` (or "") in an eval file scored every completion of the row 0 against the text "None" (or
    nothing): a lower accuracy with no hint. eval refuses it in one line, before a token is generated."""
    data = tmp_path / "math.jsonl"
    rows = [{"prompt": "1 say 2", "answer": "2"}, {"prompt": "2 say 4", "answer": answer}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    assert main(["eval", "--dataset", str(data), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"fastgrpo eval: error: dataset: row 1 has no answer (the answer column is {problem}); reward "
                   "function r1_zero_math_reward needs one per row\n"), err
    assert not (out / "results.jsonl").exists()


@pytest.mark.parametrize("command", ["train", "ei", "eval"])
def test_a_dataset_mistake_is_named_before_the_model_loads(tmp_path, capsys, command):
    """A null answer (or a missing column) in the rows was found once the model had loaded, minutes into a run of a
    large one; each command checks the rows it scores first. The model folder here has no weights: loading it
    first would fail on the model instead."""
    folder = tmp_path / "no_weights"
    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(folder)
    default_task.build_model(tokenizer).config.save_pretrained(folder)
    data = tmp_path / "math.jsonl"
    rows = [{"prompt": "1 say 2", "answer": "2"}, {"prompt": "2 say 4", "answer": None}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # lengths within the model's 64 positions, which are checked before the weights load too
    reward = [] if command == "eval" else ["--reward-funcs", "r1_zero_math", "--max-prompt-length", "32",
                                           "--max-completion-length", "16"]
    argv = [command, "--model", str(folder), "--dataset", str(data), *reward, "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"fastgrpo {command}: error: dataset: row 1 has no answer (the answer column is null); reward "
                   "function r1_zero_math_reward needs one per row\n"), err


def test_an_over_long_prompt_says_how_it_was_wrapped():
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1 say a", "answer": "a"}]
    args = dict(prompt_column="prompt", reward_funcs=[r1_zero_math_reward], reward_weights=None,
                correct_threshold=1.0, max_examples=0, field="dataset", max_prompt_length=16)
    with pytest.raises(ValueError, match=r"row 0 has a \d+-token prompt as prompt_format='r1_zero' wraps it \(raw: "
                                         r"as written\), over max_prompt_length \(16\)"):
        build_eval_task(rows, tokenizer, prompt_format="r1_zero", **args)
    assert len(build_eval_task(rows, tokenizer, prompt_format="raw", **args).prompt_ids[0]) <= 16


def test_a_prompt_past_the_models_positions_is_refused_before_anything_runs(tmp_path, capsys):
    """eval, and train's periodic evaluation: the row is named before a token is generated or a step trained."""
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1 say a", "answer": "a"}, {"prompt": "1 say a " * 6, "answer": "a"}]
    n = len(build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw",
                            reward_funcs=[r1_zero_math_reward]).prompt_ids[1])
    args = dict(prompt_column="prompt", prompt_format="raw", reward_funcs=[r1_zero_math_reward], max_positions=n + 4)
    assert build_eval_task(rows, tokenizer, max_new_tokens=4, **args)  # exactly at the limit
    with pytest.raises(ValueError, match=rf"eval_dataset: row 1 has a {n}-token prompt; with 5 new tokens that is "
                                         rf"{n + 5} positions, over the model's max_position_embeddings \({n + 4}\)"):
        build_eval_task(rows, tokenizer, max_new_tokens=5, **args)

    data = tmp_path / "long.jsonl"  # the built-in model has 64 positions
    data.write_text(json.dumps({"prompt": "x " * 40, "letter": "a"}) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--eval-steps", "1", "--eval-dataset", str(data), "--output-dir", str(out), *QUIET]) == 2
    err = capsys.readouterr().err
    assert "eval_dataset: row 0 has a 80-token prompt; with 8 new tokens that is 88 positions" in err, err
    assert not out.exists()


def test_checkpoint_and_model_mixed_up_point_to_each_other(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "checkpoint-1").mkdir()
    (run / "checkpoint-1" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoint-1" / "run_config.json").write_text('{"prompt_format": "raw"}')
    for argv, message in [
        (["--checkpoint", str(run / "final")], "; it is a model folder: pass it as --model"),
        # not read as an exported final/ (its run_config.json): no 'prompt_format as the run trained' line
        (["--model", str(run / "checkpoint-1")], f"model: {run / 'checkpoint-1'} is a run's checkpoint, not a model "
                                                 "folder: pass it as --checkpoint"),
        (["--model", str(run)], "(a run's folder: --model takes its final/; fastgrpo eval --checkpoint takes the run)"),
        (["--checkpoint", str(tmp_path / "nope")], f"checkpoint: no such folder {tmp_path / 'nope'}"),
    ]:
        assert main(["eval", *argv, "--output-dir", str(tmp_path / "out")]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_a_checkpoint_whose_base_model_moved_names_the_flag_for_its_new_path(tmp_path, capsys):
    """A LoRA (or full) checkpoint loads over its run's base model; with that folder moved, eval failed inside
    transformers ('Repo id must be in the form ...'), saying nothing of --model, which takes the base's new path."""
    checkpoint = tmp_path / "run" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.pt").write_bytes(b"")
    (checkpoint / "run_config.json").write_text(json.dumps({"model": str(tmp_path / "base"), "prompt_format": "raw"}))
    assert main(["eval", "--checkpoint", str(checkpoint), "--output-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == (f"fastgrpo eval: error: model: no such folder {tmp_path / 'base'} (the base model of "
                     f"{checkpoint}'s run): pass its new path as --model")


def test_r1_zero_grades():
    assert r1_zero_grades("so 2 + 2 </think> <answer> 4 </answer>", "4") == (1.0, 1.0)
    assert r1_zero_grades("so 2 + 2 </think> <answer> 5 </answer>", "4") == (1.0, 0.0)
    assert r1_zero_grades("the answer is 4", "4") == (0.0, 0.0)


def test_r1_zero_split_and_prompt_format():
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    rows = [{"prompt": f"{i} say a", "answer": "a"} for i in range(3)]
    task = build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw",
                           reward_funcs=[r1_zero_math_reward])
    records, summary = evaluate(BuiltinEngine(model, tokenizer), tokenizer, task, SamplingParams(max_new_tokens=4),
                                num_generations=2, batch_size=2)
    assert [(r["index"], r["sample"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["format_reward"] == 0.0 and r["answer_reward"] == 0.0 and r["answer"] == "a" for r in records)
    assert summary["format_rate"] == 0.0 and summary["num_samples"] == 6 and summary["num_examples"] == 3
    with pytest.raises(ValueError, match="row 0: prompt_format: 'r1_zero' wraps a text question"):
        build_eval_task([{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}], tokenizer,
                        prompt_column="prompt", prompt_format="r1_zero", reward_funcs=[r1_zero_math_reward])
    with pytest.raises(ValueError, match="needs columns \\['answer'\\]"):
        build_eval_task([{"prompt": "q"}], tokenizer, prompt_column="prompt", prompt_format="raw",
                        reward_funcs=[r1_zero_math_reward])


def test_periodic_eval_inside_train(tmp_path, capsys):
    out = tmp_path / "grpo"
    assert main(["train", "--output-dir", str(out), "--max-steps", "2", "--batch-size", "16", "--micro-batch-size",
                 "16", "--eval-steps", "2", "--eval-max-examples", "8", "--no-export", "--no-progress-bar",
                 "--logging-steps", "1"]) == 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((out / "eval" / "step-2_summary.json").read_text())
    assert last["eval/accuracy"] == summary["accuracy"] and summary["num_examples"] == 8
    assert len((out / "eval" / "step-2.jsonl").read_text().splitlines()) == 8
    out_text, err = capsys.readouterr()
    assert "eval step 2 |" in err  # a few generations in the log
    # the console line of the step that evaluated shows its accuracy; the other's does not
    lines = [line for line in out_text.splitlines() if line.startswith("step ")]
    assert "eval/accuracy" not in lines[0] and f"eval/accuracy {summary['accuracy']:.3f}" in lines[1], lines
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1 say a", "letter": "a"}) + "\n")
    assert main(["train", "--dataset", str(data), "--eval-steps", "1", "--output-dir", str(tmp_path / "x")]) == 2
    assert "eval_dataset: eval_steps > 0 on your own dataset" in capsys.readouterr().err


def test_a_prompt_past_the_models_positions_names_the_flag_to_lower(tmp_path, capsys):
    """On the command line the fix names the flag (it named the field: 'lower max_new_tokens to 55')."""
    assert main(["eval", "--max-new-tokens", "100", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"over the model's max_position_embeddings \(64\): shorten the prompts or lower "
                     r"--max-new-tokens to \d+ or less\n$", err), err


@pytest.mark.parametrize("inside", ["checkpoint-1", "final", "final/eval"])
def test_results_inside_a_runs_checkpoint_or_final_are_refused(tmp_path, capsys, inside):
    """The run deletes its checkpoint-<step>/ when it prunes and replaces final/ when it exports again: an eval's
    results written there would go with them. One line, before the model loads; the run's folder itself is fine."""
    run = tmp_path / "run"
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "checkpoint-1" / "trainer_state.pt").write_bytes(b"")
    (run / "final").mkdir()
    (run / "final" / "run_config.json").write_text("{}")
    assert main(["eval", "--output-dir", str(run / inside), "--max-examples", "4"]) == 2
    err = capsys.readouterr().err
    folder = run / inside.split("/")[0]
    assert err.count("\n") == 1 and f"output_dir: {folder} is " in err and "pick a folder outside it" in err, err
    assert not (run / inside / "results.jsonl").exists()
