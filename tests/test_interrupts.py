"""SIGINT / SIGTERM: a step that has changed nothing is abandoned and the state it began from is saved; a step in
its update finishes and is saved; either way --resume reaches the metrics of an uninterrupted run. A second signal
stops at once. The command line prints one line and exits 130 / 143; outside a run loop (sigterm_as_ctrl_c) a SIGTERM
stops it as a Ctrl-C does."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import list_checkpoints
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.interrupts import (
    Interrupted, Terminated, interrupted_while_starting, sigterm_as_ctrl_c, starting_signals, stop_if_interrupted,
)
from fastgrpo.train.lost_process import sigterm_unless_leaving
from fastgrpo.train.trainer import GRPOTrainer

STEPS = 5
KEYS = ("reward", "loss", "grad_norm", "entropy", "clip_ratio", "kl", "lr")
SMALL = dict(batch_size=8, num_generations=4, micro_batch_size=4, num_minibatches=2, max_completion_length=5,
             max_steps=STEPS, save_steps=100, export=False, progress_bar=False, logging_steps=0, beta=0.05)


def _trainer(path, reward=default_task.repeat_letter_reward, **fields):
    config = GRPOConfig(**{**default_task.PRESET, **SMALL, "output_dir": str(path), **fields})
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, seed=1)
    return GRPOTrainer(model, tokenizer, reward, default_task.build_dataset(32), config)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("straight")).train()


def _signal_at_rewards(step: int, signum: int):
    """The built-in reward, which sends `signum` to this process while scoring step `step` (before the update)."""
    calls = []

    def reward(prompts, completions, letter, **kwargs):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signum)
        return default_task.repeat_letter_reward(prompts, completions, letter)

    return reward


def _signal_at_update(trainer, step: int, signums: list[int]):
    """Send `signums` to this process at the first optimizer step of step `step` (inside its update)."""
    updates_per_step = trainer.updates_per_step
    count = []

    def hook(optimizer, args, kwargs):
        count.append(1)
        if len(count) == (step - 1) * updates_per_step + 1:
            for signum in signums:
                os.kill(os.getpid(), signum)

    trainer.optimizer.register_step_pre_hook(hook)


def _resumed_equal(path, straight, first_step):
    torch.manual_seed(999)  # the checkpoint's RNG states must be restored
    resumed = _trainer(path, resume=True).train()
    assert [m["step"] for m in resumed] == list(range(first_step, STEPS + 1))
    for a, b in zip(straight[first_step - 1:], resumed):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
    assert [json.loads(line)["step"] for line in (path / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, STEPS + 1))


def test_signal_before_the_update_abandons_the_step(tmp_path, straight):
    with pytest.raises(Interrupted) as stop:
        _trainer(tmp_path, reward=_signal_at_rewards(3, signal.SIGINT)).train()
    assert stop.value.exit_code == 130 and stop.value.step == 2
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]  # the state step 3 began from
    assert "stopped by SIGINT: step 2 saved in" in str(stop.value) and "resume" in str(stop.value)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    _resumed_equal(tmp_path, straight, first_step=3)


def test_signal_during_the_update_finishes_the_step(tmp_path, straight):
    trainer = _trainer(tmp_path)
    _signal_at_update(trainer, 3, [signal.SIGTERM])
    with pytest.raises(Interrupted) as stop:
        trainer.train()
    assert stop.value.exit_code == 143 and stop.value.step == 3
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3]
    _resumed_equal(tmp_path, straight, first_step=4)


def test_second_signal_stops_at_once_without_a_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, save_steps=1)
    _signal_at_update(trainer, 2, [signal.SIGINT, signal.SIGINT])
    with pytest.raises(Interrupted) as stop:
        trainer.train()
    assert stop.value.checkpoint is None and "without a new checkpoint" in str(stop.value)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]


def test_command_line_run_is_refused_while_another_holds_the_folder_and_stops_on_sigint(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--output-dir", str(out), "--max-steps", "100000", "--logging-steps", "1", "--save-steps", "0"]
    child = subprocess.Popen([sys.executable, "-m", "fastgrpo", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().count("\n") >= 2:
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.2)
        assert main(argv) == 2
        assert f"is in use by another run (PID {child.pid} on" in capsys.readouterr().err
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130, stderr
    # One line (a signal in the middle of an update first says that the step is being finished), no traceback.
    started, *before, last = stderr.strip().splitlines()
    assert started.startswith("fastgrpo train: training "), stderr
    assert all("finishing the current step" in line for line in before), stderr
    assert last.startswith("fastgrpo train: stopped by SIGINT: step ") and last.endswith("--resume`"), stderr
    assert stdout.splitlines()[0].startswith("step 1/100000 | reward ")
    assert list_checkpoints(out)


def test_a_stop_before_the_first_step_ended_says_what_to_do_from_python(tmp_path):
    """From Python there is no command to run again: the stop says to call train() again (the CLI's says to run its
    command again)."""
    with pytest.raises(Interrupted) as stop:
        _trainer(tmp_path, reward=_signal_at_rewards(1, signal.SIGINT)).train()
    assert str(stop.value) == "stopped by SIGINT before the first step ended; nothing to keep: call train() again"


def _signal_as_saved(trainer, step: int, signum: int):
    """Send `signum` to this process as the checkpoint of step `step` begins to be written (after the loop checked
    for a signal): the real save runs after it."""
    save = trainer.save_checkpoint

    def saving(*args, **kwargs):
        if getattr(trainer, "round", getattr(trainer, "step", None)) == step:  # expert iteration counts rounds
            os.kill(os.getpid(), signum)
        return save(*args, **kwargs)

    trainer.save_checkpoint = saving


def _sft_trainer(path):
    from fastgrpo.train.sft import SFTTrainer
    from fastgrpo.train.sft_config import SFTConfig

    config = SFTConfig(**{**default_task.SFT_PRESET, "max_steps": STEPS, "save_steps": 1, "export": False,
                          "progress_bar": False, "logging_steps": 0, "output_dir": str(path)})
    tokenizer = default_task.build_tokenizer()
    return SFTTrainer(default_task.build_model(tokenizer, seed=1), tokenizer, default_task.build_sft_dataset(64),
                      config)


def _ei_run(path):
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration

    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "ei_steps": STEPS, "questions_per_step": 4,
                         "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1,
                         "export": False, "progress_bar": False, "logging_steps": 0, "output_dir": str(path)})
    tokenizer = default_task.build_tokenizer()
    return ExpertIteration(default_task.build_model(tokenizer, seed=1), tokenizer, default_task.repeat_letter_reward,
                           default_task.build_dataset(16), config)


@pytest.mark.parametrize("build, key", [(lambda path: _trainer(path, save_steps=1), "step"), (_sft_trainer, "step"),
                                        (_ei_run, "round")], ids=["grpo", "sft", "ei"])
def test_a_signal_as_a_step_is_saved_stops_there(tmp_path, build, key):
    """A signal that came while step 2's checkpoint was written (the loop had checked for one) was acted on at the end
    of step 3: the run trained a whole step more than asked, which a scheduler's grace period after its SIGTERM may
    not leave. It stops with the checkpoint just written."""
    trainer = build(tmp_path)
    _signal_as_saved(trainer, 2, signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        trainer.train()
    assert stop.value.step == 2 and stop.value.checkpoint.name == "checkpoint-2", str(stop.value)
    assert [json.loads(line)[key] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def _sigterm_taken() -> None:
    """SIGTERM to this process, where sigterm_as_ctrl_c has its handler in place (never Python's default: pytest's
    process would end)."""
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, sigterm_unless_leaving)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises before this ends


def test_an_error_a_library_raised_for_a_sigterm_ends_as_the_sigterm():
    """transformers' lazy import cut by the signal: its ModuleNotFoundError in the Terminated's place. The command
    ends as the SIGTERM (one line, 143), not as that error (its traceback, exit 1)."""
    with pytest.raises(Terminated), sigterm_as_ctrl_c():
        try:
            _sigterm_taken()
        except BaseException:
            raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from RecursionError()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not interrupted_while_starting()


def test_a_process_groups_sigterm_handler_is_taken_over_and_given_back():
    """Where init_distributed installed sigterm_unless_leaving (a process of a torchrun launch) the command's body
    takes SIGTERM as anywhere else, and leaves that handler after it."""
    signal.signal(signal.SIGTERM, sigterm_unless_leaving)
    try:
        with pytest.raises(Terminated), sigterm_as_ctrl_c():
            _sigterm_taken()
        assert signal.getsignal(signal.SIGTERM) is sigterm_unless_leaving
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_command_run_off_the_main_thread_leaves_sigterm_alone():
    """Python takes signals on its main thread only (signal.signal raises elsewhere): a command called from another
    thread (a notebook's worker, a user's pool) runs with SIGTERM as it finds it."""
    found = []

    def command():
        with sigterm_as_ctrl_c():
            found.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=command)
    thread.start()
    thread.join()
    assert found == [signal.SIG_DFL]


def test_a_sigterm_and_a_ctrl_c_both_swallowed_stop_as_the_sigterm():
    """A scheduler's SIGTERM after a user's Ctrl-C, a library swallowing both: the command ends as the scheduler's
    (143), which it reads as its own stop, not as the user's (130)."""
    with starting_signals(), sigterm_as_ctrl_c():
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                os.kill(os.getpid(), signum)
                time.sleep(5)
            except KeyboardInterrupt:
                pass
        with pytest.raises(KeyboardInterrupt) as stop:  # a Ctrl-C's would end pytest's session
            stop_if_interrupted()
    assert stop.type is Terminated
