"""The commands as `torchrun --nproc_per_node 2 -m fastgrpo ...` runs them (2 gloo processes, forked, each running
fastgrpo.train.cli.main): a command's refusal or stop is one line, printed by rank 0 alone; `fastgrpo eval`, which
does not split its rows across processes, evaluates on rank 0 alone."""
import json

from tests.forked_gloo import cli, run_forked

EVAL = ["eval", "--max-examples", "4", "--num-generations", "2", "--max-new-tokens", "4"]


def _run(worker, tmp_path, *args) -> list:
    return run_forked(worker, tmp_path, *args, deadline_s=120, group_timeout_s=60)


def test_eval_runs_on_rank_0_alone_and_writes_once(tmp_path):
    """Each process took the output folder's lock: rank 1 met 'in use by another run (PID <rank 0's>)' and exited 2,
    so torchrun stopped rank 0 in the middle of its evaluation."""
    found = _run(cli, tmp_path, [[*EVAL, "--output-dir", str(tmp_path / "out" / "eval")]])
    assert [rank["exits"] for rank in found] == [[0], [0]], found[1]["stderr"]
    assert "accuracy" in found[0]["stdout"] and found[1]["stdout"] == "" and found[1]["writes"] == []
    results = (tmp_path / "out" / "eval" / "results.jsonl").read_text().splitlines()
    assert sorted((r["index"], r["sample"]) for r in map(json.loads, results)) == [(i, s) for i in range(4)
                                                                                    for s in range(2)]


def test_eval_of_a_sharded_checkpoint_loads_its_shards(tmp_path):
    """`fastgrpo eval --checkpoint` of a run fully fine-tuned on 2 processes (FSDP2: its weights in checkpoint-<step>/
    shards) evaluates the trained weights, as of the run's export; it stopped with KeyError 'trainable' (a
    traceback)."""
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
