"""Joining torchrun's process group (fastgrpo.train.process_group): --ddp-timeout bounds how long the others wait for a
stuck process, and a DeepSpeed launch (accelerate's) is refused before anything loads."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.process_group import check_launcher
from fastgrpo.train.sft_config import SFTConfig
from tests.test_lost_process import torchrun_train

TIMEOUT_S = 5  # the launch's collectives before the stuck reward wait < 1 s for each other on a 2-core machine
DEADLINE_S = 60  # the launch ends in ~12 s (~6 s of start-up, the timeout, the exit); with gloo's default: 30 min

# Stuck at every call on rank 1: torchrun's SIGTERM, once rank 0 has ended, raises ProcessLost in it (interrupts); as
# an Exception, scoring took it for the function's error and called it again to find the failing row, where rank 1
# waited for torchrun's SIGKILL, 30 s later, and printed nothing.
STUCK_ON_RANK_1 = '''import os
import time
from pathlib import Path


def stuck_on_rank_1(completions, **kwargs):
    if os.environ["RANK"] == "1":
        Path("stuck").touch()
        time.sleep(3600)
    return [0.0] * len(completions)
'''


TIMED_OUT_LINE = ("fastgrpo train: error: process 0 of 2 waited longer than the process group's timeout for the others "
                  "in a collective: one of them is stuck (a reward function that never returns, say) or ended on "
                  "another machine")
STOPPED_LINE_START = ("fastgrpo train: error: process 0 of 2 ended in the middle of the run, and process 1 stopped with "
                      "it; its own error line says why")


def test_under_torchrun_a_stuck_process_stops_the_others_after_ddp_timeout(tmp_path):
    """Rank 1's reward function never returns: rank 0 waited in the step's next collective for torch's default
    timeout (30 min with gloo, the process group got none); with --ddp-timeout it stops after that many seconds with
    lost_process's line, and torchrun then stops rank 1. On gloo (the CPU), also on a GPU machine;
    tests/test_two_gpus.py runs it on NCCL."""
    command, env = torchrun_train(tmp_path, STUCK_ON_RANK_1, "stuck_on_rank_1", "cpu", "--ddp-timeout",
                                  str(TIMEOUT_S))
    start = time.monotonic()
    launch = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        _, stderr = launch.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        kill_launch(launch.pid)
        launch.communicate()
        pytest.fail(f"the launch still ran after {DEADLINE_S} s: rank 0 waits for the stuck rank 1")
    took = time.monotonic() - start
    assert launch.returncode != 0 and TIMED_OUT_LINE in stderr.splitlines(), stderr
    assert (tmp_path / "stuck").exists()  # rank 1 was in the reward function, not late elsewhere
    # and torchrun's SIGTERM stopped it there, with its line (not SIGKILL 30 s later, silent)
    assert STOPPED_LINE_START in stderr, stderr
    assert "[rank0]" not in stderr, stderr  # no traceback of rank 0's (torchrun prints its own)
    print(f"ended in {took:.1f} s")


def kill_launch(pid: int) -> None:
    """SIGKILL torchrun and its workers (each in a session of its own: killing torchrun's group leaves them, stuck,
    holding the pipes open)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for process in (*map(int, children), pid):
        os.kill(process, signal.SIGKILL)


@pytest.mark.parametrize("command", ["train", "sft", "ei", "eval"])
def test_a_deepspeed_launch_is_refused_before_the_model_loads(command, tmp_path, monkeypatch, capsys):
    """`accelerate launch --use_deepspeed -m fastgrpo train` ran DDP / FSDP2 (or one plain process) without a word
    that the DeepSpeed config it was given does nothing."""
    import fastgrpo.train.loading as loading
    from fastgrpo.train.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", never)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch --use_deepspeed sets
    out = tmp_path / "out"
    assert main([command, "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"fastgrpo {command}: error: ACCELERATE_USE_DEEPSPEED: `accelerate launch --use_deepspeed` set it, and "
        "fastgrpo runs no DeepSpeed (full fine-tuning shards with FSDP2, LoRA trains through DDP); launch with "
        f"`torchrun --nproc_per_node N -m fastgrpo {command} ...` instead"]
    assert not out.exists()


@pytest.mark.parametrize("value, refused", [("true", True), ("1", True), ("YES", True), ("false", False),
                                            ("0", False), ("", False)])
def test_only_a_true_accelerate_flag_is_refused(value, refused, monkeypatch):
    """accelerate reads its ACCELERATE_USE_* flags with str_to_bool: `false` / `0` are a launch without DeepSpeed."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", value)
    if refused:
        with pytest.raises(ValueError, match="^ACCELERATE_USE_DEEPSPEED: "):
            check_launcher("train")
    else:
        check_launcher("train")


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig, EIConfig, EvalConfig])
def test_ddp_timeout_is_hfs_default_and_a_bad_one_is_refused(config_class):
    """1800 s as HF's TrainingArguments; 0 would fail every collective, and past 10**9 s torch's store failed to
    connect at once (1e10) or 2 gloo processes hung (9e9): int64 nanoseconds."""
    assert config_class().ddp_timeout == 1800 and config_class(ddp_timeout=10**9).ddp_timeout == 10**9
    for bad in (0, -5, 10**9 + 1):
        with pytest.raises(ValueError) as info:
            config_class(ddp_timeout=bad)
        assert str(info.value) == f"ddp_timeout: expected seconds in [1, 10**9], got {bad}"
    with pytest.raises(ValueError, match=r"^ddp_timeout: expected an integer, got 2.5$"):
        config_class(ddp_timeout=2.5)
