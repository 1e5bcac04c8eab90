"""A --resume under torchrun (2 gloo processes, forked, each running fastgrpo.train.cli.main) of a run that another
process count wrote: the settings the resume takes from the run fit this launch's processes."""
import json

from fastgrpo.train.cli import main
from tests.forked_gloo import cli, run_forked

# LoRA: its checkpoint (whole adapter weights, DDP) resumes on any process count
FAST = ["--lora-rank", "4", "--no-progress-bar", "--num-generations", "4", "--batch-size", "8",
        "--max-completion-length", "2"]


def _run(worker, tmp_path, *args) -> list:
    return run_forked(worker, tmp_path, *args, deadline_s=120, group_timeout_s=60)


def _launched(rank, tmp, runs) -> dict:
    """cli, with the RANK torchrun gives each process (the other ranks log warnings only)."""
    return cli(rank, tmp, runs, {"RANK": str(rank)})


def test_a_bare_resume_on_more_processes_fits_the_runs_micro_batch_to_each(tmp_path):
    """A run of 1 process, its micro-batch 8 (the built-in model's, fitted to its batch of 8), resumed on 2 with
    `--resume` alone: the resume took micro_batch_size 8 from the run, each process's share of the minibatch is 4, and
    both stopped with 'micro_batch_size: expected a divisor of 4 ..., got 8', a setting the user never gave. The
    micro-batch is lowered to 4 and said (once, by rank 0); the batch stays the run's."""
    run = tmp_path / "out" / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "1", *FAST]) == 0
    resume = ["train", "--output-dir", str(run), "--max-steps", "2", "--resume", *FAST]
    found = _run(_launched, tmp_path, [resume])
    assert [rank["exits"] for rank in found] == [[0], [0]], found[0]["stderr"]
    said = "resume: --micro-batch-size 4, not the run's 8, which does not divide each of the 2 processes' share of a " \
           "minibatch (4); the batch stays the run's (pass --micro-batch-size to choose another)"
    assert said in found[0]["stderr"] and said not in found[1]["stderr"], found
    record = json.loads((run / "checkpoint-2" / "run_config.json").read_text())
    assert (record["micro_batch_size"], record["batch_size"]) == (4, 8)
