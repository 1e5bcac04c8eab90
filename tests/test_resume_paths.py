"""--resume compares a path setting by the file it names: the same --dataset spelt another way (data.jsonl,
./data.jsonl, its absolute path: a job script resuming a run started by hand) was refused as a changed setting, and
the same spelling from another folder (another file) was taken as unchanged: the record holds the absolute path."""
import json

from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig, config_changes


def _rows(path):
    path.write_text("".join(json.dumps({"prompt": f"{i} say a"}) + "\n" for i in range(8)))
    return path


def test_resume_takes_the_same_dataset_by_another_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _rows(tmp_path / "data.jsonl")
    run = ["train", "--output-dir", "run", "--batch-size", "8", "--num-generations", "4"]
    assert main([*run, "--dataset", "data.jsonl", "--max-steps", "1"]) == 0
    assert main([*run, "--dataset", str(tmp_path / "data.jsonl"), "--max-steps", "2", "--resume"]) == 0
    assert main([*run, "--dataset", "./data.jsonl", "--max-steps", "3", "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_another_file_is_still_a_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _rows(tmp_path / "data.jsonl")
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "0 say b"}) + "\n")  # other rows (the same bytes
    # under another name are the same dataset: tests/test_resume_dataset_changed.py)
    saved = GRPOConfig(dataset="data.jsonl").to_dict()
    assert config_changes(saved, GRPOConfig(dataset=str(tmp_path / "data.jsonl"))) == []
    assert config_changes(saved, GRPOConfig(dataset="other.jsonl")) == [
        f"dataset: '{tmp_path / 'data.jsonl'}' in the checkpoint, 'other.jsonl' now"]
    # a Hub name is compared as written
    assert config_changes(GRPOConfig(dataset="org/set").to_dict(), GRPOConfig(dataset="org/set2")) != []


def test_a_model_folder_alike(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    saved = GRPOConfig(model="model").to_dict()
    assert config_changes(saved, GRPOConfig(model=str(tmp_path / "model"))) == []


def test_the_same_spelling_from_another_folder_is_another_file(tmp_path, monkeypatch, capsys):
    for folder, letter in (("a", "a"), ("b", "b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "data.jsonl").write_text(json.dumps({"prompt": f"1 say {letter}"}) + "\n")
    run = ["train", "--output-dir", str(tmp_path / "run"), "--batch-size", "4", "--num-generations", "4",
           "--dataset", "data.jsonl"]
    monkeypatch.chdir(tmp_path / "a")
    assert main([*run, "--max-steps", "1"]) == 0
    saved = json.loads((tmp_path / "run" / "checkpoint-1" / "run_config.json").read_text())
    assert saved["dataset"] == str(tmp_path / "a" / "data.jsonl")
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    assert main([*run, "--max-steps", "2", "--resume"]) != 0
    assert f"dataset: '{tmp_path / 'a' / 'data.jsonl'}' in the checkpoint, 'data.jsonl' now" in capsys.readouterr().err


def _reward_file(path):
    path.parent.mkdir(exist_ok=True)
    path.write_text("def score(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    return path


def test_a_reward_file_is_recorded_absolute_and_compared_by_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _reward_file(tmp_path / "r" / "my_rewards.py")
    _reward_file(tmp_path / "other.py")
    saved = GRPOConfig(reward_funcs=["length", "r/my_rewards.py:score", "json:dumps"]).to_dict()
    # the file part made absolute; a built-in name and a module:function as typed
    assert saved["reward_funcs"] == ["length", f"{tmp_path / 'r' / 'my_rewards.py'}:score", "json:dumps"]
    assert config_changes(saved, GRPOConfig(reward_funcs=["length", "./r/my_rewards.py:score", "json:dumps"])) == []
    assert config_changes(saved, GRPOConfig(reward_funcs=["length", "other.py:score", "json:dumps"])) != []
    assert config_changes(saved, GRPOConfig(reward_funcs=["length", "r/my_rewards.py:other", "json:dumps"])) != []


def test_an_sft_evaluation_reward_file_alike(tmp_path, monkeypatch):
    from fastgrpo.train.sft_config import SFTConfig

    monkeypatch.chdir(tmp_path)
    _reward_file(tmp_path / "my_rewards.py")
    saved = SFTConfig(eval_reward_funcs=["my_rewards.py:score"]).to_dict()
    assert saved["eval_reward_funcs"] == [f"{tmp_path / 'my_rewards.py'}:score"]


def test_resume_from_another_folder_reads_the_run_s_reward_file(tmp_path, monkeypatch, capsys):
    _rows(tmp_path / "data.jsonl")
    _reward_file(tmp_path / "a" / "my_rewards.py")
    run = ["train", "--output-dir", str(tmp_path / "run"), "--batch-size", "8", "--num-generations", "4",
           "--dataset", str(tmp_path / "data.jsonl")]
    monkeypatch.chdir(tmp_path / "a")
    assert main([*run, "--reward-funcs", "my_rewards.py:score", "--max-steps", "1"]) == 0
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "run" / "checkpoint-1" / "run_config.json"
    assert main(["train", "--config", str(record), "--max-steps", "2", "--resume"]) == 0
    assert main([*run, "--reward-funcs", "a/my_rewards.py:score", "--max-steps", "3", "--resume"]) == 0
