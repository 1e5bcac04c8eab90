"""The code that turns loop results into published claims, checked where a mutation audit found it unchecked: the
"met" verdicts (benchmarks/loop_targets.py), the rows a results file keeps (bench_loop.Results, common.write_results),
the longest-completion search's verdicts, and REPORT.md's rendering of them (benchmarks/report.py)."""
from benchmarks import loop_targets


def step(system, step_s, peak, completion=1024, machine=None, **fields):
    row = {"system": system, "kind": "step", "completion": completion, "step_s": step_s, "peak_gib": peak,
           "rollout_s": step_s / 2, "logprobs_s": step_s / 8, "update_s": step_s / 4, **fields}
    return row | ({"machine": machine} if machine else {})


def test_a_ratio_that_rounds_up_to_the_target_is_not_met():
    """1.996x is written 2.0 (two decimals) but is short of 2x: the verdict takes the ratio, not its rounding."""
    short, = loop_targets.targets([step("fastgrpo", 10.0, 8.0), step("trl", 19.96, 9.0)])
    assert (short["speedup"], short["met"]) == (2.0, False), short
    unsloth, = loop_targets.targets([step("fastgrpo", 10.0, 8.0), step("unsloth", 12.96, 9.0)])
    assert (unsloth["speedup"], unsloth["met"]) == (1.3, False), unsloth
