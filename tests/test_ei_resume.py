"""`fastgrpo ei` stopped in the middle of a round and resumed gives the rounds of a straight run: a signal while a
round samples or scores abandons it (the previous round's checkpoint, with the RNG states the abandoned round started
from), one during its SFT lets it finish and saves it."""
from __future__ import annotations

import json

from fastgrpo.train.cli import main

SMALL = ["--questions-per-step", "4", "--num-generations", "2", "--batch-size", "4", "--micro-batch-size", "4",
         "--no-progress-bar", "--logging-steps", "0", "--no-export"]
REWARD = """import os, signal
calls = []
def fn(prompts, completions, **kw):
    calls.append(1)
    if len(calls) == {stop_at}:
        os.kill(os.getpid(), signal.SIGINT)
    return [float(c[:1] in "abc") for c in completions]
"""


def _rounds(path):
    lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in ("round", "reward", "kept", "sft_loss_last")} for m in lines]


def _reward(tmp_path, stop_at):
    """The flags of the reward file (one path: a resume refuses another), which sends SIGINT on call stop_at."""
    path = tmp_path / "reward.py"
    path.write_text(REWARD.replace("{stop_at}", str(stop_at)))
    return ["--reward-funcs", f"{path}:fn"]


def test_a_round_abandoned_while_scoring_resumes_as_the_straight_run(tmp_path):
    straight = tmp_path / "straight"
    assert main(["ei", "--output-dir", str(straight), "--ei-steps", "3", *SMALL, *_reward(tmp_path, 0)]) == 0
    stopped = tmp_path / "stopped"
    argv = ["ei", "--output-dir", str(stopped), "--ei-steps", "3", *SMALL]
    assert main([*argv, *_reward(tmp_path, 2)]) == 130  # SIGINT while round 2 scores: round 1's checkpoint stays
    assert sorted(p.name for p in stopped.glob("checkpoint-*")) == ["checkpoint-1"]
    assert main([*argv, *_reward(tmp_path, 0), "--resume"]) == 0
    assert _rounds(stopped) == _rounds(straight)
    assert any(m["kept"] for m in _rounds(straight)[1:])  # the rounds after the stop fine-tuned something
