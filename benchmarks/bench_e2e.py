"""A full GRPO training step (forward + backward + AdamW) per system, and a rollout, on GPU.

    python -m pytest benchmarks/bench_e2e.py -q -s --benchmark-disable-gc

Each case writes its row to benchmarks/results/e2e_<models>-<card>.json as soon as it is measured.
Narrow the run with FASTGRPO_E2E_LENGTHS=1024,4096 (completion lengths), FASTGRPO_E2E_MODELS=qwen2.5-1.5b,llama-3.1-8b
and FASTGRPO_E2E_MODES=lora,full.
"""
from __future__ import annotations

import os

import pytest

from benchmarks.common import measure_step, print_table, refuse_script_run, write_results
from benchmarks.e2e import SYSTEMS, StepSetup, make_step, modeling_globals_restored

LENGTHS = [int(x) for x in os.environ.get("FASTGRPO_E2E_LENGTHS", "1024,4096").split(",")]
MODELS = os.environ.get("FASTGRPO_E2E_MODELS", "qwen2.5-1.5b").split(",")
MODES = os.environ.get("FASTGRPO_E2E_MODES", "lora,full").split(",")
ROWS: list[dict] = []


def _cases():
    for model_name in MODELS:
        for lora_rank in [{"lora": 16, "full": None}[mode] for mode in MODES]:
            for length in LENGTHS:
                for system in SYSTEMS:
                    yield pytest.param(model_name, lora_rank, length, system,
                                       id=f"{model_name}-{'lora' if lora_rank else 'full'}-{length}-{system}")


@pytest.mark.parametrize("model_name,lora_rank,length,system", list(_cases()))
def test_train_step(benchmark, model_name, lora_rank, length, system):
    if system == "liger":
        pytest.importorskip("liger_kernel")
    setup = StepSetup(model_name=model_name, system=system, lora_rank=lora_rank, completion_length=length)
    row = {"model": model_name, "mode": "lora16" if lora_rank else "full", "completion_length": length,
           "num_generations": setup.num_generations, "prompt_length": setup.prompt_length, "system": system}
    # Liger's patches reach transformers' module names: undone after the case, so they touch no other case.
    with modeling_globals_restored():
        tokens = setup.num_generations * (setup.prompt_length + length)
        row.update(measure_step(benchmark, lambda: make_step(setup), tokens))
    ROWS.append(row)
    write_results("e2e_" + "_".join(MODELS), ROWS, {"what": "one GRPO training step: forward + backward + AdamW, bf16, on-policy"})
    benchmark.extra_info.update(row)


def teardown_module(module):
    if ROWS:
        print()
        print_table(ROWS, ["model", "mode", "completion_length", "system", "ms", "peak_gib", "tokens_per_s"])


if __name__ == "__main__":
    refuse_script_run(__file__)
