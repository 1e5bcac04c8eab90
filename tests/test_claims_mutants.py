"""The code that turns loop results into published claims, checked where a mutation audit found it unchecked: the
"met" verdicts (benchmarks/loop_targets.py), the rows a results file keeps (bench_loop.Results, common.write_results),
the longest-completion search's verdicts, and REPORT.md's rendering of them (benchmarks/report.py)."""
import json

from benchmarks import bench_loop, common, loop_targets, report


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


def test_trl_with_liger_is_held_to_2x():
    liger, = loop_targets.targets([step("fastgrpo", 10.0, 8.0), step("trl-liger", 15.0, 9.0)])
    assert (liger["target"], liger["speedup"], liger["met"]) == (2.0, 1.5, False), liger


def test_a_peak_equal_to_the_baselines_is_no_more_memory():
    """The target asks for no more peak memory: the same peak is within it."""
    t, = loop_targets.targets([step("fastgrpo", 10.0, 9.0), step("trl", 25.0, 9.0)])
    assert (t["within_peak"], t["met"]) == (True, True), t


def test_a_baseline_that_failed_after_timed_steps_is_not_compared():
    """A case that breaks after some steps keeps their medians beside its error (bench_loop.child): its step time is
    not a whole run's, so no verdict is drawn from it."""
    broken = step("trl", 40.0, 9.0) | {"error": "RuntimeError: CUDA error: an illegal memory access"}
    t, = loop_targets.targets([step("fastgrpo", 10.0, 8.0), broken])
    assert t["met"] is None and t["why"].endswith("an illegal memory access"), t


def test_same_machine_is_the_chosen_rows_machine():
    """The slower row ran beside TRL, the chosen (faster) one on another machine: the ratio is not same-machine."""
    rows = [step("fastgrpo", 12.0, 8.0, machine="40-a: beside TRL"), step("fastgrpo-fp8", 10.0, 8.0, machine="41-b"),
            step("trl", 30.0, 9.0, machine="40-a: the machine")]
    t, = loop_targets.targets(rows)
    assert (t["fastgrpo"], t["speedup"], t["same_machine"], t["speedup_same_machine"]) == ("fastgrpo-fp8", 3.0, False,
                                                                                          2.5), t


def test_the_same_machine_ratio_takes_the_fastest_row_of_that_machine():
    rows = [step("fastgrpo", 12.0, 8.0, machine="40-a"), step("fastgrpo-fp8", 15.0, 8.0, machine="40-a"),
            step("trl", 30.0, 9.0, machine="40-a")]
    t, = loop_targets.targets(rows)
    assert t["speedup_same_machine"] == 2.5, t


def test_a_rerun_at_another_completion_keeps_the_first(tmp_path):
    results = bench_loop.Results(tmp_path, "Test Card", {})
    results.add("tiny", [step("fastgrpo", 10.0, 8.0), step("trl", 25.0, 9.0)])
    path = results.add("tiny", [step("fastgrpo", 40.0, 9.0, completion=4096)])
    payload = json.loads(path.read_text())
    assert [(r["system"], r["completion"]) for r in payload["rows"]] == [("fastgrpo", 1024), ("trl", 1024),
                                                                         ("fastgrpo", 4096)]
    assert payload["replaced_rows"] == [] and [t["met"] for t in payload["targets"]] == [True]


def test_results_files_name_their_card_and_suite(tmp_path, monkeypatch):
    """REPORT.md heads each section with the file's suite and card, and draws loop charts for suites named loop_*."""
    path = bench_loop.Results(tmp_path, "NVIDIA H200", {}).add("qwen2.5-1.5b-lora", [step("trl", 25.0, 9.0)])
    payload = json.loads(path.read_text())
    assert (path.name, payload["suite"], payload["card"]) == ("loop_qwen2.5-1.5b-lora-nvidia-h200.json",
                                                              "loop_qwen2.5-1.5b-lora", "NVIDIA H200")
    monkeypatch.setattr(common, "card_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(common, "_EARLIER_RUNS", {})
    path = common.write_results("fp8", [{"ms": 1.0}], {}, tmp_path)
    assert (path.name, json.loads(path.read_text())["card"]) == ("fp8-nvidia-h100-80gb-hbm3.json",
                                                                 "NVIDIA H100 80GB HBM3")


def test_a_probe_that_peaks_over_the_cap_does_not_fit():
    """NVML's peak above the cap with no error (vLLM's pool is not bound by torch's fraction) is out of memory."""
    assert bench_loop.out_of_memory({"peak_gib": 24.2, "cap_gib": 24.0}) is True
    assert bench_loop.out_of_memory({"peak_gib": 23.8, "cap_gib": 24.0}) is False


def test_continue_fit_runs_the_probes_that_failed_again(tmp_path):
    probes = [{"completion": 2048, "fits": True, "out_of_memory": False},
              {"completion": 4096, "fits": False, "out_of_memory": True},
              {"completion": 3072, "fits": False, "out_of_memory": False, "error": "RuntimeError: broke"}]
    row = {"system": "fastgrpo", "kind": "max_fit", "completion": None, "cap_gib": 24.0, "prompts": 1,
           "generations": 8, "prompt_length": 256, "micro_batch": 8, "probes": probes}
    path = tmp_path / "loop.json"
    path.write_text(json.dumps({"rows": [row]}))
    case = bench_loop.Case(system="fastgrpo", shape="qwen2.5-1.5b-lora", completion=2048, prompts=1, cap_gib=24.0)
    assert sorted(bench_loop.earlier_probes(path, case)) == [2048, 4096]


def loop_result(rows, targets):
    return {"suite": "loop_tiny-lora", "card": "Test Card", "date": "2026-11-30", "versions": {"torch": "2.11"},
            "config": {}, "rows": rows, "targets": targets}


def table_rows(markdown: str, header_start: str) -> list[dict]:
    """The body of the markdown table whose header starts with header_start, as dicts of cell text."""
    lines = markdown.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    body = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        body.append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
    return body


def test_report_shows_each_verdict_as_the_file_holds_it():
    rows = [step("fastgrpo", 10.0, 8.04, machine="40-a"), step("trl", 19.64, 9.0, machine="40-a"),
            step("unsloth", 14.0, 7.0)]
    markdown = report.render_markdown([loop_result(rows, loop_targets.targets(rows))])
    trl, unsloth = table_rows(markdown, "| completion | baseline |")
    assert (trl["speedup"], trl["met"], trl["same_machine"], trl["speedup_same_machine"]) == ("1.96", "False", "True",
                                                                                              "1.96"), trl
    assert trl["peak_gib (fastgrpo / baseline)"] == "8 / 9" and unsloth["peak_gib (fastgrpo / baseline)"] == "8 / 7"
    assert (unsloth["met"], unsloth["same_machine"]) == ("False", "-"), unsloth


def test_report_keeps_every_row_and_each_probes_verdict():
    """Step rows in the rows table, max_fit rows in their own, rows of suites without kinds (e2e) in the rows table."""
    probes = [{"completion": 2048, "fits": True, "peak_gib": 12.0},
              {"completion": 4096, "fits": False, "out_of_memory": True, "peak_gib": 24.5},
              {"completion": 3072, "fits": False, "out_of_memory": False, "peak_gib": None}]
    fit = {"system": "fastgrpo", "kind": "max_fit", "completion": None, "cap_gib": 24.0, "max_completion": 2048,
           "first_failure": 4096, "probes": probes}
    markdown = report.render_markdown([loop_result([step("trl", 25.0, 9.0), fit], []),
                                       loop_result([{"system": "hf", "ms": 1234.5}], []) | {"suite": "e2e_tiny"}])
    assert [r["system"] for r in table_rows(markdown, "| system | kind |")] == ["trl"]
    fits, = table_rows(markdown, "| system | cap_gib |")
    assert fits["probes"] == "2048: fits, 12 GiB; 4096: out of memory, 24.5 GiB; 3072: error, - GiB", fits
    assert table_rows(markdown, "| system | ms |") == [{"system": "hf", "ms": "1,234"}]


def test_peaks_are_given_to_a_tenth_of_a_gib():
    t, = loop_targets.targets([step("fastgrpo", 10.0, 8.04), step("trl", 25.0, 9.46)])
    assert t["peak_gib"] == {"fastgrpo": 8.0, "baseline": 9.5}, t


def test_refreshing_the_verdicts_takes_the_current_rows_only(tmp_path, monkeypatch, capsys):
    """python -m benchmarks.loop_targets: a replaced (earlier, slower) TRL row does not lend its ratio."""
    rows = [step("fastgrpo", 10.0, 8.0), step("trl", 19.0, 9.0)]
    (tmp_path / "loop_tiny-lora-card.json").write_text(json.dumps({"rows": rows,
                                                                   "replaced_rows": [step("trl", 30.0, 9.0)]}))
    monkeypatch.setattr(loop_targets, "RESULTS_DIR", tmp_path)
    loop_targets.main([])
    t, = json.loads((tmp_path / "loop_tiny-lora-card.json").read_text())["targets"]
    assert (t["speedup"], t["met"]) == (1.9, False), t
    assert "loop_tiny-lora-card.json: 0 of 1 baselines met" in capsys.readouterr().out


def test_a_rows_times_are_the_medians_of_the_steps_after_the_warm_up():
    steps = [{"step_s": 30.0, "rollout_s": 20.0}, {"step_s": 10.0, "rollout_s": 6.0},
             {"step_s": 14.0, "rollout_s": 8.0}, {"step_s": 11.0, "rollout_s": 7.0}]
    row = bench_loop.summarize(steps, warmup=1)
    assert (row["step_s"], row["rollout_s"], row["steps_timed"], row["first_step_s"]) == (11.0, 7.0, 3, 30.0), row


def test_a_finished_search_says_how_far_it_searched():
    """max_completion None and no first_failure: nothing failed up to searched_to, which REPORT.md shows."""
    from types import SimpleNamespace

    case = bench_loop.Case(system="fastgrpo", shape="qwen2.5-1.5b-lora", completion=2048, prompts=1, cap_gib=24.0)
    row = bench_loop.fit_search(case, SimpleNamespace(fit_start=2048, fit_max=8192, fit_resolution=2048),
                                lambda c: {"completion": c.completion, "step_s": 1.0, "peak_gib": 10.0})
    assert (row["max_completion"], row["first_failure"], row["searched_to"], row["complete"]) == (8192, None, 8192,
                                                                                                  True), row
