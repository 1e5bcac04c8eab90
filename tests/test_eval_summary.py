"""`fastgrpo eval`'s summary.json: every number recomputed from results.jsonl, pass@k checked by hand and by
enumerating the k-subsets of each example's samples."""
import itertools
import json
from datetime import datetime

import pytest
import torch

import fastgrpo
from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.evaluate import pass_at_k

QUIET = ["--no-progress-bar", "--logging-steps", "0"]


def _results(out):
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())


def _records(correct_per_example):
    return [{"index": i, "sample": s, "correct": c} for i, row in enumerate(correct_per_example)
            for s, c in enumerate(row)]


def test_pass_at_k_by_hand():
    """Example 0: 1 of 4 correct: pass@1 1/4, pass@2 1 - C(3,2)/C(4,2) = 1/2, pass@4 1; example 1: none correct."""
    summary = pass_at_k(_records([[False, True, False, False], [False] * 4]))
    assert summary == pytest.approx({"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5})
    assert set(pass_at_k(_records([[True] * 6]))) == {"pass@1", "pass@2", "pass@4", "pass@6"}
    assert pass_at_k(_records([[True], [False]])) == {}  # one sample: the accuracy says it


def _pass_by_enumeration(records, k):
    """The fraction of k-subsets of an example's samples holding a correct one, averaged over examples."""
    by_index = {}
    for r in records:
        by_index.setdefault(r["index"], []).append(r["correct"])
    fractions = []
    for samples in by_index.values():
        subsets = list(itertools.combinations(samples, k))
        fractions.append(sum(any(s) for s in subsets) / len(subsets))
    return sum(fractions) / len(fractions)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def test_the_summary_equals_what_the_jsonl_gives(tmp_path, capsys):
    """Four samples of 12 rows, two weighted rewards and a threshold some completions reach: accuracy, pass@k, the
    reward, each function's mean and the lengths recomputed from the per-example lines."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} say {c}", "letter": c}) + "\n"
                            for i, c in enumerate("abcdabcdabcd")))
    out = tmp_path / "out"
    assert main(["eval", "--dataset", str(data), "--prompt-format", "raw", "--num-generations", "4",
                 "--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward", "length",
                 "--reward-weights", "2", "1", "--correct-threshold", "0.1", "--output-dir", str(out)]) == 0
    records, summary = _results(out)
    assert len(records) == 48 and summary["num_examples"] == 12 and summary["num_samples"] == 48
    assert 0 < summary["accuracy"] < 1, summary["accuracy"]  # a run where pass@k says something
    assert summary["accuracy"] == _mean(r["correct"] for r in records)
    for k in (1, 2, 4):
        assert summary[f"pass@{k}"] == pytest.approx(_pass_by_enumeration(records, k)), k
    assert summary["pass@1"] == pytest.approx(summary["accuracy"])
    assert f"accuracy {summary['accuracy']:.3f}, pass@4 {summary['pass@4']:.3f}, reward" in capsys.readouterr().out
    assert summary["reward"] == pytest.approx(_mean(r["reward"] for r in records))
    for name in ("repeat_letter_reward", "length_reward"):
        assert summary[f"rewards/{name}"] == pytest.approx(_mean(r[f"rewards/{name}"] for r in records)), name
    assert all(r["reward"] == pytest.approx(2 * r["rewards/repeat_letter_reward"] + r["rewards/length_reward"])
               for r in records)
    assert summary["completion_length"] == _mean(r["length"] for r in records)
    assert summary["completion_length_correct"] == _mean(r["length"] for r in records if r["correct"])
    assert summary["completion_length_max"] == max(r["length"] for r in records)
    assert summary["truncated_frac"] == _mean(r["finish_reason"] == "length" for r in records)


def _model_folder(path):
    """The built-in tiny model saved as an HF folder: a run on it records a model path."""
    tokenizer = default_task.build_tokenizer()
    default_task.build_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_summary_names_the_model_sampling_and_versions(tmp_path):
    """As lm-eval-harness's results do: the model a --checkpoint's run trained (the summary said "model": null
    without --model), the sampling settings in effect (stop strings included) and the library versions."""
    folder, run, out = _model_folder(tmp_path / "base"), tmp_path / "run", tmp_path / "out"
    assert main(["train", "--model", str(folder), "--output-dir", str(run), "--max-steps", "1", "--dtype", "float32",
                 "--device", "cpu", "--max-prompt-length", "32", "--max-completion-length", "8", "--batch-size", "8",
                 "--micro-batch-size", "8", "--no-export", *QUIET]) == 0
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(out), "--max-examples", "4",
                 "--max-new-tokens", "6", "--temperature", "0.5", "--top-p", "0.9", "--stop", "b", "--seed", "3"]) == 0
    summary = _results(out)[1]
    assert summary["model"] == str(folder) and summary["checkpoint"] == str(run / "checkpoint-1")
    assert {k: summary["sampling"][k] for k in ("max_new_tokens", "temperature", "top_p", "num_generations", "seed",
                                                "stop")} == \
        {"max_new_tokens": 6, "temperature": 0.5, "top_p": 0.9, "num_generations": 1, "seed": 3, "stop": ["b"]}
    assert summary["versions"]["fastgrpo"] == fastgrpo.__version__
    assert summary["versions"]["torch"] == torch.__version__
    assert datetime.fromisoformat(summary["date"]).tzinfo is not None
