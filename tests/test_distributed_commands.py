"""The commands as `torchrun --nproc_per_node 2 -m fastgrpo ...` runs them (2 gloo processes, forked, each running
fastgrpo.train.cli.main): a command's refusal or stop is one line, printed by rank 0 alone; `fastgrpo eval` splits its
rows across the processes and rank 0 alone writes (tests/test_eval_ranks.py checks the split)."""
import json
import threading

import pytest

from fastgrpo.train.interrupts import Terminated

from tests.forked_gloo import cli, read_metrics, run_forked

EVAL = ["eval", "--max-examples", "4", "--num-generations", "2", "--max-new-tokens", "4"]


def _run(worker, tmp_path, *args) -> list:
    return run_forked(worker, tmp_path, *args, deadline_s=120, group_timeout_s=60)


def test_eval_takes_one_lock_and_rank_0_alone_writes(tmp_path):
    """Each process took the output folder's lock: rank 1 met 'in use by another run (PID <rank 0's>)' and exited 2,
    so torchrun stopped rank 0 in the middle of its evaluation."""
    found = _run(cli, tmp_path, [[*EVAL, "--output-dir", str(tmp_path / "out" / "eval")]])
    assert [rank["exits"] for rank in found] == [[0], [0]], found[1]["stderr"]
    assert "accuracy" in found[0]["stdout"] and found[1]["stdout"] == "" and found[1]["writes"] == []
    results = (tmp_path / "out" / "eval" / "results.jsonl").read_text().splitlines()
    assert sorted((r["index"], r["sample"]) for r in map(json.loads, results)) == [(i, s) for i in range(4)
                                                                                    for s in range(2)]


def test_a_sharded_checkpoint_evaluates_and_resumes_on_one_process(tmp_path, capsys):
    """`fastgrpo eval --checkpoint` of a run fully fine-tuned on 2 processes (FSDP2: its weights in checkpoint-<step>/
    shards) evaluates the trained weights, as of the run's export; it stopped with KeyError 'trainable' (a
    traceback). `--resume` of it on one process continues it, saying the process counts differ (it was refused:
    tests/test_distributed_resume.py checks what it loads)."""
    from fastgrpo.train.cli import main

    run = tmp_path / "out" / "run"
    train = ["train", "--output-dir", str(run), "--max-steps", "1", "--batch-size", "16", "--num-generations", "8",
             "--micro-batch-size", "8", "--max-completion-length", "4", "--learning-rate", "0.05"]
    assert [rank["exits"] for rank in _run(cli, tmp_path, [train])] == [[0], [0]]
    assert (run / "checkpoint-1" / "shards").is_dir()
    assert main([*EVAL, "--checkpoint", str(run), "--output-dir", str(tmp_path / "of-checkpoint")]) == 0
    assert main([*EVAL, "--model", str(run / "final"), "--output-dir", str(tmp_path / "of-export")]) == 0
    completions = [[json.loads(line)["completion"] for line in (tmp_path / name / "results.jsonl").open()]
                   for name in ("of-checkpoint", "of-export")]
    assert completions[0] == completions[1]
    capsys.readouterr()
    assert main([*train, "--max-steps", "2", "--resume", "--no-progress-bar"]) == 0
    assert "warning: resume: checkpoint-1 was written by 2 process(es), this run has 1" in capsys.readouterr().err
    assert [m["step"] for m in read_metrics(run)] == [1, 2]


REWARD = '''import torch.distributed as dist

from fastgrpo.train.default_task import repeat_letter_reward


def fails_on_rank_1(prompts, completions, **kwargs):
    if dist.get_rank() == 1:
        raise RuntimeError("no score here")
    return repeat_letter_reward(prompts, completions, **kwargs)
'''


def test_a_refusal_or_failure_prints_once_by_rank_0(tmp_path):
    """Bad input every process reads alike, a folder rank 0 refuses, a reward function that fails on rank 1 alone:
    each is one line, printed by rank 0; rank 1 ends with the same exit code and prints none. Each process printed
    it (rank 1 with '(on process 0)'), so torchrun's output showed every refusal twice."""
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "out" / "used").mkdir(parents=True)
    (tmp_path / "out" / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    train = ["train", "--max-steps", "1", "--batch-size", "16", "--num-generations", "8", "--micro-batch-size", "8",
             "--max-completion-length", "4"]
    runs = [[*train, "--output-dir", str(tmp_path / "out" / "odd"), "--batch-size", "12"],
            [*train, "--output-dir", str(tmp_path / "out" / "used")],
            [*train, "--output-dir", str(tmp_path / "out" / "failed"),
             "--reward-funcs", f"{tmp_path / 'reward.py'}:fails_on_rank_1"]]
    found = _run(cli, tmp_path, runs)
    assert found[0]["exits"] == found[1]["exits"] == [2, 2, 1]
    lines = found[0]["stderr"].splitlines()
    started = [line for line in lines if line.startswith("fastgrpo train: training ")]  # the third run's start
    assert len(started) == 1 and " on cpu x 2 processes: " in started[0], lines
    assert [line.split(": ")[2] for line in lines if line not in started] == [
        "batch_size", "output_dir", "(on process 1) reward function fails_on_rank_1 raised RuntimeError"], lines
    assert "error" not in found[1]["stderr"] and "training" not in found[1]["stderr"], found[1]["stderr"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_bad_flag_prints_once_by_rank_0(monkeypatch, capsys, rank):
    """torchrun's processes parse the same command line: rank 0 alone prints the refusal (each process printed it)."""
    from fastgrpo.train.cli import main

    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stop:
        main(["train", "--max-step", "2"])
    assert stop.value.code == 2
    expected = "fastgrpo train: error: unrecognized arguments: --max-step (did you mean --max-steps?)"
    assert capsys.readouterr().err.startswith(expected) == (rank == "0")


def _stops(err: BaseException):
    def body():
        raise err
    return body


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize(("stop", "said", "code"), [(KeyboardInterrupt(), "interrupted", 130),
                                                    (Terminated(), "terminated", 143)])
def test_a_signal_outside_the_run_loop_prints_once_by_rank_0(monkeypatch, capsys, rank, stop, said, code):
    """torchrun passes a Ctrl-C or SIGTERM to every process: as the model loads, each printed 'interrupted' or
    'terminated'. Every process still ends with the signal's exit code."""
    from fastgrpo.train.errors import run_command

    monkeypatch.setenv("RANK", rank)
    assert run_command("fastgrpo train", _stops(stop)) == code
    assert capsys.readouterr().err == (f"fastgrpo train: {said}\n" if rank == "0" else "")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_stop_every_process_agreed_on_prints_once_by_rank_0(monkeypatch, capsys, rank):
    """A SIGTERM that torchrun passes to every process stops them at one step with one checkpoint: each printed the
    same 'stopped by SIGTERM: step 3 saved in ...' line."""
    import signal

    from fastgrpo.train.errors import run_command
    from fastgrpo.train.interrupts import Interrupted

    monkeypatch.setenv("RANK", rank)
    stop = Interrupted(signal.SIGTERM, 3, "run/checkpoint-3")
    assert run_command("fastgrpo train", _stops(stop)) == 143
    assert capsys.readouterr().err.startswith("fastgrpo train: stopped by SIGTERM: step 3") == (rank == "0")


def test_under_torchrun_bad_input_waits_for_rank_0_to_end(monkeypatch, capsys):
    """torchrun stops the other processes as soon as one fails: rank 1, leaving the refusal to rank 0, waits for
    torchrun's SIGTERM (here already pending), which says rank 0 has ended, rather than exiting first and having rank
    0 stopped before it printed."""
    import signal

    from fastgrpo.train.errors import run_command

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # pending on this thread until taken
        code = run_command("fastgrpo train", _stops(ValueError("batch_size: expected ...")))
        left = signal.sigtimedwait({signal.SIGTERM}, 0)  # None: the wait took it
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert code == 2 and left is None and capsys.readouterr().err == ""


def test_fsdp_cpu_offload_runs_on_gloo(tmp_path):
    """`--fsdp-cpu-offload` on CPU processes: FSDP2 asked for pinned host memory, which needs a GPU, and every
    process stopped with 'Cannot access accelerator device when none is available' (a traceback). The step is the
    one without offload."""

    train = ["train", "--max-steps", "1", "--batch-size", "16", "--num-generations", "8", "--micro-batch-size", "8",
             "--max-completion-length", "4", "--no-export"]
    runs = [[*train, "--output-dir", str(tmp_path / "out" / name), *flags]
            for name, flags in (("offload", ["--fsdp-cpu-offload"]), ("plain", []))]
    found = _run(cli, tmp_path, runs)
    assert found[0]["exits"] == found[1]["exits"] == [0, 0], found[0]["stderr"][-2000:]
    offloaded, plain = (read_metrics(tmp_path / "out" / name)[0] for name in ("offload", "plain"))
    assert offloaded["loss"] == plain["loss"] and offloaded["grad_norm"] == pytest.approx(plain["grad_norm"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_the_signal_every_process_gets_is_announced_once(monkeypatch, caplog, rank):
    """torchrun passes Ctrl-C / SIGTERM to every process: rank 0 alone says they will save and stop (each did)."""
    import logging
    import signal

    from fastgrpo.train.interrupts import InterruptGuard

    monkeypatch.setenv("RANK", rank)
    with caplog.at_level(logging.WARNING, logger="fastgrpo"), InterruptGuard(deferred=True) as guard:
        signal.raise_signal(signal.SIGTERM)
    assert guard.requested == signal.SIGTERM
    assert ("all processes save a checkpoint and stop" in caplog.text) == (rank == "0")


def _resumed_warnings(rank, tmp):
    import logging

    from fastgrpo.train.checkpoint import rng_states
    from fastgrpo.train.distributed import Distributed
    from tests.forked_gloo import tiny_model

    model, _ = tiny_model(lora=True)
    state = {"world_size": 1, "rng": rng_states(),
             "trainable": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("fastgrpo").addHandler(handler)
    Distributed.current().restore_checkpoint(tmp / "checkpoint-3", state, model, None)
    return [record.getMessage() for record in records]


def test_resuming_on_another_process_count_warns_once(tmp_path):
    """A LoRA checkpoint of 1 process resumed on 2: rank 0 says so (each process did)."""
    assert _run(_resumed_warnings, tmp_path) == [["resume: checkpoint-3 was written by 1 process(es), this run has 2"],
                                                 []]
