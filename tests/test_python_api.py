"""The trainers as a notebook uses them: train() called again (after the run's end, after a Ctrl-C) continues the
trainer's own run, never another's, and a wrong object given to a trainer is one line naming the argument."""
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

import fastgrpo
from fastgrpo.train import default_task

GRPO_SMALL = dict(batch_size=8, num_generations=4, micro_batch_size=8, max_completion_length=5, export=False,
                  progress_bar=False, logging_steps=0)
SFT_SMALL = dict(batch_size=8, micro_batch_size=4, export=False, progress_bar=False, logging_steps=0)


def _grpo(output_dir, reward=default_task.repeat_letter_reward, **fields):
    tokenizer = default_task.build_tokenizer()
    config = fastgrpo.GRPOConfig(**{**default_task.PRESET, **GRPO_SMALL, "output_dir": str(output_dir), **fields})
    return fastgrpo.GRPOTrainer(default_task.build_model(tokenizer), tokenizer, reward,
                                default_task.build_dataset(16), config)


def _sft(output_dir, **fields):
    tokenizer = default_task.build_tokenizer()
    config = fastgrpo.SFTConfig(**{**default_task.SFT_PRESET, **SFT_SMALL, "output_dir": str(output_dir), **fields})
    return fastgrpo.SFTTrainer(default_task.build_model(tokenizer), tokenizer, default_task.build_sft_dataset(32),
                               config)


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _assert_same_run(got, straight):
    """The same steps' metrics (timings aside) and the same weights as the straight run's."""
    timings = ("_s", "tokens_per_s")
    strip = [[{k: v for k, v in m.items() if not k.endswith(timings)} for m in t.history] for t in (got, straight)]
    assert strip[0] == strip[1]
    for a, b in zip(_weights(got), _weights(straight)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("lr_scheduler", ["constant", "linear"])
@pytest.mark.parametrize("build", [_grpo, _sft])
def test_train_again_with_more_steps_continues_as_one_run(tmp_path, build, lr_scheduler):
    """trainer.train() after a finished run continues it from its last step (as resume=True does); raising
    config.max_steps between the calls trains the new steps over the new length's schedule (a linear one had ended
    at 0). It had refused its own folder: 'output_dir: ... holds another run (checkpoint-2, metrics.jsonl); continue
    it with resume=True, or start afresh with overwrite_output_dir=True (deletes those files)'."""
    straight = build(tmp_path / "straight", max_steps=3, lr_scheduler=lr_scheduler)
    straight.train()
    trainer = build(tmp_path / "twice", max_steps=2, lr_scheduler=lr_scheduler)
    assert [m["step"] for m in trainer.train()] == [1, 2]
    trainer.config.max_steps = 3
    assert [m["step"] for m in trainer.train()] == [3]  # this call's steps
    assert [m["step"] for m in trainer.history] == [1, 2, 3]  # the run's
    assert len((tmp_path / "twice" / "metrics.jsonl").read_text().splitlines()) == 3
    assert trainer.history[-1]["lr"] == pytest.approx(straight.history[-1]["lr"])
    if lr_scheduler == "constant":
        _assert_same_run(trainer, straight)


def test_train_again_at_the_last_step_trains_nothing_and_says_so(tmp_path, caplog):
    trainer = _grpo(tmp_path, max_steps=1)
    trainer.train()
    with caplog.at_level(logging.WARNING, logger="fastgrpo"):
        assert trainer.train() == []
    assert f"nothing to train: the run in {tmp_path} is at step 1 of max_steps=1; pass a larger max_steps" in caplog.text
    assert [m["step"] for m in trainer.history] == [1]


def test_train_again_after_ctrl_c_continues_as_one_run(tmp_path):
    """A notebook's interrupt (SIGINT) while the second step scores its completions: the trainer saves step 1 and
    raises; train() again redoes step 2 exactly as the straight run did it, and says so in the interrupt's line."""
    scored = []

    def repeat_letter_reward(prompts, completions, letter, **kwargs):  # named as the straight run's
        scored.append(len(scored))
        if len(scored) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return default_task.repeat_letter_reward(prompts, completions, letter=letter)

    straight = _grpo(tmp_path / "straight", max_steps=3)
    straight.train()
    trainer = _grpo(tmp_path / "stopped", repeat_letter_reward, max_steps=3)
    with pytest.raises(KeyboardInterrupt, match="step 1 saved in .*; continue with train\\(\\) on this trainer"):
        trainer.train()
    assert [m["step"] for m in trainer.train()] == [2, 3]
    _assert_same_run(trainer, straight)


def test_train_again_refuses_a_folder_another_run_took_over(tmp_path):
    """Between two calls another trainer started afresh in the same folder (overwrite_output_dir): continuing there
    would take up that run's checkpoint and append to its log."""
    first = _sft(tmp_path, max_steps=1)
    first.train()
    _sft(tmp_path, max_steps=1, overwrite_output_dir=True, learning_rate=0.1).train()
    with pytest.raises(ValueError, match=r"^output_dir: .* no longer holds this trainer's checkpoint-1 \(another run "
                                         r"wrote there since\); build a new trainer to train there$"):
        first.train()


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "SFTTrainer"])
@pytest.mark.parametrize("position, value, match", [
    (0, "Qwen/Qwen2.5-0.5B", r"^model: expected a loaded model \(a torch.nn.Module\), got the name "
                             r"'Qwen/Qwen2.5-0.5B'; fastgrpo.train.loading.load_model_and_tokenizer\(config\) loads "
                             r"one by name$"),
    (1, "Qwen/Qwen2.5-0.5B", r"^tokenizer: expected a loaded tokenizer \(transformers.AutoTokenizer."
                             r"from_pretrained\(name\)\), got the name 'Qwen/Qwen2.5-0.5B'$"),
    ("config", {"max_steps": 1}, r"^config: expected a (GRPO|SFT)Config, got dict; build one from it: "
                                 r"(GRPO|SFT)Config\(\*\*values\) or (GRPO|SFT)Config.from_dict\(values\)$"),
])
def test_a_wrong_object_is_one_line_naming_the_argument(tmp_path, trainer_name, position, value, match):
    tokenizer = default_task.build_tokenizer()
    args = [default_task.build_model(tokenizer), tokenizer, default_task.build_dataset(16)]
    if trainer_name == "GRPOTrainer":
        args.insert(2, default_task.repeat_letter_reward)
    kwargs = {}
    if position == "config":
        kwargs["config"] = value
    else:
        args[position] = value
    with pytest.raises(ValueError, match=match):
        getattr(fastgrpo, trainer_name)(*args, **kwargs)


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "SFTTrainer"])
@pytest.mark.parametrize("make, match", [
    (lambda rows: "rows.jsonl", r"got the name 'rows.jsonl'; fastgrpo.train.loading.load_rows\(name\) reads one$"),
    (lambda rows: __import__("pandas").DataFrame(rows), r"got DataFrame; datasets.Dataset.from_pandas\(frame\) "
                                                         r"makes one$"),
    (lambda rows: (row for row in rows), r"got generator; list\(rows\) makes one$"),
    (lambda rows: __import__("datasets").Dataset.from_list(rows).to_iterable_dataset(),
     r"got IterableDataset, whose rows stream without a length; load it without streaming=True$"),
])
def test_a_dataset_of_another_kind_is_one_line_saying_what_to_give(trainer_name, make, match):
    """A pandas DataFrame raised KeyError: 0, a generator or a streamed dataset TypeError: object of type ... has no
    len(), from deep inside the dataset checks."""
    tokenizer = default_task.build_tokenizer()
    rows = (default_task.build_dataset if trainer_name == "GRPOTrainer" else default_task.build_sft_dataset)(8)
    model = default_task.build_model(tokenizer)
    if trainer_name == "GRPOTrainer":
        args = [model, tokenizer, default_task.repeat_letter_reward, make(rows), fastgrpo.GRPOConfig(**default_task.PRESET)]
    else:
        args = [model, tokenizer, make(rows), fastgrpo.SFTConfig(**default_task.SFT_PRESET)]
    with pytest.raises(ValueError, match=r"^dataset: expected a list of dict rows \({'prompt': ...}\) or a "
                                         r"datasets.Dataset, " + match):
        getattr(fastgrpo, trainer_name)(*args)


def test_each_trainer_logs_to_a_wandb_run_of_its_own(tmp_path, monkeypatch):
    """Two trainers in one process (a notebook's cells) with report_to=['wandb']: the second made no run of its own
    (wandb.init returned the first's) and wandb dropped its steps ("Tried to log to step 1 that is less than the
    current step 2"); train() called again logs on into the trainer's run. (Skipped where wandb is not installed.)"""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs = []
    for name in ("first", "second"):
        trainer = _sft(tmp_path / name, max_steps=1, report_to=["wandb"])
        trainer.train()
        runs.append(wandb.run.id)
    assert runs[0] != runs[1]
    trainer.config.max_steps = 2
    trainer.train()
    assert wandb.run.id == runs[1]
    wandb.finish()


def test_a_notebook_shows_the_progress_bar(monkeypatch, tmp_path):
    """In a Jupyter kernel stderr is no terminal (isatty() is False) but its front end redraws a bar in place: the
    bar showed only in a terminal, so a notebook's run (progress_bar=True, the default) had none."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    paths = [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    cell = ("from fastgrpo.train.console import ConsoleLog\n"
            "console = ConsoleLog(2, 4)\n"
            "for step in range(1, 5):\n"
            "    console.add({'step': step, 'loss': 0.5})\n"
            "console.close()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    text = {name: "".join(o.get("text", "") for o in outputs if o.get("name") == name) for name in ("stdout", "stderr")}
    assert [line.split(" |")[0] for line in text["stdout"].splitlines()] == ["step 2/4", "step 4/4"]
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widgets or "fastgrpo: 100%" in text["stderr"]  # a widget where ipywidgets is installed, else text
    assert "TqdmWarning" not in text["stderr"]  # tqdm.auto's "IProgress not found" without ipywidgets


def test_sft_trainer_exports_as_the_grpo_trainer_does(tmp_path):
    """SFTTrainer had no export(path) (GRPOTrainer's: an HF model folder of the trained weights, with the
    tokenizer), so a notebook that trained with export=False had no way but final/ to write one."""
    from transformers import AutoModelForCausalLM

    trainer = _sft(tmp_path / "run", max_steps=1)
    trainer.train()
    trainer.export(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    for (name, saved), trained in zip(loaded.state_dict().items(), trainer.model.state_dict().values()):
        torch.testing.assert_close(saved, trained, rtol=0, atol=0, msg=name)
    assert (tmp_path / "model" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("build", [_grpo, _sft])
def test_max_steps_set_before_train_is_trained_over_its_own_schedule(tmp_path, build):
    """trainer.config.max_steps set after the trainer was built: the schedule (and SFT's step count) had been made
    from the old value, so SFT trained the old count and a linear schedule ran over the old length."""
    straight = build(tmp_path / "straight", max_steps=3, lr_scheduler="linear")
    straight.train()
    trainer = build(tmp_path / "set", max_steps=1, lr_scheduler="linear")
    trainer.config.max_steps = 3
    assert [m["step"] for m in trainer.train()] == [1, 2, 3]
    assert [m["lr"] for m in trainer.history] == [m["lr"] for m in straight.history]


@pytest.mark.parametrize("build", [_grpo, _sft])
def test_a_field_set_on_the_config_after_the_trainer_was_built_is_refused(tmp_path, build):
    """The trainer applied output_dir (and the sampling, the prompts, ...) as it was built: set on trainer.config
    later, the run had gone on in the old folder without a word."""
    trainer = build(tmp_path / "old", max_steps=1)
    trainer.config.output_dir = str(tmp_path / "new")
    with pytest.raises(ValueError, match=r"^config: output_dir changed since the trainer was built \('.*old' then, "
                                         r"'.*new' now\), and the trainer applied it as it was built; build a new "
                                         r"trainer for the new value \(resume=True continues this run\)$"):
        trainer.train()
    assert not (tmp_path / "old").exists() and not (tmp_path / "new").exists()


@pytest.mark.parametrize("rewards, match", [
    (None, "got NoneType"),  # TypeError: 'NoneType' object is not iterable
    ({"letter": default_task.repeat_letter_reward}, "got dict"),  # its keys were taken for the functions
    (["length"], "got the name 'length'"),
    ([default_task.repeat_letter_reward, 0.5], "got float"),
])
def test_reward_funcs_of_another_kind_are_one_line(rewards, match):
    tokenizer = default_task.build_tokenizer()
    with pytest.raises(ValueError, match=rf"^reward_funcs: expected a callable or a list of callables, {match}"):
        fastgrpo.GRPOTrainer(default_task.build_model(tokenizer), tokenizer, rewards, default_task.build_dataset(16))
