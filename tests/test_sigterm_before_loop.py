"""SIGTERM (a scheduler cancelling a job as its model loads, `timeout`, `docker stop`) before the run loop of
`fastgrpo train` / `sft` / `ei` takes the signals, or after it gives them back, stops the command as a Ctrl-C there
does: one line, exit 143, the output folder left as a Ctrl-C leaves it (lock released). Before, Python's default killed
it at once: no line, exit -15, the lock left behind. Inside the loop the InterruptGuard keeps SIGTERM as before (a
checkpoint and the command that continues), and under torchrun a SIGTERM after another process ended still says
which one. Each command runs in a child process (an unhandled SIGTERM would end pytest's)."""
import subprocess

import pytest

from tests.test_eval_export_signals import (
    CHILD_TIMEOUT_S,
    SEND,
    SWALLOWED,
    SWALLOWED_LINE,
    _child,
    _ended_in_one_line,
    _signal_in,
)
from tests.test_interrupt_eval_export import QUIET, _entries
from tests.test_lost_process import torchrun_train

LOCK = ".fastgrpo.lock"
# the fewest steps (rounds) that reach the loop, per command
SHORT = {"train": ["--max-steps", "2", "--save-steps", "1"], "sft": ["--max-steps", "2", "--save-steps", "1"],
         "ei": ["--ei-steps", "1", "--save-steps", "1"]}
# the module whose global the command's closing line calls run_files through (commands: sft's and ei's)
CLOSING_LINE = {"train": "cli", "sft": "commands", "ei": "commands"}
ENDED = {"SIGINT": ("interrupted", 130), "SIGTERM": ("terminated", 143)}


def _run(command: str, out, hook: str) -> subprocess.CompletedProcess:
    return _child([command, "--output-dir", str(out), *SHORT[command], *QUIET], hook)


# SIGINT on one command (each child process costs seconds of imports): the Ctrl-C that SIGTERM is held to
@pytest.mark.parametrize(("command", "signum"), [("train", "SIGINT"), ("train", "SIGTERM"), ("sft", "SIGTERM"),
                                                 ("ei", "SIGTERM")])
def test_a_signal_as_the_model_loads_is_one_line_and_leaves_what_a_ctrl_c_leaves(tmp_path, command, signum):
    """SIGINT passed before the fix too: the evidence of what a Ctrl-C leaves. SIGTERM before: killed (-15), no line,
    the output folder left holding the lock file."""
    out = tmp_path / "run"
    done = _run(command, out, _signal_in("default_task", "build_model", signum))
    _ended_in_one_line(done, command, *ENDED[signum])
    assert _entries(out) is None, _entries(out)  # the folder the run created, lock and all, gone with it


def test_a_sigterm_a_library_swallowed_as_the_model_loaded_stops_before_the_first_step(tmp_path):
    """As a swallowed Ctrl-C (starting_signals): the loop's InterruptGuard finds it noted as it takes the signals.
    Before: killed at once (-15) where the signal landed."""
    out = tmp_path / "run"
    done = _run("train", out, _signal_in("default_task", "build_model", swallowed=True))
    _ended_in_one_line(done, "train", "terminated", 143)
    assert SWALLOWED_LINE in done.stderr, done.stderr
    assert _entries(out) is None, _entries(out)  # no step ran: the folder the run created gone with its lock


# SIGTERM as `python -m fastgrpo` imports torch (fastgrpo.__main__, before the command's parser exists); swallowed: in
# a try that takes the KeyboardInterrupt, as torch's numpy import does with a Ctrl-C
AS_TORCH_IMPORTS = """
import importlib.abc, os, signal, sys
class SignalAtImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            {send}
        return None
sys.meta_path.insert(0, SignalAtImport())
"""


@pytest.mark.parametrize("swallowed", [False, True], ids=["raised", "swallowed"])
def test_a_sigterm_as_torch_imports_is_one_line(tmp_path, swallowed):
    """Before: Python's default killed the process (exit -15) without a line. Swallowed where it landed, torch's
    import then fails (it registers its ops twice): that error is the signal's doing, and says so in the same line."""
    out = tmp_path / "run"
    send = SWALLOWED.replace("\n    ", "\n            ") if swallowed else SEND
    done = _run("train", out, AS_TORCH_IMPORTS.format(send=send.format(signal="SIGTERM")))
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (143, "fastgrpo: terminated"), \
        f"exit {done.returncode}; stderr:\n{done.stderr}"
    assert "Traceback" not in done.stderr and (SWALLOWED_LINE in done.stderr) == swallowed, done.stderr
    assert not out.exists()


# SIGTERM as the loop's progress display closes: the InterruptGuard gone, the output folder's lock still held
AS_THE_DISPLAY_CLOSES = """
import os, signal
from fastgrpo.train import console
real, calls = console.ConsoleLog.close, []
def close(self):
    calls.append(1)
    if len(calls) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self)
console.ConsoleLog.close = close
"""


@pytest.mark.parametrize(("command", "where"), [("train", "the display closes"), ("train", "the closing line"),
                                                ("sft", "the closing line"), ("ei", "the closing line")])
def test_a_sigterm_after_the_loop_gave_the_signals_back_keeps_the_finished_run(tmp_path, command, where):
    """The run's last checkpoint and final/ written: one line, exit 143, as a Ctrl-C there (130), the lock released.
    Before: killed (-15), no line; as the display closed, the lock file left too."""
    out = tmp_path / "run"
    hook = AS_THE_DISPLAY_CLOSES if where == "the display closes" else _signal_in(CLOSING_LINE[command], "run_files")
    done = _run(command, out, hook)
    _ended_in_one_line(done, command, "terminated", 143)
    last = "checkpoint-1" if command == "ei" else "checkpoint-2"
    assert {last, "final", "metrics.jsonl"} <= set(_entries(out)) and LOCK not in _entries(out), _entries(out)
    assert (out / "final" / "export.json").is_file()  # the export complete


# SIGTERM as the second step's rollout begins: nothing of that step has changed the weights yet
SECOND_ROLLOUT = """
import os, signal
from fastgrpo.train import trainer
real, calls = trainer.rollout_batch, []
def rollout_batch(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
trainer.rollout_batch = rollout_batch
"""


def test_a_sigterm_in_the_loop_saves_and_its_resume_stopped_as_it_loads_keeps_the_checkpoint(tmp_path):
    """A preempted job, requeued and cancelled again as its model loads. In the loop the InterruptGuard owns SIGTERM
    as before (the step abandoned, the one before it saved, the command that continues); the resume's SIGTERM, before
    its loop, is one line and leaves the checkpoint and metrics as they were. Before: the resume was killed (-15),
    no line, the lock file left."""
    out = tmp_path / "run"
    argv = ["train", "--output-dir", str(out), "--max-steps", "3", "--save-steps", "0", *QUIET]
    done = _child(argv, SECOND_ROLLOUT)
    resume = f"`fastgrpo {' '.join(argv)} --resume`"
    _ended_in_one_line(done, "train", f"stopped by SIGTERM: step 1 saved in {out / 'checkpoint-1'}; continue with "
                       f"{resume}", 143)
    metrics = (out / "metrics.jsonl").read_bytes()
    assert LOCK not in _entries(out), _entries(out)
    done = _child([*argv, "--resume"], _signal_in("default_task", "build_model"))
    _ended_in_one_line(done, "train", "terminated", 143)
    assert _entries(out) == ["checkpoint-1", "metrics.jsonl"], _entries(out)
    assert (out / "metrics.jsonl").read_bytes() == metrics


# Imported by fastgrpo as the run's reward function, before the model loads: rank 0 is killed as it loads the model
# (the host's out-of-memory killer, say), and rank 1 is still loading when torchrun stops it with SIGTERM.
KILLED_AS_RANK_0_LOADS = '''import os
import signal
import time

from fastgrpo.train import default_task


def _build_model(*args, **kwargs):
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # a large model's load


default_task.build_model = _build_model


def reward(completions, **kwargs):
    return [0.0] * len(completions)
'''
LOST_LINE = ("fastgrpo train: error: process 0 of 2 ended in the middle of the run, and process 1 stopped with it; its "
             "own error line says why, and where it printed none, torchrun's summary gives its exit code or signal "
             "(SIGKILL: often the host's out-of-memory killer)")


def test_under_torchrun_a_sigterm_as_the_model_loads_after_another_process_ended_names_it(tmp_path):
    """torchrun's SIGTERM reaching rank 1 as it loads, rank 0 killed: the lost-process line a SIGTERM in the loop gets
    (sigterm_as_ctrl_c), not 'terminated'. Before: rank 1 killed at once, silent."""
    command, env = torchrun_train(tmp_path, KILLED_AS_RANK_0_LOADS, "reward", "cpu")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    ours = [line for line in done.stderr.splitlines() if line.startswith("fastgrpo train:")]
    assert done.returncode != 0 and ours == [LOST_LINE], done.stderr
