"""10 steps of the whole GRPO loop on GPU with a Qwen2.5-1.5B-shaped model and LoRA.

    python -m pytest benchmarks/bench_train_loop.py -q -s

Random weights (no model hub) and a locally built word-level tokenizer over the model's 151936 ids, a length
reward, beta > 0 (reference log-probs through the disabled adapter). Per step the time splits into rollout,
reference (old + reference log-probs) and train (the policy update); steps 2-10 give the medians (step 1 pays
for Triton autotuning). Writes benchmarks/results/train_loop-<card>.json and prints a table last.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.common import GIB, print_table, refuse_script_run, write_results
from benchmarks.e2e import StepSetup, build_model

STEPS = int(os.environ.get("FASTGRPO_TRAIN_STEPS", "10"))
SETUP = dict(batch_size=16, num_generations=8, micro_batch_size=8, max_prompt_length=128, max_completion_length=512)


def _tokenizer(vocab_size: int):
    """Token i is the word `t<i>`: any sampled id decodes, and text length grows with the completion length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def _dataset(vocab_size: int, rows: int = 64, prompt_length: int = 100):
    """Random-word prompts. A random model almost never samples <eos>, so completions run to 512 tokens (~3.6K
    characters of "t123456 " words); a 3000-character target keeps the rewards unequal within a group."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab_size, (rows, prompt_length), generator=g)
    return [{"prompt": " ".join(f"t{i}" for i in row.tolist()), "target_length": 3000} for row in ids]


def test_train_loop_qwen_1_5b_lora(tmp_path):
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.rewards import length_reward
    from fastgrpo.train.trainer import GRPOTrainer

    model = build_model(StepSetup(model_name="qwen2.5-1.5b", system="fastgrpo", lora_rank=16))
    vocab = model.config.vocab_size
    tokenizer = _tokenizer(vocab)
    config = GRPOConfig(
        model="qwen2.5-1.5b (random weights)", lora_rank=16, learning_rate=1e-5, beta=0.04, max_steps=STEPS,
        output_dir=str(tmp_path), export=False, progress_bar=False, **SETUP,
    )
    trainer = GRPOTrainer(model, tokenizer, length_reward, _dataset(vocab), config)
    torch.cuda.reset_peak_memory_stats()
    history = trainer.train()
    t0 = time.perf_counter()
    trainer.export(tmp_path / "merged")
    export_s = time.perf_counter() - t0

    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"], m["kl"]])).all() for m in history)
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # the adapter trained
    timed = history[1:] or history

    def median(key):
        return statistics.median(m[key] for m in timed)

    row = {
        "model": "qwen2.5-1.5b", "mode": "lora16", "steps": STEPS, **SETUP,
        "rollout_s": median("rollout_s"), "rewards_s": median("rewards_s"), "reference_s": median("reference_s"),
        "train_s": median("train_s"),
        "step_s": median("rollout_s") + median("rewards_s") + median("reference_s") + median("train_s"),
        "rollout_tokens_per_s": median("rollout_tokens_per_s"), "train_tokens_per_s": median("train_tokens_per_s"),
        "completion_length": median("completion_length"),
        "peak_gib": max(m["peak_gpu_mem_gib"] for m in history),
        "peak_gib_run": torch.cuda.max_memory_allocated() / GIB,
        "export_s": export_s,
        "reward_first": history[0]["reward"], "reward_last": history[-1]["reward"],
    }
    write_results("train_loop", [row], {"what": "fastgrpo GRPOTrainer, 10 steps, LoRA r=16, bf16, length reward, "
                                                "beta=0.04; medians of steps 2-10"})
    print()
    print_table([row], ["model", "mode", "completion_length", "rollout_s", "rewards_s", "reference_s", "train_s",
                        "step_s", "rollout_tokens_per_s", "train_tokens_per_s", "peak_gib", "export_s"])


if __name__ == "__main__":
    refuse_script_run(__file__)
