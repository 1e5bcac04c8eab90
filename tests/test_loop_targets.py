"""benchmarks/loop_targets.py: each baseline row against the fastest fastgrpo row within its peak memory."""
import json

from benchmarks import bench_loop, loop_targets


def step(system, step_s, peak, completion=4096, machine=None, **phases):
    row = {"system": system, "kind": "step", "completion": completion, "step_s": step_s, "peak_gib": peak,
           "rollout_s": step_s / 2, "logprobs_s": step_s / 8, "update_s": step_s / 4, **phases}
    return row | ({"machine": machine} if machine else {})


def test_the_fastest_fastgrpo_row_within_the_baselines_peak_is_compared():
    rows = [step("fastgrpo", 30.0, 20.0, machine="28-a: a machine"), step("fastgrpo-fp8", 24.0, 60.0),
            step("fastgrpo-vllm", 40.0, 10.0), step("trl", 50.0, 31.0, machine="28-a: a machine, GPU 1")]
    (t,) = loop_targets.targets(rows)
    # fastgrpo-fp8 is faster but peaks above TRL: the target asks for no more memory
    assert (t["fastgrpo"], t["speedup"], t["met"], t["within_peak"]) == ("fastgrpo", 1.67, False, True)
    assert t["same_machine"] is True and t["peak_gib"] == {"fastgrpo": 20.0, "baseline": 31.0}
    assert t["phases"] == {"rollout_s": 1.67, "logprobs_s": 1.67, "update_s": 1.67}


def test_the_ratio_against_the_baselines_own_machine_is_given_beside_the_fastest():
    """One setting's step moved ~15% between processes and machines (benchmarks/NOTES.md, thirty-eighth session): the
    verdict also gives the ratio against the fastest fastgrpo row measured on the baseline's machine."""
    rows = [step("fastgrpo-a", 12.5, 30.0, machine="38-d: another machine"),
            step("fastgrpo-b", 13.0, 30.0, machine="39-a: the machine"),
            step("fastgrpo-c", 12.0, 50.0, machine="39-a: the machine, over the peak"),
            step("trl", 24.7, 44.0, machine="39-a: the machine")]
    (t,) = loop_targets.targets(rows)
    assert (t["fastgrpo"], t["speedup"], t["same_machine"]) == ("fastgrpo-a", 1.98, False)
    assert t["speedup_same_machine"] == 1.9  # fastgrpo-b: fastgrpo-c peaks above TRL
    alone, = loop_targets.targets(rows[:1] + rows[3:])
    assert alone["speedup_same_machine"] is None


def test_met_needs_the_ratio_and_the_memory():
    met, = loop_targets.targets([step("fastgrpo", 10.0, 8.0), step("unsloth", 13.0, 9.0)])
    assert met["met"] is True and met["target"] == 1.3 and met["same_machine"] is None
    short, = loop_targets.targets([step("fastgrpo", 10.0, 8.0), step("unsloth", 12.9, 9.0)])
    assert short["met"] is False
    over, = loop_targets.targets([step("fastgrpo", 10.0, 9.5), step("trl", 40.0, 9.0)])
    assert (over["speedup"], over["within_peak"], over["met"]) == (4.0, False, False)


def test_rows_without_a_comparison_say_why():
    rows = [step("fastgrpo", 10.0, 8.0, completion=1024),
            {"system": "unsloth", "kind": "step", "completion": 1024, "step_s": None, "peak_gib": 0.7,
             "error": "NotImplementedError: no fast_inference with full fine-tuning\n  File ..."},
            step("trl", 40.0, 9.0, completion=4096), step("fastgrpo", 5.0, 8.0, completion=4096) | {"error": "OOM"},
            {"system": "fastgrpo", "kind": "max_fit", "completion": None}]
    unsloth, trl = loop_targets.targets(rows)
    assert unsloth["met"] is None and unsloth["why"].endswith("no fast_inference with full fine-tuning")
    assert trl["met"] is None and trl["why"] == "no fastgrpo row of this completion"


def test_every_write_of_a_loop_file_recomputes_its_targets(tmp_path):
    results = bench_loop.Results(tmp_path, "Test Card", {})
    path = results.add("tiny", [step("fastgrpo", 10.0, 8.0), step("trl", 19.0, 9.0)])
    assert [t["met"] for t in json.loads(path.read_text())["targets"]] == [False]
    results.add("tiny", [step("trl", 21.0, 9.0)])  # TRL's row replaced: the verdict follows it
    assert [t["speedup"] for t in json.loads(path.read_text())["targets"]] == [2.1]
