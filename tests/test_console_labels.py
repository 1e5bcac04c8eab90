"""Each command's console line names its numbers as metrics.jsonl does, with the same values: `fastgrpo ei` showed
its round's sft_loss_last as "loss" (a name its log lacks), train "clip_ratio" as "clip" and "completion_length" as
"length", and sft left its tokens_per_s out."""
import json

import pytest

from fastgrpo.train.cli import main

RUNS = {
    "train": ["--max-steps", "2", "--batch-size", "16", "--micro-batch-size", "16"],
    "sft": ["--max-steps", "2"],
    "ei": ["--ei-steps", "2", "--questions-per-step", "4"],  # every sample kept (_all_correct): an SFT each round
}
ALL_CORRECT = "def fn(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"


def _number(text: str) -> tuple[float, float]:
    """A shown number and how far its rounding may be from the logged one."""
    scale = {"K": 1e3, "M": 1e6}.get(text[-1], 1.0)
    digits = text[:-1] if scale != 1.0 else text
    decimals = len(digits.partition(".")[2]) if "e" not in digits else 12
    return float(digits) * scale, 0.5 * 10**-decimals * scale


@pytest.mark.parametrize("command", sorted(RUNS))
def test_console_labels_are_the_metrics_names_and_values(command, tmp_path, capsys):
    argv = [command, "--output-dir", str(tmp_path / "run"), "--no-progress-bar", "--logging-steps", "1", "--no-export"]
    if command == "ei":
        (tmp_path / "all_correct.py").write_text(ALL_CORRECT)
        argv += ["--reward-funcs", f"{tmp_path / 'all_correct.py'}:fn"]
    assert main([*argv, *RUNS[command]]) == 0
    unit = "round" if command == "ei" else "step"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{unit} ")]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == len(logged) == 2, lines
    for line, metrics in zip(lines, logged):  # --logging-steps 1: a line is one step's metrics
        counter, *parts = line.split(" | ")
        assert counter == f"{unit} {metrics[unit]}/2"
        shown = dict(part.rsplit(" ", 1) for part in parts if not part.startswith("peak RSS "))
        for label, value in shown.items():
            assert label in metrics, f"{command}: the console's {label!r} is not in metrics.jsonl: {line}"
            shown_value, rounding = _number(value)
            assert shown_value == pytest.approx(metrics[label], rel=6e-3, abs=rounding), (label, line)
        if command == "ei":
            assert "sft_loss_last" in shown and "loss" not in shown, line
