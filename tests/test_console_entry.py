"""The `fastgrpo` console script and `python -m fastgrpo` (fastgrpo.__main__.main): a Ctrl-C before a command takes
the signals (while torch and transformers import) ends as one line and exit 130, not a traceback."""
import sys

import pytest

import fastgrpo.__main__ as entry
import fastgrpo.train.cli as cli


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
