"""The `fastgrpo` console script and `python -m fastgrpo` (fastgrpo.__main__.main): a Ctrl-C or SIGTERM before a
command takes the signals (while torch and transformers import) ends as one line and exit 130 / 143, not a traceback
(tests/test_sigterm_before_loop.py sends a real SIGTERM as torch imports)."""
import signal
import sys

import pytest

import fastgrpo.__main__ as entry
import fastgrpo.train.cli as cli
from fastgrpo.train.interrupts import Terminated


def _interrupt():
    raise KeyboardInterrupt


def _interrupted_import():
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as err:  # what transformers' lazy module does with an interrupted import
        raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from err


@pytest.mark.parametrize("run", [_interrupt, _interrupted_import], ids=["interrupt", "wrapped"])
def test_an_interrupt_before_the_command_is_one_line(run, monkeypatch, capsys):
    monkeypatch.setattr(cli, "main", run)
    monkeypatch.setattr(sys, "argv", ["fastgrpo", "train"])
    assert entry.main() == 130
    assert capsys.readouterr().err == "fastgrpo: interrupted\n"
    monkeypatch.setattr(sys, "argv", ["fastgrpo", "train", "--debug"])
    with pytest.raises((KeyboardInterrupt, ModuleNotFoundError)):
        entry.main()


def test_other_errors_are_not_taken_for_an_interrupt(monkeypatch):
    def run():
        raise ModuleNotFoundError("No module named 'wandb'")

    monkeypatch.setattr(cli, "main", run)
    with pytest.raises(ModuleNotFoundError, match="wandb"):
        entry.main()


def _terminated_import():
    try:
        signal.raise_signal(signal.SIGTERM)  # main's starting_signals: raises Terminated and notes the signal
    except KeyboardInterrupt as err:
        raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from err


@pytest.mark.parametrize("run", [lambda: signal.raise_signal(signal.SIGTERM), _terminated_import],
                         ids=["terminated", "wrapped"])
def test_a_sigterm_before_the_command_is_one_line(run, monkeypatch, capsys):
    monkeypatch.setattr(cli, "main", run)
    monkeypatch.setattr(sys, "argv", ["fastgrpo", "train"])
    assert entry.main() == 143
    assert capsys.readouterr().err == "fastgrpo: terminated\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


def test_a_sigterm_before_the_command_with_debug_prints_its_traceback(monkeypatch, capsys):
    """Raised on, Terminated would end the process with exit 1: the traceback, then 143, as errors.run_command does."""
    def run():
        raise Terminated

    monkeypatch.setattr(cli, "main", run)
    monkeypatch.setattr(sys, "argv", ["fastgrpo", "train", "--debug"])
    assert entry.main() == 143
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "Terminated" in err, err


def test_only_the_first_process_of_a_launch_says_it(monkeypatch, capsys):
    monkeypatch.setattr(cli, "main", _interrupt)
    monkeypatch.setattr(sys, "argv", ["fastgrpo", "train"])
    monkeypatch.setenv("RANK", "1")
    assert entry.main() == 130
    assert capsys.readouterr().err == ""
