"""FastGRPOTrainer vs trl.GRPOTrainer vs TRL with use_liger_kernel: one GRPO training step, time and peak memory.

    python -m benchmarks.bench_trl                          # GPU: Qwen2.5-1.5B shapes, LoRA, 8 x 1024 and 8 x 4096
    python -m benchmarks.bench_trl --dry-run                # CPU: a tiny model, short completions, every system

Systems, each case in its own process (Liger patches transformers' classes; a fresh CUDA allocator per case):
  trl             trl.GRPOTrainer (TRL's own chunked fused lm_head for the log-probs, its eager loss over them)
  trl-liger       the same with use_liger_kernel=True (Liger's RMSNorm / RoPE / SwiGLU kernels)
  fastgrpo        fastgrpo.integrations.trl.FastGRPOTrainer (patch_model's kernels, fastgrpo's fused loss)
  fastgrpo-offload  the same with offload_activations=True (checkpointed layers' inputs in pinned CPU memory)
The same trl.GRPOConfig for all: LoRA r=16 / alpha 32 on the 7 linears of every layer (PEFT's fp32 adapters) over a
bf16 base built from the Qwen2.5-1.5B config with random weights (saved once to --models-dir with a word-level
tokenizer built here: no hub), bf16 autocast, HF gradient checkpointing, 8 completions of one prompt of
--prompt-length tokens per step (per_device_train_batch_size 8, one micro-batch), beta 0.04 (reference log-probs
with the adapter disabled), loss_type dapo, epsilon 0.2 / 0.28, AdamW. The rollout is replaced by fixed random
completions of exactly C tokens (TRL's `_generate_single_turn` hook): generation is the same HF `generate` in every
system and would dominate the step; what is timed is what the systems differ in (reference log-probs, the loss
forward and backward, the optimizer step). --generate times TRL's HF generation too.

Time: median wall seconds of a whole `training_step` (CUDA-synchronized at both ends) over --steps steps after
--warmup. Peak: torch.cuda.max_memory_allocated over the measured steps (weights, adapters and AdamW states
included), GiB. Results: benchmarks/results/trl-<card>.json (common.write_results); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SYSTEMS = ("trl", "trl-liger", "fastgrpo", "fastgrpo-offload")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD, EOS, UNK = 0, 1, 2  # special ids of the built tokenizer; token "t<i>" is id i for i >= 3
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024)


def build_model_folder(folder: Path, shape: dict, device: str) -> None:
    """A Qwen2 model of `shape` with random bf16 weights and a word-level tokenizer ("t<i>" -> i), saved once."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if (folder / "config.json").exists():
        return
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": UNK, **{f"t{i}": i for i in range(3, shape["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")
    config = Qwen2Config(**shape, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run_case(system: str, completion: int, opts: dict) -> dict:
    """One system at one completion length, in this process: returns the row."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available() and not opts["dry_run"]
    folder, G = opts["folder"], opts["generations"]
    vocab = opts["vocab_size"]
    # Not AutoTokenizer: transformers 5 would load a qwen2 folder's tokenizer as Qwen2Tokenizer (a BPE), not ours.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    rng = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{i}" for i in torch.randint(3, vocab, (opts["prompt_length"],), generator=rng).tolist())
               for _ in range(4)]

    def reward(prompts, completions, completion_ids, **kwargs):  # the share of ids divisible by 7
        return [sum(i % 7 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), max_steps=opts["warmup"] + opts["steps"],
        per_device_train_batch_size=G, gradient_accumulation_steps=1, num_generations=G,
        max_completion_length=completion, beta=0.04, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        learning_rate=1e-5, seed=0, bf16=cuda, fp16=False, use_cpu=not cuda, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_liger_kernel=system == "trl-liger",
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32}, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": completion},  # exactly C tokens when --generate
    )
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             task_type="CAUSAL_LM")
    times: list[float] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
                if len(times) == opts["warmup"]:
                    torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    base = GRPOTrainer
    kwargs = {}
    if system.startswith("fastgrpo"):
        from fastgrpo.integrations.trl import FastGRPOTrainer

        base, kwargs = FastGRPOTrainer, {"offload_activations": system == "fastgrpo-offload"}

    class Replay(base):
        """Fixed random completions of exactly C tokens instead of generating (same for every system)."""

        def _generate_single_turn(self, prompt_ids, *a, **k):
            if opts["generate"]:
                return super()._generate_single_turn(prompt_ids, *a, **k)
            ids = torch.randint(3, vocab, (len(prompt_ids), completion), generator=rng)
            return ids.tolist(), None

    trainer = Replay(model=folder, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                     processing_class=tokenizer, peft_config=peft_config, callbacks=[Steps()], **kwargs)
    trainer.train()
    measured = times[opts["warmup"]:]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "system": system, "completion": completion, "sequences": G, "prompt_length": opts["prompt_length"],
        "step_s": statistics.median(measured), "step_s_all": measured,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "tokens_per_s": G * (completion + opts["prompt_length"]) / statistics.median(measured),
        "first_loss": losses[0] if losses else None,
    }


def child(argv: list[str]) -> None:
    system, completion, opts = argv[0], int(argv[1]), json.loads(argv[2])
    try:
        row = run_case(system, completion, opts)
    except Exception as err:  # one failing case is a row with its error, not a lost run
        row = {"system": system, "completion": completion, "error": f"{type(err).__name__}: {err}",
               "trace": traceback.format_exc().splitlines()[-8:]}
    print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--completions", nargs="*", type=int, default=None, help="default: 1024 4096 (dry run: 16)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--generate", action="store_true", help="time TRL's HF generation too (no replay)")
    parser.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "fastgrpo-bench-models"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, short completions")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per case")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from benchmarks.common import QWEN25_15B, print_table, require_cuda, write_results

    if not args.dry_run:
        require_cuda(parser)
    shape = TINY if args.dry_run else QWEN25_15B
    completions = args.completions or ([16] if args.dry_run else [1024, 4096])
    folder = Path(args.models_dir) / ("tiny-qwen2" if args.dry_run else "qwen2.5-1.5b")
    build_model_folder(folder, shape, "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    opts = {"folder": str(folder), "generations": args.generations, "prompt_length": args.prompt_length
            if not args.dry_run else 8, "warmup": args.warmup, "steps": args.steps, "generate": args.generate,
            "dry_run": args.dry_run, "vocab_size": shape["vocab_size"]}
    rows = []
    for completion in completions:
        for system in args.systems:
            env = dict(os.environ, PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1")
            started = time.perf_counter()
            try:
                out = subprocess.run([sys.executable, "-m", "benchmarks.bench_trl", "--child", system, str(completion),
                                      json.dumps(opts)], capture_output=True, text=True, env=env, timeout=args.timeout,
                                     cwd=Path(__file__).resolve().parent.parent)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                row = json.loads(lines[-1][7:]) if lines else {
                    "system": system, "completion": completion, "error": f"exit {out.returncode}",
                    "trace": (out.stderr or out.stdout).splitlines()[-8:]}
            except subprocess.TimeoutExpired:
                row = {"system": system, "completion": completion, "error": f"timeout after {args.timeout} s"}
            row["case_s"] = time.perf_counter() - started
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
    config = {k: v for k, v in opts.items() if k != "folder"} | {"shape": "tiny" if args.dry_run else "qwen2.5-1.5b",
                                                                 "lora": {"r": 16, "alpha": 32,
                                                                          "targets": LORA_TARGETS}}
    if not args.dry_run:
        print("wrote", write_results("trl", rows, config))
    print_table(rows, ["system", "completion", "step_s", "peak_gib", "tokens_per_s", "first_loss", "error"])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
