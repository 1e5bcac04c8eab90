"""The longest completion length (8 generations) whose training step fits a 24 GiB card, per system.

    python -m pytest benchmarks/bench_context.py -q -s

The card is capped with torch.cuda.set_per_process_memory_fraction (an RTX 4090 has 24 GiB); lengths double
from 512 until a step runs out of memory, then bisect to FASTGRPO_CONTEXT_RESOLUTION tokens (512). A step is
forward + backward + AdamW over all 8 generations, in micro-batches of FASTGRPO_MICRO_BATCH sequences (8: one
forward over all of them; 1: gradient accumulation one sequence at a time). Rows go to
benchmarks/results/context_mb<N>-<card>.json. Also measures the peak memory of
one Llama-3.1-8B LoRA step at 8 x 20K tokens (uncapped).
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from benchmarks.common import GIB, print_table, refuse_script_run, write_results
from benchmarks.e2e import SYSTEMS, StepSetup, make_step, modeling_globals_restored

BUDGET_GIB = float(os.environ.get("FASTGRPO_BUDGET_GIB", "24"))
MAX_LENGTH = int(os.environ.get("FASTGRPO_MAX_LENGTH", "65536"))
RESOLUTION = int(os.environ.get("FASTGRPO_CONTEXT_RESOLUTION", "512"))
MICRO_BATCH = int(os.environ.get("FASTGRPO_MICRO_BATCH", "8"))
ROWS: list[dict] = []


def _fits(setup: StepSetup) -> tuple[bool, float | None]:
    step = None
    try:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with modeling_globals_restored():  # Liger's patches of transformers' module names end with the case
            step = make_step(setup)
            step()
        torch.cuda.synchronize()
        return True, torch.cuda.max_memory_allocated() / GIB
    except torch.OutOfMemoryError:
        return False, None
    finally:
        del step
        gc.collect()
        torch.cuda.empty_cache()


def _record(row):
    ROWS.append(row)
    write_results(f"context_mb{MICRO_BATCH}", ROWS, {
        "budget_gib": BUDGET_GIB, "prompt_length": 256, "lora_rank": 16, "micro_batch_size": MICRO_BATCH,
        "resolution": RESOLUTION,
    })


@pytest.mark.parametrize("system", SYSTEMS)
def test_longest_completion_in_budget(system):
    if system == "liger":
        pytest.importorskip("liger_kernel")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, BUDGET_GIB * GIB / total))
    try:
        ok_len, ok_peak, bad_len, length = None, None, None, 512
        while length <= MAX_LENGTH:
            fits, peak = _fits(StepSetup(system=system, completion_length=length, micro_batch_size=MICRO_BATCH))
            if not fits:
                bad_len = length
                break
            ok_len, ok_peak, length = length, peak, length * 2
        while ok_len is not None and bad_len is not None and bad_len - ok_len > RESOLUTION:
            mid = (ok_len + bad_len) // 2 // RESOLUTION * RESOLUTION
            fits, peak = _fits(StepSetup(system=system, completion_length=mid, micro_batch_size=MICRO_BATCH))
            if fits:
                ok_len, ok_peak = mid, peak
            else:
                bad_len = mid
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    _record({"test": "longest_completion", "model": "qwen2.5-1.5b", "system": system, "micro_batch": MICRO_BATCH,
             "budget_gib": BUDGET_GIB,
             "longest_completion": ok_len, "peak_gib": ok_peak, "first_oom": bad_len,
             "searched_up_to": MAX_LENGTH})


def test_llama8b_20k_peak():
    setup = StepSetup(model_name="llama-3.1-8b", system="fastgrpo", completion_length=20480 - 256,
                      micro_batch_size=MICRO_BATCH)
    fits, peak = _fits(setup)
    _record({"test": "llama8b_8x20k", "model": "llama-3.1-8b", "system": "fastgrpo", "micro_batch": MICRO_BATCH,
             "fits": fits,
             "peak_gib": peak, "tokens_per_sequence": 20480})


def teardown_module(module):
    if ROWS:
        print()
        print_table(ROWS, ["test", "model", "system", "micro_batch", "longest_completion", "first_oom", "fits", "peak_gib"])


if __name__ == "__main__":
    refuse_script_run(__file__)
