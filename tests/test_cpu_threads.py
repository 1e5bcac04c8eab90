"""The built-in tiny model on the CPU runs on one torch thread unless OMP_NUM_THREADS sets the count: its 64-wide
matmuls gain nothing from a second thread, and beside other work on the cores torch's threads wait for each other
(`fastgrpo sft` on a busy 2-core machine: 93 s of steps on 2 threads, 0.8 s on one; benchmarks/NOTES.md)."""
import pytest
import torch

from fastgrpo.train.cli import build_parser, main
from fastgrpo.train.commands import config_from_args


def _configure(argv):
    return config_from_args(argv[0], build_parser().parse_args(argv))


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)  # conftest gives the session's count back after the test


@pytest.mark.parametrize("command", ["train", "sft", "ei", "eval"])
def test_the_builtin_model_takes_one_thread(command, two_threads):
    _configure([command])
    assert torch.get_num_threads() == 1


def test_a_real_model_or_a_set_thread_count_keeps_its_threads(two_threads, monkeypatch):
    _configure(["train", "--model", "/m"])
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _configure(["sft"])
    assert torch.get_num_threads() == 2


def test_eval_of_a_builtin_run_takes_one_thread(tmp_path, two_threads):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "1", "--batch-size", "8", "--num-generations", "8",
                 "--no-progress-bar"]) == 0
    for argv in (["--checkpoint", str(run)], ["--model", str(run / "final")]):
        torch.set_num_threads(2)
        _configure(["eval", *argv, "--output-dir", str(tmp_path / "eval")])
        assert torch.get_num_threads() == 1, argv
