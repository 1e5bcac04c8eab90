"""A run's output_dir inside another run's checkpoint-<step>/ or final/ is refused by every command, as eval's
results were: the other run deletes its checkpoint-<step>/ when it prunes and replaces final/ when it exports again,
and the new run's checkpoints, metrics and export would go with them (train, sft and ei wrote there)."""
import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.trainer import GRPOTrainer


def _other_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "checkpoint-1" / "trainer_state.pt").write_bytes(b"")
    (run / "final").mkdir()
    (run / "final" / "run_config.json").write_text("{}")
    return run


@pytest.mark.parametrize("command", [["train", "--max-steps", "1"], ["sft", "--max-steps", "1"],
                                     ["ei", "--ei-steps", "1"]])
@pytest.mark.parametrize("inside", ["checkpoint-1", "final/mine"])
def test_a_command_refuses_an_output_dir_inside_a_runs_checkpoint_or_final(tmp_path, capsys, command, inside):
    run = _other_run(tmp_path)
    output = run / inside
    assert main([*command, "--output-dir", str(output)]) == 2
    err = capsys.readouterr().err
    folder = run / inside.split("/")[0]
    assert err.count("\n") == 1 and f"output_dir: {folder} is " in err and "pick a folder outside it" in err, err
    assert sorted(p.name for p in (run / "checkpoint-1").iterdir()) == ["trainer_state.pt"]
    assert not (run / "final" / "mine").exists()


def test_the_trainer_from_python_refuses_it_too(tmp_path):
    run = _other_run(tmp_path)
    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_steps": 1, "output_dir": str(run / "checkpoint-1"), "progress_bar": False})
    tokenizer = default_task.build_tokenizer()
    trainer = GRPOTrainer(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward,
                          default_task.build_dataset(8), config)
    with pytest.raises(ValueError, match=r"is a checkpoint of the run in .*pick a folder outside it"):
        trainer.train()
    assert sorted(p.name for p in (run / "checkpoint-1").iterdir()) == ["trainer_state.pt"]


def test_the_runs_own_folder_and_a_sibling_are_fine(tmp_path, capsys):
    run = _other_run(tmp_path)
    assert main(["train", "--max-steps", "1", "--output-dir", str(tmp_path / "sibling")]) == 0
    assert main(["train", "--max-steps", "1", "--output-dir", str(run / "notes" / "again")]) == 0


@pytest.mark.parametrize("inside", ["checkpoint-1/notes", "final"])
def test_a_symlink_into_a_runs_checkpoint_or_final_is_refused_too(tmp_path, capsys, inside):
    """A symlink to another run's final/ (or to a folder in its checkpoint-<step>/) passed the check, which read the
    folders' names on the path as written: the run wrote its checkpoints and metrics into that run's export."""
    run = _other_run(tmp_path)
    (run / inside).mkdir(exist_ok=True)
    link = tmp_path / "latest"
    link.symlink_to(run / inside)
    assert main(["train", "--max-steps", "1", "--output-dir", str(link)]) == 2
    err = capsys.readouterr().err
    folder = run / inside.split("/")[0]
    assert err.count("\n") == 1 and f"output_dir: {folder} is " in err and "pick a folder outside it" in err, err
    assert sorted(p.name for p in (run / inside).iterdir()) == (["run_config.json"] if inside == "final" else [])


@pytest.mark.parametrize("command", [["train", "--max-steps", "1"], ["sft", "--max-steps", "1"],
                                     ["ei", "--ei-steps", "1"]])
def test_resume_given_a_checkpoint_as_output_dir_names_the_runs_folder(tmp_path, capsys, command):
    """`--resume --output-dir <run>/checkpoint-1` (a checkpoint for the run it continues) is refused as any folder
    inside a run's checkpoint is, and the line says what --resume takes: the run's folder."""
    run = _other_run(tmp_path)
    assert main([*command, "--resume", "--output-dir", str(run / "checkpoint-1")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"to continue that run: --output-dir {run} --resume" in err, err
