"""How a run on 2 gloo processes (real torch.distributed, forked) ends when only one process meets the reason to stop:
every process stops with the message, and none waits in a collective that the others never join (each worker's
process group times out after 30 s, and the test fails past its own deadline rather than hanging)."""
import logging
import os
import signal
from pathlib import Path

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.interrupts import Interrupted
from fastgrpo.train.run_dir import RunLock
from fastgrpo.train.trainer import GRPOTrainer
from tests.forked_gloo import run_forked

# 2 prompts x 4 samples, one per rank; full fine-tuning (FSDP2: every rank writes its shard of a checkpoint)
FIELDS = dict(default_task.PRESET, batch_size=8, num_generations=4, micro_batch_size=4, max_completion_length=4,
              max_steps=3, save_steps=0, save_minutes=0, export=False, progress_bar=False, logging_steps=0)


def _run(worker, tmp_path: Path, *args) -> list[dict]:
    return run_forked(worker, tmp_path, *args, deadline_s=60, group_timeout_s=30)


def _prepare(rank: int, tmp: Path, folder: str) -> dict:
    try:
        with Distributed.current().run_directory(tmp / folder) as run_dir:
            run_dir.prepare(resume=False, overwrite=False, command="train")
    except ValueError as err:
        return {"error": str(err)}
    return {}


def test_a_folder_rank_0_refuses_stops_every_rank_with_its_message(tmp_path):
    """Rank 0 checks the output folder; rank 1 waited for it in a barrier and met 'Connection closed by peer' (a
    traceback) when rank 0 exited with its one-line error."""
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    found = _run(_prepare, tmp_path, "used")
    assert "holds another run (metrics.jsonl)" in found[0]["error"]
    assert found[1]["error"] == f"(on process 0) {found[0]['error']}"


def test_a_folder_another_run_holds_stops_every_rank_with_its_message(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        found = _run(_prepare, tmp_path, ".")
    finally:
        lock.release()
    assert "is in use by another run" in found[0]["error"]
    assert found[1]["error"] == f"(on process 0) {found[0]['error']}"


def _agreed(rank: int, tmp: Path, fails_on: int | None, true_on: int | None) -> dict:
    def decide() -> bool:
        if rank == fails_on:
            raise ValueError("export: run/final holds files the export did not write")
        return rank == true_on

    try:
        return {"agreed": Distributed.current().agree(decide)}
    except ValueError as err:
        return {"error": str(err)}


def test_a_decision_into_collectives_agrees_and_fails_on_every_rank(tmp_path):
    """The export's decision (export_due reads final/ on each rank): True on one rank is True on all; an error on
    one rank (final/ read differently where the processes do not share a file system) stops every rank, where the
    others waited in the decision's all-reduce until the process group timed out."""
    runs = [tmp_path / name for name in ("a", "b", "c")]
    for folder in runs:
        folder.mkdir()
    assert _run(_agreed, runs[0], None, 1) == [{"agreed": True}, {"agreed": True}]
    assert _run(_agreed, runs[1], None, None) == [{"agreed": False}, {"agreed": False}]
    message = "export: run/final holds files the export did not write"
    assert _run(_agreed, runs[2], 0, None) == [{"error": message}, {"error": f"(on process 0) {message}"}]


def _trained(rank: int, tmp: Path) -> dict:
    model, tokenizer = default_task.build_model(default_task.build_tokenizer()), default_task.build_tokenizer()
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          GRPOConfig(**{**FIELDS, "max_steps": 1}, output_dir=str(tmp / "run")))
    return {"steps": [m["step"] for m in trainer.train()]}


def test_train_from_python_takes_the_folder_once(tmp_path):
    """GRPOTrainer.train() on every rank (a user's script under torchrun): rank 0 locks the folder, the others
    follow; every rank locked it and rank 1 stopped with 'in use by another run (PID of rank 0)'."""
    assert _run(_trained, tmp_path) == [{"steps": [1]}, {"steps": [1]}]
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-1", "metrics.jsonl"]


def _resumed_finished(rank: int, tmp: Path) -> dict:
    """_trained's 1-step run, then resumed from Python on every rank: the 'nothing to train' lines each one logs."""
    _trained(rank, tmp)
    said = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("fastgrpo").addHandler(Collect(logging.WARNING))
    model, tokenizer = default_task.build_model(default_task.build_tokenizer()), default_task.build_tokenizer()
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          GRPOConfig(**{**FIELDS, "max_steps": 1, "resume": True}, output_dir=str(tmp / "run")))
    return {"steps": [m["step"] for m in trainer.train()], "said": [line for line in said if "nothing to train" in line]}


def test_a_finished_run_resumed_says_nothing_to_train_once(tmp_path):
    """Rank 0 says it, as SFTTrainer and ExpertIteration do; every rank said it, one line per process."""
    found = _run(_resumed_finished, tmp_path)
    assert [f["steps"] for f in found] == [[], []]
    assert [len(f["said"]) for f in found] == [1, 0], found


def _resumed_past_a_damaged_checkpoint(rank: int, tmp: Path) -> dict:
    """A 2-step run saving each step, its checkpoint-2 then torn (by rank 0), resumed from Python on every rank to
    step 3: the lines each rank logs about the checkpoint it skipped."""
    import torch.distributed as torch_dist

    model, tokenizer = default_task.build_model(default_task.build_tokenizer()), default_task.build_tokenizer()
    fields = {**FIELDS, "save_steps": 1, "save_total_limit": None}
    GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                GRPOConfig(**{**fields, "max_steps": 2}, output_dir=str(tmp / "run"))).train()
    if rank == 0:
        state = tmp / "run" / "checkpoint-2" / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    torch_dist.barrier()
    said = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("fastgrpo").addHandler(Collect(logging.WARNING))
    model = default_task.build_model(default_task.build_tokenizer())
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          GRPOConfig(**{**fields, "max_steps": 3, "resume": True}, output_dir=str(tmp / "run")))
    return {"steps": [m["step"] for m in trainer.train()], "said": [line for line in said if "skipped" in line]}


def test_a_damaged_checkpoint_a_resume_skips_is_said_once(tmp_path):
    """Rank 0 says it; every rank said it, one line per process."""
    found = _run(_resumed_past_a_damaged_checkpoint, tmp_path)
    assert [f["steps"] for f in found] == [[2, 3], [2, 3]]
    assert [len(f["said"]) for f in found] == [1, 0], found
    assert "resume: skipped checkpoint-2, which is incomplete or damaged" in found[0]["said"][0]


def _signalled(rank: int, tmp: Path, phase: str) -> dict:
    """A 3-step run whose rank 1 alone gets SIGINT in step 2: while it scores the rollout (before the update) or as
    its optimizer steps (in the update)."""
    model, tokenizer = default_task.build_model(default_task.build_tokenizer()), default_task.build_tokenizer()
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append(1)
        if rank == 1 and phase == "rollout" and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return default_task.repeat_letter_reward(prompts, completions, **kwargs)

    trainer = GRPOTrainer(model, tokenizer, reward, default_task.build_dataset(16),
                          GRPOConfig(**FIELDS, output_dir=str(tmp / "run")))
    def update(*args):
        if rank == 1 and phase == "update" and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    trainer.optimizer.register_step_pre_hook(update)
    try:
        trainer.train()
    except Interrupted as stop:
        return {"signal": stop.signum, "step": stop.step, "checkpoint": Path(stop.checkpoint).name,
                "logged": len(trainer.history)}
    return {"signal": None}


@pytest.mark.parametrize("phase, saved", [("rollout", 1), ("update", 2)])
def test_a_signal_one_rank_gets_stops_every_rank_at_one_step(tmp_path, phase, saved):
    """Before the update both ranks abandon step 2 and save step 1 (the state it began from); in the update both
    finish step 2 and save it. Rank 1 alone used to act on it: it went into the checkpoint's collectives while rank 0
    waited in the step's (a hang), or stopped after the step while rank 0 went on into step 3."""
    found = _run(_signalled, tmp_path, phase)
    want = {"signal": signal.SIGINT, "step": saved, "checkpoint": f"checkpoint-{saved}", "logged": saved}
    assert found == [want, want]
    assert sorted(os.listdir(tmp_path / "run")) == [f"checkpoint-{saved}", "metrics.jsonl"]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == saved


def _built(rank: int, tmp: Path, fields: dict) -> dict:
    model, tokenizer = default_task.build_model(default_task.build_tokenizer()), default_task.build_tokenizer()
    try:
        GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                    GRPOConfig(**{**FIELDS, **fields}, output_dir=str(tmp / "run")))
    except ValueError as err:
        return {"error": str(err)}
    return {}


def test_sizes_that_do_not_split_across_ranks_say_what_was_expected(tmp_path):
    """One line per setting that names it, what it must be on this many processes and what it got."""
    found = _run(_built, tmp_path, dict(batch_size=12, micro_batch_size=4))
    assert found[0] == found[1] == {"error": "batch_size: expected a multiple of 8 (num_generations 4 x 2 processes: "
                                             "each takes whole groups), got 12"}
    found = _run(_built, tmp_path, dict(batch_size=24, num_generations=2, micro_batch_size=8))
    assert found[0] == found[1] == {"error": "micro_batch_size: expected a divisor of 12 (each of the 2 processes' "
                                             "minibatch of 24 / 2 / num_minibatches 1), got 8"}
    found = _run(_built, tmp_path, dict(batch_size=36, num_generations=2, num_minibatches=4, micro_batch_size=1))
    assert found[0] == found[1] == {"error": "num_minibatches: expected a divisor of 18 (each of the 2 processes' "
                                             "36 / 2 completions), got 4"}


def _cli_train(rank: int, tmp: Path, argv: list[str]) -> dict:
    from fastgrpo.train.cli import main

    return {"exit": main(argv)}


def test_sizes_are_checked_before_overwrite_deletes_the_previous_run(tmp_path):
    """`fastgrpo train --overwrite-output-dir` with a batch that does not split across the processes: the size error
    comes first, and the previous run is still there (it was deleted, then the trainer refused the batch)."""
    previous = tmp_path / "run" / "metrics.jsonl"
    previous.parent.mkdir()
    previous.write_text('{"step": 1}\n')
    argv = ["train", "--output-dir", str(previous.parent), "--overwrite-output-dir", "--batch-size", "12",
            "--num-generations", "4", "--micro-batch-size", "4", "--max-steps", "1", "--no-progress-bar"]
    found = _run(_cli_train, tmp_path, argv)
    assert found[0] == found[1] == {"exit": 2}
    assert previous.read_text() == '{"step": 1}\n'
