"""benchmarks.bench_loop's longest-completion search: the doubling and bisection, the row written after every probe,
probes reused from an earlier search (--continue-fit), the results file keeping what it already held, the free
memory a capped case reports, and the vLLM share a capped case asks for."""
import dataclasses
import json
from types import SimpleNamespace

import pytest

from benchmarks.bench_loop import (GIB, Case, Results, capped_mem_get_info, earlier_probes, fit_search, out_of_memory,
                                 vllm_fraction)

ARGS = SimpleNamespace(fit_start=2048, fit_max=32768, fit_resolution=2048)
CASE = Case(system="fastgrpo", shape="qwen2.5-1.5b-lora", completion=2048, prompts=1, cap_gib=24.0)


class Card:
    """A step fits while completion <= limit; above it, the child reports an out-of-memory error."""

    def __init__(self, limit: int, broken_at: int | None = None):
        self.limit, self.broken_at, self.ran = limit, broken_at, []

    def __call__(self, case: Case) -> dict:
        self.ran.append(case.completion)
        assert len(self.ran) <= 16, f"the search does not converge: probes {self.ran}"  # a failure, not a hang
        row = {"system": case.system, "completion": case.completion, "step_s": 1.0, "peak_gib": 10.0}
        if case.completion == self.broken_at:
            return row | {"error": "RuntimeError: something else broke"}
        if case.completion > self.limit:
            return row | {"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return row


def test_search_doubles_then_bisects_to_the_resolution():
    card = Card(limit=13000)
    row = fit_search(CASE, ARGS, card)
    assert card.ran == [2048, 4096, 8192, 16384, 12288, 14336]
    assert (row["max_completion"], row["first_failure"], row["complete"]) == (12288, 14336, True)


def test_every_probe_is_reported_as_it_ends():
    reported = []
    fit_search(CASE, ARGS, Card(limit=5000), report=lambda r: reported.append(json.loads(json.dumps(r))))
    assert [len(r["probes"]) for r in reported] == [1, 2, 3, 4]  # 2048, 4096, 8192, then 6144
    assert [r["complete"] for r in reported] == [False] * 4
    assert [(r["max_completion"], r["first_failure"]) for r in reported] == [
        (2048, None), (4096, None), (4096, 8192), (4096, 6144)]


def test_known_probes_are_reused_and_only_the_rest_run():
    first = fit_search(CASE, ARGS, Card(limit=13000, broken_at=12288))
    assert "error" in first and first["max_completion"] == 8192  # not out of memory: the search ends there
    known = {p["completion"]: p for p in first["probes"] if p["fits"] or p["out_of_memory"]}
    card = Card(limit=13000)
    row = fit_search(CASE, ARGS, card, known)
    assert card.ran == [12288, 14336]  # the error probe runs again, the verdicts do not
    assert [p.get("reused", False) for p in row["probes"]] == [True] * 4 + [False] * 2
    assert row["max_completion"] == 12288


UNSLOTH_PROFILING_RACE = (
    "RuntimeError: Unsloth: vLLM could not finish memory profiling because another process sharing this GPU released "
    "memory while vLLM was measuring it.\nThis is a transient race on a shared GPU, NOT an out of memory error.")


@pytest.mark.parametrize("error, verdict", [
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 952.00 MiB.", True),
    ("RuntimeError: CUDA error: out of memory", True),
    ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", True),
    ("ValueError: Free memory on device (5.1/24.0 GiB) on startup is less than desired GPU memory utilization", True),
    (UNSLOTH_PROFILING_RACE, False),  # it names out-of-memory only to say it is not one
    ("RuntimeError: something else broke", False),
])
def test_out_of_memory_is_told_by_what_the_libraries_raise(error, verdict):
    assert out_of_memory({"error": error}) is verdict


def test_an_error_that_only_mentions_memory_ends_the_search():
    def card(case):
        return {"completion": case.completion, "peak_gib": 6.5, "cap_gib": 24.0, "error": UNSLOTH_PROFILING_RACE}

    row = fit_search(CASE, ARGS, card)
    assert (row["max_completion"], row["first_failure"], row["complete"]) == (None, None, True)
    assert row["error"] == UNSLOTH_PROFILING_RACE and row["probes"][0]["out_of_memory"] is False


def test_results_keep_notes_and_other_rows(tmp_path):
    results = Results(tmp_path, "Some Card", {"prompts": 8, "steps": 2})
    path = results.add("qwen2.5-1.5b-lora", [{"system": "trl", "kind": "step", "completion": 1024, "step_s": 9.0}])
    payload = json.loads(path.read_text())
    payload["config"]["note"] = "a person's note"
    payload["versions"]["vllm"] = "0.24.0"
    path.write_text(json.dumps(payload))

    searching = Results(tmp_path, "Some Card", {"max_fit": {"cap_gib": 24.0}})
    row = fit_search(dataclasses.replace(CASE, system="trl"), ARGS, Card(limit=3000),
                     report=lambda r: searching.add("qwen2.5-1.5b-lora", [r]))
    searching.add("qwen2.5-1.5b-lora", [row])
    payload = json.loads(path.read_text())
    assert payload["config"] == {"prompts": 8, "steps": 2, "note": "a person's note", "max_fit": {"cap_gib": 24.0}}
    assert payload["versions"]["vllm"] == "0.24.0"  # what an earlier run's rows used, though not importable here
    assert [(r["system"], r["kind"]) for r in payload["rows"]] == [("trl", "step"), ("trl", "max_fit")]
    trl = dataclasses.replace(CASE, system="trl")
    assert set(earlier_probes(path, trl)) == {2048, 4096}
    for other in (dataclasses.replace(trl, cap_gib=20.0), dataclasses.replace(trl, prompt_length=512), CASE):
        assert earlier_probes(path, other) == {}  # another cap, batch or system: another search


def test_a_rerun_keeps_the_row_it_replaces(tmp_path):
    results = Results(tmp_path, "Some Card", {})
    step = {"system": "fastgrpo", "kind": "step", "completion": 1024}
    for step_s in (7.4, 6.9, 6.8):
        path = results.add("qwen2.5-1.5b-lora", [{**step, "step_s": step_s}])
    payload = json.loads(path.read_text())
    assert [r["step_s"] for r in payload["rows"]] == [6.8]
    assert [r["step_s"] for r in payload["replaced_rows"]] == [7.4, 6.9]


def test_a_rerun_keeps_the_files_own_top_level_notes(tmp_path):
    """A session's note beside the rows (e.g. "forty_third_session": runs that are not rows) is a person's record: a
    later run's write keeps it (it was dropped: only config keys were kept)."""
    results = Results(tmp_path, "Some Card", {})
    path = results.add("qwen2.5-1.5b-lora", [{"system": "trl", "kind": "step", "completion": 1024, "step_s": 9.0}])
    payload = json.loads(path.read_text())
    payload["some_session"] = {"note": "two more processes", "rows": [{"step_s": 8.9}]}
    path.write_text(json.dumps(payload))
    results.add("qwen2.5-1.5b-lora", [{"system": "trl", "kind": "step", "completion": 1024, "step_s": 8.8}])
    payload = json.loads(path.read_text())
    assert payload["some_session"] == {"note": "two more processes", "rows": [{"step_s": 8.9}]}
    assert [r["step_s"] for r in payload["rows"]] == [8.8] and list(payload)[-1] == "some_session", payload


def test_searches_of_other_caps_or_batches_keep_their_rows(tmp_path):
    results = Results(tmp_path, "Some Card", {})
    for case in (CASE, dataclasses.replace(CASE, cap_gib=16.0), dataclasses.replace(CASE, generations=4)):
        results.add("qwen2.5-1.5b-lora", [fit_search(case, ARGS, Card(limit=3000))])
    rows = json.loads(results.path("qwen2.5-1.5b-lora").read_text())["rows"]
    assert [(r["cap_gib"], r["generations"]) for r in rows] == [(24.0, 8), (16.0, 8), (24.0, 4)]


def test_capped_mem_get_info_answers_as_a_card_of_the_cap():
    held = [3 * GIB]
    mem_get_info = capped_mem_get_info(24, lambda: held[0])
    assert mem_get_info() == (21 * GIB, 24 * GIB)
    assert mem_get_info(0) == (21 * GIB, 24 * GIB)  # torch's signature: an optional device
    held[0] = 30 * GIB  # past the cap (vLLM's pool is not bound by torch's fraction): nothing free, not negative
    assert mem_get_info() == (0, 24 * GIB)


def test_capped_vllm_share_is_the_free_memory_less_2_gib(tmp_path, monkeypatch):
    import torch

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(bytes(1024))
    held = [5 * GIB]  # what the case holds by NVML: more than torch reserved (its CUDA context, other pools)
    monkeypatch.setattr(torch.cuda, "mem_get_info", capped_mem_get_info(24, lambda: held[0]))
    case = dataclasses.replace(CASE, folder=str(tmp_path), completion=10**9)  # a KV cache far above the cap
    assert vllm_fraction(case) == round((24 - 5 - 2) / 24, 4)
    small = dataclasses.replace(case, completion=256)  # weights + KV + 3 GiB fit: the share asks for that only
    kv = 2 * 2 * 2 * 16 * 2 * small.batch * (256 + 256)
    assert vllm_fraction(small) == round((kv + 3 * GIB + 1024) / (24 * GIB), 4)
